"""Greedy decoding's argmax over the vocabulary from a bfloat16 copy of the lm_head, exactly.

A verify at T = 0 needs only argmax_v h·w_v per query, not the logits, and SmolLM2's lm_head is 113 MB in float32, a
fifth of the bytes a decode step streams on a CPU. `Shortlist` multiplies h with a bfloat16 copy ŵ of the weight
(half the bytes; smallm.c's bf16 kernel, float32 sums) and bounds every row's error rigorously:

    |h·w_v − h·ŵ_v| ≤ ‖h‖·‖w_v − ŵ_v‖  (Cauchy–Schwarz)   and the float32 sums' own rounding ≤ ε·‖h‖·‖ŵ_v‖

so with b = ‖h‖·max_v(‖w_v − ŵ_v‖ + ε‖ŵ_v‖), the exact argmax is among the rows whose approximate logit is within 2b
of the approximate maximum. Those few rows are multiplied again with the float32 weight and the best of them is
taken (the first on a tie, as argmax over all logits takes it). The answer is the argmax of float32 logits, as the
full product's; only the order of the float32 sums differs, as between any two float32 kernels.

Used at the row counts where it measures faster than the lm_head's own measured kernel (`shortlist`: once per process
and weight, each call timed after flushing the caches, as a decode step finds them), or at every row count of ROWS'
range where the config forces it (cpu_kernels=native);
elsewhere, at T > 0 (which needs the whole distribution), or without the native library, the logits are computed."""

from __future__ import annotations

import time
import weakref

import torch
from torch import nn

from specdec.engines.cpu import native

# a float32 sum of I products is off by at most ~I·2^-24 of Σ|h_i||ŵ_i| ≤ I·2^-24·‖h‖·‖ŵ‖; twice that covers both the
# approximate product's sums and the full float32 product's that greedy decoding would otherwise take. 1e-4 covers
# I up to ~800 (SmolLM2: 576); wider rows get 2·I·2^-24
ROUNDING = 1e-4


class Shortlist:
    """An lm_head's weight [V, H] (float32, CPU) with its packed bfloat16 copy and error bound."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.rows: list[bool] = []  # [rows] whether to take it for a product of that many rows (set by `shortlist`)
        self.made_from = (weight.data_ptr(), weight._version)
        with torch.no_grad():
            rounded = weight.to(torch.bfloat16)
            self.packed = native.pack(rounded)
            error = (weight - rounded.float()).norm(dim=1)  # [V] ‖w_v − ŵ_v‖
            eps = max(ROUNDING, 2 * weight.shape[1] * 2.0 ** -24)
            self.slack = float((error + eps * rounded.float().norm(dim=1)).max())  # per unit ‖h‖

    def wins(self, rows: int) -> bool:
        """Whether to take the argmax this way for `rows` query rows (B·n)."""
        return rows < len(self.rows) and self.rows[rows]

    @property
    def current(self) -> bool:
        return self.made_from == (self.weight.data_ptr(), self.weight._version)

    @torch.no_grad()
    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] float32 -> the argmax over the vocabulary of h·Wᵀ [...] (long)."""
        shape = h.shape[:-1]
        h = h.reshape(-1, h.shape[-1]).contiguous()  # [M, H]
        approx = native.packed_gemm(h, self.packed)  # [M, V] within b of the exact logits
        if not bool(torch.isfinite(approx.sum())):
            raise FloatingPointError("NaN/inf in the base's logits: the base's weights or dtype are broken "
                                     "(try dtype=float32)")
        bound = h.norm(dim=1, keepdim=True) * self.slack  # [M, 1] b per row
        best = approx.max(dim=1, keepdim=True).values  # [M, 1]
        rows, cols = (approx >= best - 2 * bound).nonzero(as_tuple=True)  # the candidates, by row, in vocab order
        if bool((torch.bincount(rows, minlength=h.shape[0]) == 1).all()):  # one candidate each: it is the argmax
            return cols.reshape(shape)
        vocab = cols.unique()  # [U] sorted: the union of the rows' candidates
        exact = h @ self.weight[vocab].T  # [M, U] float32 logits of the candidates
        keep = torch.zeros_like(exact, dtype=torch.bool)
        keep[rows, torch.searchsorted(vocab, cols)] = True
        exact = exact.masked_fill(~keep, float("-inf"))
        return vocab[exact.argmax(dim=1)].reshape(shape)


# lm_head -> {forced: its Shortlist, or None where that measured slower at every row count}
_SHORTLISTS: weakref.WeakKeyDictionary[nn.Linear, dict[bool, Shortlist | None]] = weakref.WeakKeyDictionary()
ROWS = (1, 2, 4, 8, 12, 16)  # row counts timed; more rows take the logits
FLUSH_BYTES = 256 << 20  # read between timed calls: in a decode the layers' weights have just evicted the lm_head's


def shortlist(lm_head: nn.Linear, forced: bool = False) -> Shortlist | None:
    """The lm_head's Shortlist, its `rows` set to where on this machine its argmax measures faster than the lm_head's
    forward (with whatever kernel is patched in) followed by an argmax (forced: every row count up to max(ROWS),
    nothing measured); None where it wins at no row count or cannot run (no native library, not float32 on the CPU).
    Measured once per process and weight (under a second)."""
    w = lm_head.weight
    if not (native.available() and w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2
            and lm_head.bias is None):
        return None
    known = _SHORTLISTS.setdefault(lm_head, {})
    have = known.get(forced, False)
    if have is False or (have is not None and (have.weight is not w or not have.current)):
        made = Shortlist(w)
        made.rows = [False] + [True] * max(ROWS) if forced else _wins(made, lm_head)
        have = known[forced] = made if any(made.rows) else None
    return have


@torch.no_grad()
def _wins(made: Shortlist, lm_head: nn.Linear, reps: int = 3) -> list[bool]:
    """[rows] -> whether the shortlist's argmax beat the logits' at that row count (the next timed count up decides),
    each call timed after the caches were flushed, as a decode step finds them."""
    g = torch.Generator().manual_seed(0)
    flush = torch.empty(FLUSH_BYTES // 4)
    faster = {}
    for rows in ROWS:
        h = torch.randn(rows, made.weight.shape[1], generator=g)
        best = {"logits": float("inf"), "shortlist": float("inf")}
        for rep in range(reps + 1):  # the first pass of each warms up
            for way in best:
                flush.sum()
                t = time.perf_counter()
                made.argmax(h) if way == "shortlist" else lm_head(h).argmax(-1)
                if rep:
                    best[way] = min(best[way], time.perf_counter() - t)
        faster[rows] = best["shortlist"] < best["logits"]
    return [False] + [faster[min(r for r in ROWS if r >= n)] for n in range(1, max(ROWS) + 1)]
