"""N-gram lookup drafting (prompt lookup decoding; llama.cpp's `lookup` example): propose the tokens that followed
the most recent earlier occurrence of the context's last n tokens, in the prompt or the answer so far.

It costs no forward at all, and code answers copy a lot (signatures, names, repeated lines), so on its own it is a
drafter, and beside a trained one it takes the rounds it can predict (a match of at least `min_ngram` tokens) and
leaves the others to the drafter. The proposed tokens are deterministic picks (q is a point mass), so the sampler's
verification keeps it lossless at any temperature."""

from __future__ import annotations

import torch

from specdec.sampling.trees import Round


def ngram_proposal(history: list[int], max_tokens: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to max_tokens tokens that followed the most recent earlier occurrence of history's last n tokens, for the
    longest n in [min_ngram, max_ngram] that occurs; [] when none does."""
    size = len(history)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = history[size - n :]
        first = suffix[0]
        # scan from the most recent start backwards; a start must leave at least one token after the n-gram
        for i in range(size - n - 1, -1, -1):
            if history[i] == first and history[i : i + n] == suffix:
                return history[i + n : i + n + max_tokens]
    return []


def lookup_round(root: torch.Tensor, proposals: list[list[int]]) -> Round:
    """A chain round from per-row proposals (each non-empty): as deep as the longest, each row limited to its own
    length (Round.limit), shorter rows padded with their last token (never verified)."""
    depth = max(len(p) for p in proposals)
    padded = [p + [p[-1]] * (depth - len(p)) for p in proposals]
    tokens = torch.cat([root[:, None], torch.tensor(padded, device=root.device, dtype=root.dtype)], dim=1)  # [B, D+1]
    n = depth + 1
    return Round(
        tokens=tokens,
        parents=torch.arange(-1, n - 1),
        depth=torch.arange(n),
        ancestors=torch.ones(n, n, dtype=torch.bool).tril(),
        draft_slots=torch.arange(n),
        limit=torch.tensor([len(p) for p in proposals], device=root.device),
    )
