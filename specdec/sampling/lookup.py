"""N-gram lookup drafting (prompt lookup decoding; llama.cpp's `lookup` example): propose the tokens that followed
the most recent earlier occurrence of the context's last n tokens, in the prompt or the answer so far.

It costs no forward at all, and code answers copy a lot (signatures, names, repeated lines), so on its own it is a
drafter, and beside a trained one it takes the rounds it can predict (a match of at least `min_ngram` tokens) and
leaves the others to the drafter. The proposed tokens are deterministic picks (q is a point mass), so the sampler's
verification keeps it lossless at any temperature.

How many of a match's tokens a round verifies is a trade the machine decides (`LookupLength`): each verified token
costs a share of a decode step that differs by machine, a few per cent on a GPU and a fifth of a step on a 2-core CPU
whose verify multiplies exact compact weights."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from specdec.sampling.trees import Round, cost_budget


class LookupLength:
    """Cuts each lookup round's proposals to the length L that maximises the expected tokens per verify cost,
    (1 + Σ_{k≤L} P_n(k)) / v(L + 1) (`trees.cost_budget`): v from the verify-cost curve measured on this machine, P_n(k)
    the share of earlier proposals from an n-gram match whose first k tokens the base went on to emit. Those are
    counted in hindsight against the output, so a proposal cut short still tells about the depths it did not verify.
    A proposal from a 3-gram match is a copy far more often than one from a 2-gram match (a one-off count over
    SmolLM2's answers to 30 HumanEval prompts: 4.7 of 8 tokens matched against 1.5), hence the counts per n. At T = 0
    they are kept per base for the process (`shared_counts`, as the curve is): a decode of 128 tokens sees a dozen
    proposals, too few to learn from alone.
    Each P_n(k) starts from one pseudo-proposal that matched in full: until proposals of its kind have missed, P = 1
    and a round verifies what the curve alone pays for, the whole proposal wherever n tokens verify for less than n
    decode steps (as without this). Only the proposals and the emitted tokens decide,
    never the base's distribution at the proposed positions, so verification stays lossless."""

    def __init__(self, curve: list[float], counts: list[list[list[int]]]):
        self.curve = curve  # v(n) for n = 0 .. most + 1: a verify of n tokens a row, in decode steps
        self.hits, self.seen = counts  # [n][k]: proposals whose first k tokens matched | of ≥ k tokens resolved
        self.pending: list[tuple[int, int, list[int], int]] = []  # (row, where in its output, tokens, n)

    def cut(self, proposals: list[list[int]], ngrams: list[int], rows: list[int], starts: list[int]) -> list[list[int]]:
        """proposals (one per batch row, [] for a row that rides along) from matches of length ngrams, for the output
        rows `rows` whose outputs hold starts tokens -> the same cut to the round's length."""
        p = [0.0] * (len(self.curve) - 2)  # [most] the rows' summed P(first k accepted), k = 1 .. most (host floats:
        for toks, n in zip(proposals, ngrams):  # a tensor op per depth would cost more than the sums)
            for k in range(1, len(toks) + 1):
                p[k - 1] += self.hits[n][k] / self.seen[n][k]
        mean = torch.tensor(p, dtype=torch.float64) / max(1, sum(map(bool, proposals)))
        length = cost_budget(mean, self.curve, max(map(len, proposals)))
        self.pending += [(row, at, toks, n) for toks, n, row, at in zip(proposals, ngrams, rows, starts) if toks]
        return [toks[:length] for toks in proposals]

    def resolve(self, out: list[list[int]], done: list[bool]) -> None:
        """Counts each pending proposal once the output shows how far it matched (or its row ended)."""
        waiting = []
        for row, at, toks, n in self.pending:
            emitted = out[row][at : at + len(toks)]
            matched = next((k for k, (a, b) in enumerate(zip(toks, emitted)) if a != b), len(emitted))
            if matched == len(emitted) and len(emitted) < len(toks) and not done[row]:
                waiting.append((row, at, toks, n))  # all emitted so far matched: more to come
                continue
            known = len(toks) if matched < len(emitted) or matched == len(toks) else matched  # an ended row: to its end
            for k in range(1, known + 1):
                self.seen[n][k] += 1
                self.hits[n][k] += k <= matched
        self.pending = waiting


# base -> (lookup_tokens, max_ngram) -> [hits, seen], each [n][k]: the counts LookupLength learns from, for the process
_COUNTS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, int], list]] = weakref.WeakKeyDictionary()


def fresh_counts(most: int, max_ngram: int) -> list[list[list[int]]]:
    """[hits, seen] for proposals of up to `most` tokens from matches of up to max_ngram tokens, each [n][k] at the one
    pseudo-proposal that matched in full."""
    return [[[1] * (most + 1) for _ in range(max_ngram + 1)] for _ in range(2)]


def shared_counts(base: nn.Module, most: int, max_ngram: int) -> list[list[list[int]]]:
    """The base's counts (`fresh_counts` at first) for the process."""
    return _COUNTS.setdefault(base, {}).setdefault((most, max_ngram), fresh_counts(most, max_ngram))


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
