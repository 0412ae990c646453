"""The drafter's distillation loss against the base's top-k next-token distribution, fused.

A feature cache stores the base's k most likely tokens per position with their log-probs; the rest of the mass is one
bucket. KL(p || q) between these coarsened distributions (exact when k = V, a lower bound otherwise) written with
autograd ops makes a dozen passes over the [B, T, K, V] draft logits per step (an fp32 copy, log-sum-exp, the gather's
and the slices' zero-filled gradients, the unbind's re-stack), each of them tens of MB that do not stay in cache; on a
2-core CPU those passes cost about as much as the drafter's products. Here one function computes the loss of every
entry and, in its backward, writes the gradient once, a row block at a time: the products are all that is left."""

from __future__ import annotations

from typing import Sequence

import torch

MIN_REST = 1e-12  # q's mass off the top-k is clamped here before its log (a drafter sure of the top-k)


def topk_kl(logits: torch.Tensor, top_idx: torch.Tensor, top_logp: torch.Tensor, offsets: Sequence[int],
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean KL(p || q) per entry [K].

    logits [B, T, K, V] draft logits (any float dtype; V may be a draft vocab), q = softmax over V;
    top_idx [B, T, k] the base's top-k token indices into V (−1: a token outside the draft vocab, its log-prob −inf),
    top_logp [B, T, k] their log-probs under the base's full softmax;
    entry j at position t is scored against p at t + offsets[j], for the T − 1 − offsets[j] positions where it
    exists; mask [B, T] bool (None: every position): entry j at t counts only where mask[t + 1 + offsets[j]], the
    token it drafts, is set, and the mean is over those (an entry with none set has KL 0).
    The sums are taken in fp32 (fp64 stays fp64) whatever the logits' dtype; the gradient has the logits' dtype."""
    B, T = logits.shape[:2]
    mask = torch.ones(B, T, dtype=torch.bool, device=logits.device) if mask is None else mask.bool()
    return _TopKKL.apply(logits, top_idx, top_logp, tuple(int(o) for o in offsets), mask)


def _rows(logits, top_idx, top_logp, b: int, j: int, o: int):
    """Entry j of row b: its logits [n, V] in the accumulation dtype, the target indices [n, k] (−1 clamped to 0),
    a validity mask [n, k] and the target probabilities [n, k] (0 where invalid)."""
    n = logits.shape[1] - 1 - o
    acc = torch.promote_types(logits.dtype, torch.float32)
    q = logits[b, :n, j].to(acc)
    idx = top_idx[b, o : o + n]
    valid = idx >= 0
    pt = top_logp[b, o : o + n].to(acc).exp().masked_fill(~valid, 0)
    return q, idx.clamp_min(0), valid, pt


class _TopKKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_idx, top_logp, offsets, mask):
        B, T, K, _ = logits.shape
        if len(offsets) != K:
            raise ValueError(f"{K} entries in the logits but {len(offsets)} offsets")
        acc = torch.promote_types(logits.dtype, torch.float32)
        kl = torch.zeros(K, dtype=acc, device=logits.device)
        lse = logits.new_zeros(B, K, T, dtype=acc)  # per row: log Σ_v exp q_v
        coef = logits.new_zeros(B, K, T, dtype=acc)  # P − r·S (the softmax's factor in the gradient)
        r = logits.new_zeros(B, K, T, dtype=acc)  # rest / (1 − S): the top-k's extra factor
        w = logits.new_zeros(B, K, T, dtype=acc)  # each row's weight in its entry's mean (0 where masked)
        for j, o in enumerate(offsets):
            n = T - 1 - o
            if n <= 0:
                continue
            counted = mask[:, 1 + o : 1 + o + n].to(acc)  # [B, n]
            w[:, j, :n] = counted / counted.sum().clamp_min(1)
            for b in range(B):
                q, idx, valid, pt = _rows(logits, top_idx, top_logp, b, j, o)  # [n, V], [n, k] ×3
                row_lse = torch.logsumexp(q, -1)  # [n]
                lq = (q.gather(-1, idx) - row_lse[:, None]).masked_fill(~valid, 0)  # log q of the top-k [n, k]
                s = lq.exp() * valid  # q of the top-k
                S = s.sum(-1)  # [n]
                rest = (1 - pt.sum(-1)).clamp_min(0)  # p's mass off the top-k [n]
                free = (1 - S).clamp_min(MIN_REST)  # q's mass off the top-k
                neg_entropy = torch.xlogy(pt, pt).sum(-1) + torch.xlogy(rest, rest)
                kl[j] += ((neg_entropy - (pt * lq).sum(-1) - rest * free.log()) * w[b, j, :n]).sum()
                lse[b, j, :n] = row_lse
                r_row = torch.where(1 - S > MIN_REST, rest / free, torch.zeros_like(rest))
                r[b, j, :n] = r_row
                coef[b, j, :n] = pt.sum(-1) - r_row * S
        ctx.save_for_backward(logits, top_idx, top_logp, lse, coef, r, w)
        ctx.offsets = offsets
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        logits, top_idx, top_logp, lse, coef, r, w = ctx.saved_tensors
        B, T, K, _ = logits.shape
        # ∂KL/∂q_v = softmax(q)_v·(P − r·S) + [v in the top-k]·(r·softmax(q)_v − p_v), P = Σ p over the top-k,
        # S = Σ q over it, r = rest / (1 − S); rows past an entry's last target get no gradient.
        grad = torch.empty_like(logits)  # every row is written once below: no zero-fill pass over all of it
        for j, o in enumerate(ctx.offsets):
            n = max(T - 1 - o, 0)
            grad[:, n:, j] = 0
            if n == 0:
                continue
            for b in range(B):
                q, idx, valid, pt = _rows(logits, top_idx, top_logp, b, j, o)
                sm = torch.exp(q - lse[b, j, :n, None])  # [n, V] softmax(q)
                at_top = (r[b, j, :n, None] * sm.gather(-1, idx) - pt) * valid  # [n, k]
                g = sm.mul_(coef[b, j, :n, None]).scatter_add_(-1, idx, at_top)
                grad[b, :n, j] = g.mul_(w[b, j, :n, None] * grad_kl[j])
        return grad, None, None, None, None
