"""The lean decode forward (specdec/engines/eager/lean.py): the same numbers as each layer's HF forward, fused weights
that are the layer's own, and the HF forward wherever a layer is not of the Llama layout."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from specdec.base import LAST, tiny_base
from specdec.checkpoint import load_drafter, save_drafter
from specdec.drafters.early_exit import EarlyExit
from specdec.engines.cpu.kernels import CANDIDATES, KernelTable, measured_kernels
from specdec.engines.eager.lean import LeanLayer, decode_linears, lean
from specdec.sampling.context import SamplingContext
from specdec.sampling.decode import SamplerConfig, generate

from conftest import auto_engine, prefill_and_verify


@pytest.fixture
def base():
    return tiny_base(num_layers=3)  # its own: lean re-points the layers' weights


@pytest.mark.parametrize("tree", [False, True])
@torch.no_grad()
def test_lean_forward_equals_the_hf_layers(base, tree):
    prompt = list(range(20, 31))
    ref, ref_feats = prefill_and_verify(base, prompt, tree, lean=False)
    got, feats = prefill_and_verify(base, prompt, tree)
    assert all(isinstance(lean(layer), LeanLayer) for layer in base.layers)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert feats.keys() == ref_feats.keys() == {0, 2, LAST}
    for layer in feats:
        torch.testing.assert_close(feats[layer], ref_feats[layer], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_fused_weights_are_the_layers_own(base):
    layer = base.layers[0]
    before = [p.detach().clone() for p in (layer.self_attn.q_proj.weight, layer.mlp.up_proj.weight)]
    ptr = layer.self_attn.q_proj.weight.data_ptr()
    fast = lean(layer)
    attn, mlp = layer.self_attn, layer.mlp
    # the HF weights now live inside the fused ones: same values, no second copy
    assert attn.q_proj.weight.data_ptr() == fast.qkv.weight.data_ptr() != ptr
    assert attn.k_proj.weight.data_ptr() == fast.qkv.weight[attn.q_proj.weight.shape[0]:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == fast.gate_up.weight[mlp.gate_proj.weight.shape[0]:].data_ptr()
    assert torch.equal(attn.q_proj.weight, before[0]) and torch.equal(mlp.up_proj.weight, before[1])
    assert lean(layer) is fast  # built once
    attn.q_proj.weight.mul_(2)  # an in-place update (an optimizer step) is seen by the fused product too
    assert torch.equal(fast.qkv.weight[: before[0].shape[0]], 2 * before[0])
    layer.to(torch.float64)  # new storage: the layer is fused again, in the new dtype
    again = lean(layer)
    assert again is not fast and again.qkv.weight.dtype == torch.float64


def test_layers_of_another_shape_or_math_run_their_hf_forward(base):
    config = Qwen3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, num_hidden_layers=1, vocab_size=64)
    assert lean(Qwen3DecoderLayer(config, 0)) is None  # q/k norms: not the Llama layout
    layer = base.layers[1]  # Llama-shaped, but its attention computes something else: the numeric check refuses it
    own = layer.self_attn.forward
    layer.self_attn.forward = lambda *a, **k: (2 * own(*a, **k)[0], None)
    assert lean(layer) is None
    ctx = SamplingContext(base, 1, 8, auto_engine())
    with torch.no_grad():
        assert ctx._lean(base.layers)[1] is None and ctx._lean(base.layers)[0] is not None
    assert ctx._lean(base.layers) == [None] * base.num_layers  # autograd on: HF forwards, for training


def test_measured_kernels_patch_the_fused_linears(base, tmp_path):
    # one candidate (not `linear`), so every linear gets a patched forward
    table = KernelTable(tmp_path / "kernels.json", candidates={"mm_nn": CANDIDATES["mm_nn"]}, rows=(1, 2))
    layer = base.layers[0]
    with measured_kernels(base, table=table) as t:
        fast = lean(layer)
        assert "forward" in fast.qkv.__dict__ and "forward" in fast.gate_up.__dict__
        assert "forward" not in layer.self_attn.q_proj.__dict__  # stands behind the fused product
        assert "forward" in layer.self_attn.o_proj.__dict__
        assert "64x32:float32" in t.choice  # q|k|v of the tiny base: 32 + 2 * 16 rows
    with measured_kernels(base, table=table, lean=False):
        assert "forward" in layer.self_attn.q_proj.__dict__ and "forward" not in fast.qkv.__dict__


@pytest.mark.parametrize("kw", [dict(gamma=3), dict(tree="dynamic", dynamic_depth=2, dynamic_topk=2, dynamic_budget=4)])
def test_decoding_is_the_same_with_and_without_lean(base, kw, tmp_path):
    """A drafter whose layers run through the context (early exit: the base's first layer + its own block) decodes
    the same tokens either way, and still saves and loads after its weights were fused."""
    drafter = EarlyExit(base, exit_layers=[1], num_extra_layers=1).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    prompts = [list(range(30, 39)), list(range(50, 54))]
    runs = [generate(base, prompts, drafter, SamplerConfig(max_new_tokens=10, eos_token_id=[], **kw),
                     engine=auto_engine(lean=on)) for on in (True, False)]
    assert runs[0].tokens.tolist() == runs[1].tokens.tolist()
    assert runs[0].accepted == runs[1].accepted
    block = drafter.exits[0].blocks[0]  # its block was fused while decoding
    assert block.self_attn.q_proj.weight.data_ptr() == lean(block).qkv.weight.data_ptr()
    assert lean(block).qkv in decode_linears(drafter)
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    loaded = load_drafter(save_drafter(drafter, tmp_path / "d"), base)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())


@torch.no_grad()
def test_rotary_table_and_fused_norm_give_the_hf_numbers_bitwise():
    """The lean layer's rotary (q and k at once, sign folded into the sine) is HF's apply_rotary_pos_emb to the
    bit; an RMSNorm is fused only where F.rms_norm is bitwise the norm's own output (float32 here, not float64)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from specdec.engines.eager.lean import _fused_norm
    from specdec.sampling.rotary import lean_rope

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g)  # [B, heads, n, d]
    angle = torch.randn(2, 3, 8, generator=g)  # [B, n, d]: halves differ, so a swapped sign would show
    ref_q, ref_k = apply_rotary_pos_emb(q, k, angle.cos(), angle.sin())
    cos, sin = lean_rope(angle.cos(), angle.sin())
    qk = torch.cat([q, k], dim=1)
    got_q, got_k = (qk * cos + qk.roll(4, -1) * sin).split([4, 2], dim=1)  # as LeanLayer.forward rotates
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)

    norm = LlamaRMSNorm(16, eps=1e-6)
    norm.weight.uniform_(0.5, 1.5)
    assert _fused_norm(norm) is not norm  # float32: the fused op
    x = torch.randn(5, 16, generator=g)
    assert torch.equal(_fused_norm(norm)(x), norm(x))
    assert _fused_norm(norm.double()) is norm  # float64: F.rms_norm rounds otherwise, so the norm's own forward


