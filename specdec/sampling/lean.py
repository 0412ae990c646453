"""A lean decode forward over the base's (and drafters') own Llama-style decoder layers.

Calling an HF decoder layer pays for module hooks, kwargs plumbing, the attention interface's head repeat, three
separate q/k/v (two gate/up) products and ~30 small elementwise ops on every token step; on a 2-core CPU, where each
op costs microseconds of dispatch, that is a large share of a 135M model's step. For a layer of the Llama layout
(Llama, Mistral, Qwen2, ... and every drafter block built from such a config) `LeanLayer` runs the same math from
the layer's own weights and norms: one product for q|k|v and one for gate|up, each RMSNorm as one fused op, q and k
rotated together with a rotary table made once per forward for all layers, SDPA with grouped KV heads, the same
cache `update`. (make bench, T_1 of SmolLM2: 30.3 ms through the HF layers, 26.9 ms with the fused products, and
23.5 vs 27.8 ms with fused norms and rotary against the layers' own in one run.)

The fused products cost no memory: the layer's q/k/v (gate/up) weights are re-pointed as row blocks of the one
fused tensor, so the HF modules keep working on the very same numbers. A layer is taken only when its shape is
the Llama one and, on a few random tokens, the lean forward reproduces the layer's own HF forward; any other
layer (sliding windows, q/k norms, another rotary or norm formula) runs through its HF forward as before."""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.base import cache_arg
from specdec.sampling import native
from specdec.sampling.cache import SlotCache

# HF decoder layer -> its LeanLayer, or None when it is not one (decided once per layer object)
_LEAN: weakref.WeakKeyDictionary[nn.Module, LeanLayer | None] = weakref.WeakKeyDictionary()


