"""The fused top-k KL (specdec/losses.py) against the same loss written with autograd ops, and against the exact KL
when the top-k is the whole vocabulary."""

import pytest
import torch
import torch.nn.functional as F

from specdec.losses import topk_kl


def _reference(logits, top_idx, top_logp, offsets, mask=None):
    """The coarsened KL(p || q) per entry, plain autograd: the k targets plus one bucket for the rest; with mask [B, T],
    the mean over the positions whose drafted token (t + 1 + o) it sets."""
    T = logits.shape[1]
    out = []
    for j, o in enumerate(offsets):
        n = T - 1 - o
        lq_all = logits[:, :n, j].double().log_softmax(-1)  # [B, n, V]
        idx = top_idx[:, o : o + n]
        valid = idx >= 0
        p = top_logp[:, o : o + n].double().exp().masked_fill(~valid, 0)
        lq = lq_all.gather(-1, idx.clamp_min(0)).masked_fill(~valid, 0)
        q_top = (lq.exp() * valid).sum(-1)
        rest = (1 - p.sum(-1)).clamp_min(0)
        kl = (torch.xlogy(p, p).sum(-1) + torch.xlogy(rest, rest) - (p * lq).sum(-1)
              - rest * torch.log((1 - q_top).clamp_min(1e-12)))
        out.append(kl.mean() if mask is None else kl[mask[:, 1 + o : 1 + o + n]].mean())
    return torch.stack(out)


def _case(B=2, T=9, K=3, V=40, k=6, outside=True, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, T, K, V, generator=g, dtype=torch.float64)).to(dtype).requires_grad_(True)
    p_logits = 3 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    top_logp, top_idx = p_logits.log_softmax(-1).topk(k, dim=-1)
    if outside:  # some of the base's top-k lie outside the draft vocab: index −1, log-prob −inf (as the trainer masks)
        drop = torch.rand(B, T, k, generator=g) < 0.3
        top_idx = top_idx.masked_fill(drop, -1)
        top_logp = top_logp.masked_fill(drop, float("-inf"))
    return logits, top_idx, top_logp.float()


@pytest.mark.parametrize("outside", [False, True])
def test_matches_autograd_reference(outside):
    logits, idx, logp = _case(outside=outside)
    offsets = [0, 1, 3]
    got = topk_kl(logits, idx, logp, offsets)
    want = _reference(logits, idx, logp, offsets)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    w = torch.tensor([1.0, 0.8, 0.5], dtype=torch.float64)
    (g_got,) = torch.autograd.grad((got * w).sum(), logits)
    (g_want,) = torch.autograd.grad((want * w).sum(), logits)
    torch.testing.assert_close(g_got, g_want, rtol=1e-9, atol=1e-12)
    assert g_got[:, -1].abs().sum() == 0  # no entry has a target past the last position


def test_a_mask_keeps_only_the_positions_whose_drafted_token_it_sets():
    logits, idx, logp = _case()
    offsets = [0, 1, 3]
    mask = torch.rand(logits.shape[:2], generator=torch.Generator().manual_seed(1)) < 0.5  # [B, T]
    got = topk_kl(logits, idx, logp, offsets, mask)
    want = _reference(logits, idx, logp, offsets, mask)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    (g_got,) = torch.autograd.grad(got.sum(), logits)
    (g_want,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g_got, g_want, rtol=1e-9, atol=1e-12)
    for j, o in enumerate(offsets):  # a left-out position gets no gradient
        assert g_got[:, : logits.shape[1] - 1 - o, j][~mask[:, 1 + o :]].abs().sum() == 0
    torch.testing.assert_close(topk_kl(logits, idx, logp, offsets, torch.ones_like(mask)),
                               topk_kl(logits, idx, logp, offsets))


def test_gradcheck():
    logits, idx, logp = _case(B=1, T=5, K=2, V=7, k=3)  # K entries, one offset each
    assert torch.autograd.gradcheck(lambda x: topk_kl(x, idx, logp, [0, 2]), (logits,))


def test_whole_vocabulary_is_the_exact_kl():
    logits, idx, logp = _case(K=1, k=40, outside=False)
    p_logp = torch.full(idx.shape, float("-inf"), dtype=torch.float64).scatter(-1, idx, logp.double())
    got = topk_kl(logits, idx, logp, [0])
    T = logits.shape[1]
    want = F.kl_div(logits[:, : T - 1, 0].log_softmax(-1), p_logp[:, : T - 1], log_target=True, reduction="none").sum(-1).mean()
    torch.testing.assert_close(got[0], want, rtol=1e-6, atol=1e-6)


def test_bf16_logits_sum_in_fp32():
    logits, idx, logp = _case(dtype=torch.bfloat16)
    got = topk_kl(logits, idx, logp, [0, 1, 2])
    assert got.dtype == torch.float32
    want = _reference(logits.float(), idx, logp, [0, 1, 2]).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (g,) = torch.autograd.grad(got.sum(), logits)
    assert g.dtype == torch.bfloat16 and torch.isfinite(g.float()).all()
