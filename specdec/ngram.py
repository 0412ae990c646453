"""N-gram matching over a token history: what n-gram lookup proposes next. The sampler's lookup rounds
(specdec/sampling/lookup.py) propose it as a draft; the copy-aware drafters (specdec/drafters/copy_hydra.py) read it
as an input, one position at a time when sampling (`ngram_match`) and at every position of a block when training
(`lookup_proposals`, the same rule vectorised)."""

from __future__ import annotations

import torch

MIN_NGRAM, MAX_NGRAM = 2, 3  # the sampler's lookup defaults (sampler.lookup_min_ngram / lookup_max_ngram)


def ngram_match(history: list[int], max_tokens: int, min_ngram: int, max_ngram: int) -> tuple[list[int], int]:
    """Up to max_tokens tokens that followed the most recent earlier occurrence of history's last n tokens, for the
    longest n in [min_ngram, max_ngram] that occurs, and that n; ([], 0) when none does."""
    size = len(history)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = history[size - n :]
        first = suffix[0]
        # scan from the most recent start backwards; a start must leave at least one token after the n-gram
        for i in range(size - n - 1, -1, -1):
            if history[i] == first and history[i : i + n] == suffix:
                return history[i + n : i + n + max_tokens], n
    return [], 0


def lookup_proposals(ids: torch.Tensor, min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """For every position p of ids [B, T]: the token `ngram_match(ids[b, :p + 1], 1, min_ngram, max_ngram)` proposes
    for position p + 1, and the n of its match -> (tokens [B, T], 0 where none; n [B, T], 0 where none). Vectorised
    over all pairs of positions: eq[b, p, e] says the n tokens ending at p equal the n ending at e."""
    B, T = ids.shape
    tokens = torch.zeros_like(ids)
    found = torch.zeros_like(ids)
    before = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril(-1)  # [p, e]: e < p (a token follows e)
    eq = ids[:, :, None] == ids[:, None, :]  # [B, T, T] n = 1
    runs = eq.clone()  # [B, p, e]: the n tokens ending at p equal the n ending at e
    steps = {1: runs}
    for n in range(2, max_ngram + 1):
        longer = torch.zeros_like(runs)
        longer[:, 1:, 1:] = runs[:, :-1, :-1]
        runs = eq & longer
        steps[n] = runs
    for n in range(max_ngram, min_ngram - 1, -1):  # the longest n first, as ngram_match
        hit = steps[n] & before
        hit[:, : n - 1] = False  # p needs n tokens of its own (ends of matches are ≥ n − 1 by construction)
        # the most recent match end e < p: the largest index where hit is set
        last = torch.where(hit, torch.arange(T, device=ids.device), -1).amax(-1)  # [B, T]
        take = (last >= 0) & (found == 0)
        tokens = torch.where(take, ids.gather(1, (last + 1).clamp(0, T - 1)), tokens)
        found = torch.where(take, torch.full_like(found, n), found)
    return tokens, found