def fuse_rows(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose weight (and bias) rows are the given linears' stacked in order, made the storage of theirs:
    afterwards each linear's weight is a view of a row block of it (same values, no second copy)."""
    weight = torch.cat([l.weight.detach() for l in linears])  # [ΣO, I]
    has_bias = linears[0].bias is not None
    bias = torch.cat([l.bias.detach() for l in linears]) if has_bias else None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")  # (parameters set below)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    start = 0
    for l in linears:
        rows = slice(start, start + l.weight.shape[0])
        l.weight.data = weight[rows]  # the HF parameter keeps its identity (and optimizer state), now a view
        if has_bias:
            l.bias.data = bias[rows]
        start = rows.stop
    return fused


class LeanLayer(nn.Module):
    """One Llama-style decoder layer as a few fused products. Holds the fused linears (what `measured_kernels`
    patches in place of the layer's own q/k/v/gate/up) and references to the layer's other parts."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up = fuse_rows([mlp.gate_proj, mlp.up_proj])
        # the layer's own modules (norms fused where exact), not registered: they belong to the layer
        self._parts = (_fused_norm(layer.input_layernorm), _fused_norm(layer.post_attention_layernorm), attn.o_proj,
                       mlp.down_proj, mlp.act_fn)
        self.norms = (layer.input_layernorm, layer.post_attention_layernorm)  # the modules (native_layer reads them)
        self.covers = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)  # what the fused stand for
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.heads = attn.q_proj.weight.shape[0] // attn.head_dim
        self.kv_heads = attn.k_proj.weight.shape[0] // attn.head_dim
        self.scaling = attn.scaling
        self.intermediate = mlp.gate_proj.weight.shape[0]
        # the same layer in one native call (native_layer.py), attached by measured_kernels where it measured faster:
        # for a batch of one with n rows, native_rows[n] (None: the lean forward)
        self.native_rows: list = []
        # native_layer.stack's: its native form once built, per form its weights are held in (None: it has none)
        self.native_built: dict[str, object] = {}
        # the attention form for n queries, attention_rows[n](q, k, v, mask, scale), where cuda_kernels measured one
        # faster than SDPA (None, or past the list: SDPA)
        self.attention_rows: list = []
        # the rotary and cache write for n queries in one kernel, rope_rows[n](qkv, rope, cache, layer_idx, heads) ->
        # (q, k, v) or None, where cuda_kernels measured it faster (None, or past the list: the PyTorch ops)
        self.rope_rows: list = []
        # for B·n rows, fused_rows[B·n]: a cuda_fused.Fused, its products with the norms, SiLU and residual adds
        # around them in one kernel each, where cuda_kernels measured that faster (None, or past the list: unfused)
        self.fused_rows: list = []

    @property
    def native(self):
        """The native form attached for some row count, or None."""
        return next((layer for layer in self.native_rows if layer is not None), None)

    @property
    def current(self) -> bool:
        """Whether the layer's weights are still views of the fused ones (`.to()` or a reload replaces them)."""
        q_proj, gate_proj = self.covers[0], self.covers[3]
        return (q_proj.weight.data_ptr() == self.qkv.weight.data_ptr()
                and gate_proj.weight.data_ptr() == self.gate_up.weight.data_ptr())

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache) -> torch.Tensor:
        """hidden [B, n, H]; rope = `lean_rope` of the model's (cos, sin); mask [B, 1, n, W] additive or None; cache:
        an HF Cache whose `update` stores this call's keys and returns the keys and values to attend -> [B, n, H]."""
        b, n, _ = hidden.shape
        native = self.native_rows[n] if b == 1 and n < len(self.native_rows) else None
        if native is not None and hidden.dtype == torch.float32:
            out = native(hidden, rope, mask, cache)
            if out is not None:
                return out
        return self.lean_forward(hidden, rope, mask, cache)

    def lean_forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                     cache) -> torch.Tensor:
        """`forward` in PyTorch ops, whatever the batch."""
        _, norm2, o_proj, down_proj, act = self._parts
        b, n, _ = hidden.shape
        d, heads, kv = self.head_dim, self.heads, self.kv_heads
        fused = self.fused_rows[b * n] if b * n < len(self.fused_rows) else None
        # q [B, heads, n, d]; k, v [B, kv_heads, W, d] with this forward's written: one kernel (cuda_fused's
        # front_rope) where it was measured fastest, else the product and then the rotary and the write
        front = fused.front_rope(hidden, rope, cache, self.layer_idx) if fused is not None else None
        q, k, v = front if front is not None else self._front(hidden, rope, cache, fused)
        attend = self.attention_rows[n] if n < len(self.attention_rows) else None
        if attend is not None:
            o = attend(q, k, v, mask, self.scaling)  # [B, heads, n, d]
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                               enable_gqa=heads != kv)  # [B, heads, n, d]
        o = o.transpose(1, 2).reshape(b, n, heads * d)
        added = fused.add("o", o, hidden) if fused is not None else None
        hidden = added if added is not None else hidden + o_proj(o)
        a = fused.gated(hidden) if fused is not None else None
        if a is None:
            gate, up = self.gate_up(norm2(hidden)).split([self.intermediate, self.intermediate], dim=-1)
            a = act(gate) * up  # [B, n, intermediate]
        added = fused.add("down", a, hidden) if fused is not None else None
        return added if added is not None else hidden + down_proj(a)

    def _front(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache,
               fused) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q|k|v of the normed hidden (cuda_fused's front unit where chosen), then the rotary and the cache's K/V
        write (cuda_layer's one kernel where chosen): q [B, heads, n, d], k, v [B, kv_heads, W, d]."""
        n, heads, norm1 = hidden.shape[1], self.heads, self._parts[0]
        qkv = fused.front(hidden) if fused is not None else None
        if qkv is None:
            qkv = self.qkv(norm1(hidden))  # [B, n, (heads + 2·kv_heads)·d]
        write = self.rope_rows[n] if n < len(self.rope_rows) else None
        written = write(qkv, rope, cache, self.layer_idx, heads) if write is not None else None
        if written is not None:
            return written
        q, k, v = split_rotate(qkv, rope, heads, self.kv_heads, self.head_dim)
        k, v = cache.update(k, v, self.layer_idx)  # [B, kv_heads, W, d]
        return q, k, v


def split_rotate(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], heads: int, kv: int,
                 d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused q|k|v product [B, n, (heads + 2·kv)·d] -> q [B, heads, n, d] and k [B, kv, n, d] rotated (rope:
    `lean_rope`'s), v [B, kv, n, d]. q and k are rotated together: x·cos + rotate_half(x)·sin with rotate_half(x) =
    roll(x, d/2) and the sign in sin."""
    b, n, _ = qkv.shape
    qk, v = qkv.view(b, n, heads + 2 * kv, d).transpose(1, 2).split([heads + kv, kv], dim=1)
    cos, sin = rope
    q, k = (qk * cos + qk.roll(d // 2, -1) * sin).split([heads, kv], dim=1)
    return q, k, v


def lean_rope(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary (cos, sin) [B, n, d] as LeanLayer takes them, made once per forward for every layer:
    [B, 1, n, d] each, the sine's first half negated. Then rotate_half(x)·sin = roll(x, d/2)·sin' exactly (the
    halves swap, the sign moves to sin), so the rotation is 3 ops on q and k at once instead of 7 on each."""
    half = sin.shape[-1] // 2
    return cos[:, None], torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, None]


def _fused_norm(norm: nn.Module, exact: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """A Llama-style RMSNorm as one native call (native.rms_norm: float32 on the CPU) or one fused op (F.rms_norm)
    rather than its ~8: the first of them that gives bitwise the norm's own output on this device and dtype (with
    `exact` False, a drafter's norm, which only changes what is drafted: the native call also where it is within
    float32 rounding of it); otherwise the norm itself. In a decode every op comes after the base's forward evicted
    its code and data from the caches: F.rms_norm (itself ~10 small ops on the CPU) then took 112 µs, the native call
    35 (2-core Xeon, family 6 model 167, a [1, 576] row after a verify; 15-20 µs each back to back)."""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not (isinstance(w, torch.Tensor) and w.dim() == 1 and isinstance(eps, float)):
        return norm

    def fused(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)

    def native_norm(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or not norm.weight.is_contiguous():
            return fused(x)
        return native.rms_norm(x, norm.weight, eps)

    one_call = (w.dtype == torch.float32 and w.device.type == "cpu" and native.available()
                and hasattr(native._library(), "smallm_rms_norm"))
    with torch.no_grad():
        probe = torch.randn(4, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w)
        want = norm(probe)
        if one_call:
            got = native_norm(probe)
            if torch.equal(got, want) or not exact and torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                return native_norm
        return fused if torch.equal(fused(probe), want) else norm


# norm module -> {(its weight's dtype and device, exact): what it runs as then: a fused form or the module itself}
_NORMS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def _fused(norm: nn.Module, exact: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """`_fused_norm(norm, exact)`, decided once per norm, dtype, device and exactness."""
    w = getattr(norm, "weight", None)
    key = ((w.dtype, w.device) if isinstance(w, torch.Tensor) else None, exact)
    known = _NORMS.setdefault(norm, {})
    if key not in known:
        known[key] = _fused_norm(norm, exact)
    return known[key]


def fuse_norms(module: nn.Module, exact: bool = True) -> list[nn.Module]:
    """Every Llama-style RMSNorm under `module` (a drafter's, the base's final one) that one native call or F.rms_norm
    reproduces (bitwise; within float32 rounding where not `exact`: a drafter whose products may round) gets that as
    its forward, for a decode: its ~8 ops took 23 µs a call on the 2-core Xeon, F.rms_norm 15 (a drafter runs one or
    two per depth). Returns the norms patched (the caller deletes their `forward` after); one already patched is left
    to whoever did."""
    patched = []
    for m in module.modules():
        if "forward" in m.__dict__ or not isinstance(getattr(m, "variance_epsilon", None), float):
            continue
        fused = _fused(m, exact)
        if fused is not m:
            m.forward = fused
            patched.append(m)
    return patched


def rms_form(norm: nn.Module, device: str = "cpu") -> tuple[torch.Tensor, float] | None:
    """(weight [H], eps) of an RMSNorm whose formula is F.rms_norm's (as `fuse_norms` decides it), with its weight
    float32 and contiguous on the `device` type: what layer.c (cuda_fused on a GPU) computes in its place; None
    otherwise."""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not (isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.device.type == device and w.dim() == 1
            and w.is_contiguous() and isinstance(eps, float)) or _fused(norm) is norm:
        return None
    return w, eps


def lean(layer: nn.Module) -> LeanLayer | None:
    """The layer's LeanLayer (built and checked on first use), or None for a layer it does not reproduce."""
    fast = _LEAN.get(layer, False)
    if fast is False or (fast is not None and not fast.current):
        fast = _LEAN[layer] = _build(layer)
    return fast


def lean_layers(module: nn.Module) -> list[LeanLayer]:
    """The lean forwards of `module`'s decoder layers that have one, in order."""
    return [fast for m in module.modules() if _llama_shaped(m) for fast in [lean(m)] if fast is not None]


def decode_linears(module: nn.Module) -> list[nn.Linear]:
    """The nn.Linear modules a decode forward of `module` multiplies with, in the order it calls them: a layer that
    has a lean forward contributes q|k|v, o, gate|up, down in place of its own seven."""
    out, covered = [], set()
    for m in module.modules():
        fast = lean(m) if _llama_shaped(m) else None
        if fast is not None:
            _, _, o_proj, down_proj, _ = fast._parts
            out += [fast.qkv, o_proj, fast.gate_up, down_proj]
            covered.update(map(id, (*fast.covers, o_proj, down_proj)))
        elif type(m) is nn.Linear and id(m) not in covered:
            out.append(m)
    return out


def _llama_shaped(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    return (
        all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx"))
        and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        and all(isinstance(n, nn.Module) for n in norms)
        and not any(hasattr(attn, n) for n in ("q_norm", "k_norm"))
        and getattr(attn, "sliding_window", None) is None
        and all(type(m) is nn.Linear for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
    )


@torch.no_grad()
def _build(layer: nn.Module) -> LeanLayer | None:
    if not _llama_shaped(layer):
        return None
    fast = LeanLayer(layer)
    return fast if _agrees(layer, fast) else None


def _agrees(layer: nn.Module, fast: LeanLayer, n: int = 3) -> bool:
    """Whether the lean forward gives the layer's own HF forward's output on n random tokens (causal, fresh cache):
    what decides that the Llama math is this layer's math, rather than its class name."""
    w = fast.qkv.weight
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, n, w.shape[1], generator=g).to(w)
    angle = torch.randn(1, n, fast.head_dim // 2, generator=g).repeat(1, 1, 2).to(w)
    rope = (angle.cos(), angle.sin())  # the HF layer's (cos, sin); the lean one takes them as lean_rope makes them
    mask = torch.zeros(1, 1, n, n).masked_fill_(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).to(w)
    outs = []
    for run in (lambda c: layer(hidden, attention_mask=mask, use_cache=True, **cache_arg(layer, c),
                                position_embeddings=rope, position_ids=torch.arange(n, device=w.device)[None]),
                lambda c: fast(hidden, lean_rope(*rope), mask, c)):
        cache = SlotCache(n)
        cache.write_slots, cache.write_start, cache.width = torch.arange(n, device=w.device)[None], 0, n
        out = run(cache)
        outs.append(out[0] if isinstance(out, tuple) else out)
    ref, got = outs
    tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(w.dtype, 3e-2)  # rounding, not another formula
    return bool(torch.isfinite(got).all()) and float((got - ref).abs().max()) <= tol * float(ref.abs().max())
