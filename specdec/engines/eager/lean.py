"""A lean decode forward over the base's (and drafters') own Llama-style decoder layers.

Calling an HF decoder layer pays for module hooks, kwargs plumbing, the attention interface's head repeat, three
separate q/k/v (two gate/up) products and ~30 small elementwise ops on every token step; on a 2-core CPU, where each
op costs microseconds of dispatch, that is a large share of a 135M model's step. For a layer of the Llama layout
(Llama, Mistral, Qwen2, ... and every drafter block built from such a config) `LeanLayer` runs the same math from
the layer's own weights and norms: one product for q|k|v and one for gate|up, each RMSNorm as one fused op, q and k
rotated together with a rotary table made once per forward for all layers, SDPA with grouped KV heads, the same
cache `update`. (make bench's `lean=false` row measures what this saves.)

The fused products cost no memory: the layer's q/k/v (gate/up) weights are re-pointed as row blocks of the one
fused tensor, so the HF modules keep working on the very same numbers. A layer is taken only when its shape is
the Llama one and, on a few random tokens, the lean forward reproduces the layer's own HF forward; any other
layer (sliding windows, q/k norms, another rotary or norm formula) runs through its HF forward as before."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.base import cache_arg
from specdec.sampling.cache import SlotCache
from specdec.sampling.rotary import lean_rope

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


@dataclass
class Units:
    """An engine's replacements for parts of one lean layer's forward, by row count (None, or past a list: the PyTorch
    ops): the CUDA engine's measured forms (cuda/kernels.py), kept in its own table."""

    attention: list = field(default_factory=list)  # [n queries] -> attend(q, k, v, mask, scale) -> [B, heads, n, d]
    rope: list = field(default_factory=list)  # [n] -> write(qkv, rope, cache, layer_idx, heads) -> (q, k, v) or None
    fused: list = field(default_factory=list)  # [B·n rows] -> a cuda/fused.Fused: products with the ops around them


NO_UNITS = Units()


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

    @property
    def current(self) -> bool:
        """Whether the layer's weights are still views of the fused ones (`.to()` or a reload replaces them)."""
        q_proj, gate_proj = self.covers[0], self.covers[3]
        return (q_proj.weight.data_ptr() == self.qkv.weight.data_ptr()
                and gate_proj.weight.data_ptr() == self.gate_up.weight.data_ptr())

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache, units: Units | None = None) -> torch.Tensor:
        """hidden [B, n, H]; rope = `lean_rope` of the model's (cos, sin); mask [B, 1, n, W] additive or None; cache:
        an HF Cache whose `update` stores this call's keys and returns the keys and values to attend -> [B, n, H].
        `units`: an engine's replacements for parts of it (the CUDA engine's kernels), None: PyTorch ops throughout."""
        return self.lean_forward(hidden, rope, mask, cache, units)

    def lean_forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                     cache, units: Units | None = None) -> torch.Tensor:
        """`forward`, whatever the batch."""
        units = units or NO_UNITS
        _, norm2, o_proj, down_proj, act = self._parts
        b, n, _ = hidden.shape
        d, heads, kv = self.head_dim, self.heads, self.kv_heads
        fused = units.fused[b * n] if b * n < len(units.fused) else None
        # q [B, heads, n, d]; k, v [B, kv_heads, W, d] with this forward's written: one kernel (cuda_fused's
        # front_rope) where it was measured fastest, else the product and then the rotary and the write
        front = fused.front_rope(hidden, rope, cache, self.layer_idx) if fused is not None else None
        q, k, v = front if front is not None else self._front(hidden, rope, cache, fused, units)
        attend = units.attention[n] if n < len(units.attention) else None
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
               fused, units: Units) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q|k|v of the normed hidden (cuda_fused's front unit where chosen), then the rotary and the cache's K/V
        write (cuda_layer's one kernel where chosen): q [B, heads, n, d], k, v [B, kv_heads, W, d]."""
        n, heads, norm1 = hidden.shape[1], self.heads, self._parts[0]
        qkv = fused.front(hidden) if fused is not None else None
        if qkv is None:
            qkv = self.qkv(norm1(hidden))  # [B, n, (heads + 2·kv_heads)·d]
        write = units.rope[n] if n < len(units.rope) else None
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


def _fused_norm(norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A Llama-style RMSNorm as one fused op (F.rms_norm) rather than its ~8, where that gives bitwise the norm's own
    output on this device and dtype; otherwise the norm itself. (The CPU engine also tries one native call:
    cpu/kernels.py's `norm_form`.)"""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not (isinstance(w, torch.Tensor) and w.dim() == 1 and isinstance(eps, float)):
        return norm

    def fused(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)

    with torch.no_grad():
        probe = torch.randn(4, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w)
        return fused if torch.equal(fused(probe), norm(probe)) else norm


# norm module -> {its weight's dtype and device: what it runs as then: the fused op or the module itself}
_NORMS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def _fused(norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """`_fused_norm(norm)`, decided once per norm, dtype and device."""
    w = getattr(norm, "weight", None)
    key = (w.dtype, w.device) if isinstance(w, torch.Tensor) else None
    known = _NORMS.setdefault(norm, {})
    if key not in known:
        known[key] = _fused_norm(norm)
    return known[key]


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
    try:
        fast = LeanLayer(layer)
        return fast if _agrees(layer, fast) else None
    except RuntimeError:  # Llama-named parts that Llama's math cannot even run (EAGLE-3's layer: q/k/v read 2H)
        return None


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