@torch.no_grad()
def test_rotary_table_is_the_modules_own_numbers_or_steps_aside(base):
    """The context's rotary table gives the base's rotary module's (cos, sin) bitwise at any position it holds
    (below 0 too: the prophet's shift), lean form included; a rotary whose values depend on the call is not looked up."""
    from specdec.sampling.rotary import MARGIN, RotaryTable, lean_rope

    like = torch.zeros(1, 1, base.hidden_size)
    table = RotaryTable(base.rotary_emb, like, 40)
    assert table.exact and table.covers(-1, 39) and not table.covers(-MARGIN - 1, 3) and not table.covers(0, 40)
    pos = torch.tensor([[-1, 0, 7, 39], [3, 4, 5, 6]])
    ref = base.rotary_emb(like, pos)
    got = table(pos)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert all(torch.equal(a, b) for a, b in zip(table.lean(pos), lean_rope(*ref)))
    # one row at consecutive positions (a chain, an observe): views of the table's rows, the same numbers
    assert all(torch.equal(a, b) for a, b in zip(table.lean_run(-1, 4), table.lean(torch.tensor([[-1, 0, 1, 2]]))))
    ctx = SamplingContext(base, 1, 40, auto_engine())
    ctx.commit(torch.tensor([5]), [5])
    ctx.commit_layout(3)
    assert all(torch.equal(a, b) for a, b in zip(ctx._rotary(like, -1, hf=False, fast=True)[1],
                                                 table.lean(ctx.positions - 1)))

    half = base.rotary_emb.inv_freq.numel()

    class CallDependent(torch.nn.Module):  # like dynamic scaling: the values depend on the longest position asked
        def forward(self, x, position_ids):
            angle = position_ids[..., None].float() / (1 + position_ids.max()) * torch.ones(2 * half)
            return angle.cos(), angle.sin()

    base.model.model.rotary_emb = CallDependent()
    ctx = SamplingContext(base, 1, 40, auto_engine())
    ctx.commit_layout(3)
    cos, sin = ctx._rotary(like, 0, hf=True, fast=False)[0]
    assert not ctx.rope.exact and torch.equal(cos, CallDependent()(like, ctx.positions)[0])  # the module ran itself


@torch.no_grad()
def test_mask_of_rows_at_one_length_is_the_general_mask():
    """Rows at one committed length share one mask (the fast path); it equals the per-row construction, and a layout
    whose forward never runs never builds one."""
    from specdec.sampling.context import _PENDING

    base = tiny_base(num_layers=1)
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    masks = []
    for lengths in ([5, 5], [5, 6]):  # the second pair takes the general path; row 0 is the same in both
        ctx = SamplingContext(base, 2, 32, auto_engine())
        ctx.commit(torch.tensor(lengths), lengths)
        ctx.tree_layout(torch.arange(4), torch.tensor([0, 1, 1, 2]), visible)
        assert ctx._mask is _PENDING  # made on first use
        masks.append(ctx.mask)
        assert ctx._mask is masks[-1]
    fast, general = masks
    assert fast.shape == (2, 1, 4, 9) and torch.equal(fast[0], fast[1])
    assert torch.equal(fast[0, :, :, :9], general[0, :, :, :9])
    assert (fast[0, 0, :, :5] == 0).all() and torch.equal(fast[0, 0, :, 5:] == 0, visible)
