"""A lean decoder layer's products with the small ops around them, as one Triton kernel each, for a GPU's recorded
forward over up to 16 rows.

A 135M base on a GPU is launch-bound: each layer's two RMSNorm kernels, two residual adds, the SiLU and the multiply
by up do a few thousand floats of work each yet cost a kernel each, and every kernel leaves a gap on the stream
besides. Here they ride along with the products next to them:

- unit "front": RMSNorm(x)·W_qkvᵀ, the input norm as the product's prologue (each program sums its rows' squares
  itself: a row is 576 floats, read from L2 in one load where the rows fit NORM_TILE);
- unit "gated": silu(x'·W_gateᵀ)·(x'·W_upᵀ), x' = RMSNorm(x): the post-attention norm before, the activation and the
  multiply after, each program reading the gate rows and the up rows of its outputs;
- units "o" and "down": r + x·Wᵀ, the residual add after the o_proj and down_proj products;
- unit "front_rope": front with cuda_layer.rope_write as its epilogue: each program computes pairs of outputs
  (j, j + d/2) of a head, the rotary's partners, rotates q and k and stores q, k and v where rope_write stores them
  (k and v at this forward's slots of the SlotCache's buffers).

So a layer runs 7 kernels (front, the rotary + K/V write, the attention and its join, o, gated, down) where unfused
it runs 13, and 5 where front_rope and cuda_layer's self-joining attention win.
The products are cuda_kernels' matrix-vector kind ("rows": every x row against each block of W's rows, float32 products
summed in another order than cuBLAS's) without split-K (an epilogue needs the whole sum). cuda_kernels' table times each
unit per layer geometry and row count, unfused (the norm, the product measured fastest for that shape, the ops after)
against every configuration below, one pass over all the layers of that geometry recorded as a CUDA graph, and keeps a
fused form only where it reproduces the unfused one (to the table's float32 tolerance) and is faster. Like the other
Triton kernels they run only inside graph recordings (cuda_layer.launchable). Measurements (`cuda_kernels=unfused`
against the default): experiments/pages/cuda.md."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from specdec.engines.cuda.layer import launchable, slot_buffers
from specdec.engines.eager.lean import rms_form

MAX_ROWS = 16  # rows per call (one register block of x rows per program)
UNITS = ("front", "front_rope", "gated", "o", "down")  # (the order the table measures them in: front before front_rope)
# name -> (outputs per program, inputs per step, warps, rows per program: 0 all of the call's). A program covers
# BLOCK_O outputs of its rows: 576-1536 outputs make 72-1536 programs (times the row groups), for a GPU's ~100+ SMs.
# Each step's products go into a [rows, outputs, inputs] register block, summed once at the end (cuda_kernels' "rows"
# kind), so the block grows with the padded row count, and a block sized for one row costs several times its one-row
# call at 5-16 rows (experiments/fused_units.py times each configuration per row count). Two answers: smaller blocks
# (o1_k128_w4, o2_k128_w4, o2_k64_w4), and row groups ("_r2", "_r4": a program per block of outputs and group of
# rows, the weight read once from memory and again from the L2 for each further group). (A tl.dot form, rows padded
# to a 16-row tile, and one summing every step are not offered: they did not win for SmolLM2 when measured.)
CONFIGS: dict[str, tuple[int, int, int, int]] = {
    "fused_o2_k256": (2, 256, 2, 0),
    "fused_o4_k128": (4, 128, 2, 0),
    "fused_o8_k128": (8, 128, 4, 0),
    # the same blocks over twice the threads: half the registers each where 5-16 rows make the block 8-16 times larger
    "fused_o2_k256_w4": (2, 256, 4, 0),
    "fused_o4_k128_w4": (4, 128, 4, 0),
    "fused_o1_k128_w4": (1, 128, 4, 0),
    "fused_o2_k128_w4": (2, 128, 4, 0),
    "fused_o2_k64_w4": (2, 64, 4, 0),
    "fused_o2_k256_r2": (2, 256, 2, 2),
    "fused_o2_k256_r4": (2, 256, 2, 4),
    "fused_o1_k128_w4_r4": (1, 128, 4, 4),
}
NORM_TILE = 4096  # floats the norm's prologue loads at once (64 registers a thread at two warps)

_KERNEL: list = []


def _kernel():
    if not _KERNEL:
        import triton
        import triton.language as tl

        @triton.jit(do_not_specialize=["m", "tokens"])
        def fused(x, nw, w, r, y, m, o, i, eps, stride_x, stride_w, stride_r, stride_y, cos, sin, slots, keys, values,
                  tokens, sc_b, sc_n, ss_b, ss_n, sl_b, sk_b, sk_h, sk_w, NORM: tl.constexpr, GATED: tl.constexpr,
                  RESIDUAL: tl.constexpr, ROPE: tl.constexpr, HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, NORM_K: tl.constexpr):
            # program (p, g): outputs p·BLOCK_O .. of rows g·BLOCK_M ..; GATED: W's rows o.. 2o-1 are the up rows of
            # rows 0.. o-1. ROPE: W is q|k|v (HEADS, KV, KV heads of D) and the program's outputs are the pairs
            # p·BLOCK_O .. of outputs (j, j + D/2) of a head, the rotary's partners, summed in acc and acc_up.
            rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
            live = rows < m
            if ROPE:
                pairs = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
                head = pairs // (D // 2)  # [BLOCK_O]
                outs = head * D + pairs % (D // 2)
                valid = pairs < o // 2
                second = outs + D // 2
            else:
                outs = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
                valid = outs < o
                second = outs + o
            inv = tl.full([BLOCK_M], 1.0, tl.float32)
            if NORM:  # 1 / sqrt(mean(x²) + eps) per row, as RMSNorm scales it: in one or a few wide loads (each a
                # round trip the products wait for)
                squares = tl.zeros([BLOCK_M], tl.float32)
                for k in range(0, i, NORM_K):
                    cols = k + tl.arange(0, NORM_K)
                    xs = tl.load(x + rows[:, None] * stride_x + cols[None, :],
                                 mask=live[:, None] & (cols < i)[None, :], other=0.0)  # [BLOCK_M, NORM_K]
                    squares += tl.sum(xs * xs, 1)
                inv = 1.0 / tl.sqrt(squares / i + eps)
            acc = tl.zeros([BLOCK_M, BLOCK_O, BLOCK_K], tl.float32)  # products, summed once at the end
            acc_up = tl.zeros([BLOCK_M, BLOCK_O, BLOCK_K], tl.float32)
            for k in range(0, i, BLOCK_K):
                cols = k + tl.arange(0, BLOCK_K)
                inside = cols < i
                xs = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=live[:, None] & inside[None, :],
                             other=0.0)  # [BLOCK_M, BLOCK_K]
                if NORM:  # weight · (x · inv), RMSNorm's order
                    xs = (xs * inv[:, None]) * tl.load(nw + cols, mask=inside, other=0.0)[None, :]
                ws = tl.load(w + outs[:, None] * stride_w + cols[None, :], mask=valid[:, None] & inside[None, :],
                             other=0.0)  # [BLOCK_O, BLOCK_K]
                acc += xs[:, None, :] * ws[None, :, :]
                if GATED or ROPE:
                    us = tl.load(w + second[:, None] * stride_w + cols[None, :],
                                 mask=valid[:, None] & inside[None, :], other=0.0)
                    acc_up += xs[:, None, :] * us[None, :, :]
            out = tl.sum(acc, 2)  # [BLOCK_M, BLOCK_O]
            here = live[:, None] & valid[None, :]
            if GATED:  # silu(gate) · up, SiLU as x / (1 + exp(-x))
                up = tl.sum(acc_up, 2)
                out = out / (1.0 + tl.exp(-out)) * up
            if ROPE:  # q and k rotated as LeanLayer rotates them (x·cos + roll(x, D/2)·sin'), then stored where
                # rope_write stores them: q [B, HEADS, tokens, D], k and v at the row's slot of keys, values
                hi = tl.sum(acc_up, 2)
                b = rows // tokens  # [BLOCK_M]
                t = rows % tokens
                j = outs % D  # [BLOCK_O]: j < D/2, its partner j + D/2
                at = here
                c_lo = tl.load(cos + b[:, None] * sc_b + t[:, None] * sc_n + j[None, :], mask=at, other=0.0)
                c_hi = tl.load(cos + b[:, None] * sc_b + t[:, None] * sc_n + (j + D // 2)[None, :], mask=at, other=0.0)
                s_lo = tl.load(sin + b[:, None] * ss_b + t[:, None] * ss_n + j[None, :], mask=at, other=0.0)
                s_hi = tl.load(sin + b[:, None] * ss_b + t[:, None] * ss_n + (j + D // 2)[None, :], mask=at, other=0.0)
                is_v = (head >= HEADS + KV)[None, :]
                lo = tl.where(is_v, out, out * c_lo + hi * s_lo)
                hi = tl.where(is_v, hi, hi * c_hi + out * s_hi)
                slot = tl.load(slots + b * sl_b + t, mask=live, other=0)  # [BLOCK_M]
                in_q = here & (head < HEADS)[None, :]
                q_at = y + ((b[:, None] * HEADS + head[None, :]) * tokens + t[:, None]) * D + j[None, :]
                tl.store(q_at, lo, mask=in_q)
                tl.store(q_at + D // 2, hi, mask=in_q)
                in_k = here & ((head >= HEADS) & (head < HEADS + KV))[None, :]
                in_v = here & is_v
                kv_head = tl.where(is_v, head[None, :] - HEADS - KV, head[None, :] - HEADS)
                cell = b[:, None] * sk_b + kv_head * sk_h + slot[:, None] * sk_w + j[None, :]
                tl.store(keys + cell, lo, mask=in_k)
                tl.store(keys + cell + D // 2, hi, mask=in_k)
                tl.store(values + cell, lo, mask=in_v)
                tl.store(values + cell + D // 2, hi, mask=in_v)
            else:
                if RESIDUAL:
                    out += tl.load(r + rows[:, None] * stride_r + outs[None, :], mask=here, other=0.0)
                tl.store(y + rows[:, None] * stride_y + outs[None, :], out, mask=here)

        _KERNEL.append(fused)
    return _KERNEL[0]


def distinct(rows: int) -> list[str]:
    """The configurations that launch differently at `rows` rows (a row group as large as the padded count is its
    configuration without groups: measured once, under the first name)."""
    seen, names = set(), []
    for name, (block_o, block_k, warps, group) in CONFIGS.items():
        launch = (block_o, block_k, warps, min(1 << (rows - 1).bit_length(), group or MAX_ROWS))
        if launch not in seen:
            seen.add(launch)
            names.append(name)
    return names


def product(x: torch.Tensor, w: torch.Tensor, config: str, norm: tuple[torch.Tensor, float] | None = None,
            gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, I] (m ≤ 16, float32, contiguous) -> [m, O]: x'·Wᵀ with x' = RMSNorm(x) where norm = (weight [I], eps) is
    given, else x; gated: W [2·O, I] holds the gate rows then the up rows, and the result is silu(x'·Gᵀ)·(x'·Uᵀ);
    residual [m, O]: added to the result."""
    m = x.shape[0]
    o = w.shape[0] // 2 if gated else w.shape[0]
    if (gated and w.shape[0] % 2) or (residual is not None and (residual.shape != (m, o) or residual.dtype != x.dtype
                                                                or not residual.is_contiguous())):
        raise ValueError("the fused product takes up to 16 contiguous float32 rows and matching weights")
    y = torch.empty(m, o, dtype=x.dtype, device=x.device)
    _launch(x, w, config, y, o, norm, gated=gated, residual=residual)
    return y


def front_rope(x: torch.Tensor, w: torch.Tensor, config: str, norm: tuple[torch.Tensor, float],
               rope: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               heads: int) -> torch.Tensor:
    """x [B, n, I] (B·n ≤ 16) -> q [B, heads, n, d]: RMSNorm(x)·W_qkvᵀ (W [(heads + 2·kv)·d, I]) split into heads, q
    and k rotated as LeanLayer rotates them (rope: lean_rope's cos, sin' [B or 1, 1, n, d]), k and v written at
    slots [B, n] of keys, values [B, kv, M, d] (a SlotCache layer's buffers): the front unit and
    cuda_layer.rope_write as one kernel, to float32 rounding of them (the rotation may fuse a multiply-add)."""
    b, n, i = x.shape
    kv, d = keys.shape[1], keys.shape[3]
    cos, sin = (t.expand(b, 1, n, d) for t in rope)
    slots = slots.expand(b, n)
    if not (w.shape[0] == (heads + 2 * kv) * d and d % 2 == 0 and keys.dtype == x.dtype and keys.stride(-1) == 1
            and keys.stride() == values.stride() and cos.stride(-1) == 1 and sin.stride(-1) == 1):
        raise ValueError("front_rope takes the q|k|v weight of `heads` and the buffers' kv heads of d, rows contiguous")
    q = torch.empty(b, heads, n, d, dtype=x.dtype, device=x.device)
    _launch(x.reshape(b * n, i), w, config, q, w.shape[0], norm, rope=dict(
        cos=cos, sin=sin, slots=slots, keys=keys, values=values, tokens=n, sc_b=cos.stride(0), sc_n=cos.stride(2),
        ss_b=sin.stride(0), ss_n=sin.stride(2), sl_b=slots.stride(0), sk_b=keys.stride(0), sk_h=keys.stride(1),
        sk_w=keys.stride(2), HEADS=heads, KV=kv, D=d))
    return q


def _launch(x: torch.Tensor, w: torch.Tensor, config: str, y: torch.Tensor, o: int,
            norm: tuple[torch.Tensor, float] | None, gated: bool = False, residual: torch.Tensor | None = None,
            rope: dict | None = None) -> None:
    """The kernel with `config` over x [m, I] into y: [m, o] (rope: q, [B, heads, n, d]); o outputs (rope: pairs
    of them, o / 2)."""
    block_o, block_k, warps, group = CONFIGS[config]
    m, i = x.shape
    tensors = [x, w] + ([norm[0]] if norm else [])
    if m > MAX_ROWS or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        raise ValueError("the fused product takes up to 16 contiguous float32 rows and matching weights")
    block_m = min(1 << (m - 1).bit_length(), group or MAX_ROWS)  # rows per program
    # the norm's loads: whole rows where BLOCK_M of them fit NORM_TILE floats, else NORM_TILE floats of rows at a time
    norm_k = max(block_k, min(1 << (i - 1).bit_length(), NORM_TILE // block_m))
    nw, eps = norm if norm else (w, 0.0)  # (not read without NORM)
    r = residual if residual is not None else y  # (not read without RESIDUAL)
    # (without ROPE its tensors are not read and its sizes unused)
    extra = rope or dict(cos=y, sin=y, slots=y, keys=y, values=y, tokens=1, sc_b=0, sc_n=0, ss_b=0, ss_n=0, sl_b=0,
                         sk_b=0, sk_h=0, sk_w=0, HEADS=1, KV=1, D=2)
    outputs = o // 2 if rope else o
    _kernel()[(-(-outputs // block_o), -(-m // block_m))](
        x, nw, w, r, y, m, o, i, eps, x.stride(0), w.stride(0), r.stride(0), y.stride(0), **extra,
        NORM=norm is not None, GATED=gated, RESIDUAL=residual is not None, ROPE=rope is not None, BLOCK_M=block_m,
        BLOCK_O=block_o, BLOCK_K=block_k, NORM_K=norm_k, num_warps=warps)


def norms(layer) -> tuple[tuple[torch.Tensor, float] | None, ...]:
    """(weight, eps) of a lean layer's input and post-attention RMSNorms where F.rms_norm's formula is theirs (what
    the kernel computes), else None."""
    return tuple(rms_form(norm, layer.qkv.weight.device.type) for norm in layer.norms)


def units(layer) -> tuple[str, ...]:
    """The units a lean layer can run fused: each whose product has no bias (the kernel adds none), "front",
    "front_rope" and "gated" where the norm before them is F.rms_norm's, "front_rope" where the head size is even (the
    rotary's halves), "gated" where the activation is SiLU."""
    _, _, o_proj, down_proj, act = layer._parts
    probe = torch.linspace(-8, 8, 97, device=layer.qkv.weight.device, dtype=layer.qkv.weight.dtype)
    first, second = norms(layer)
    return tuple(u for u, linear, ok in [
        ("front", layer.qkv, first is not None),
        ("front_rope", layer.qkv, first is not None and layer.head_dim % 2 == 0),
        ("gated", layer.gate_up, second is not None and torch.equal(act(probe), F.silu(probe))),
        ("o", o_proj, True), ("down", down_proj, True)] if ok and linear.bias is None)


class Fused:
    """One lean layer's fused units at one row count: unit -> configuration (a unit not in it runs unfused).
    `front_rope`, `front`, `gated` and `add` return None where their unit is not chosen or cannot run here (launched
    from Python, not [rows, H] contiguous, no slot cache): the lean forward's other forms then."""

    def __init__(self, layer):
        """The layer's units, none chosen yet (`at` chooses)."""
        self.offered = units(layer)
        self.norms = norms(layer)
        self.heads = layer.heads
        _, _, o_proj, down_proj, _ = layer._parts
        self.weights = {"front": layer.qkv.weight, "gated": layer.gate_up.weight, "o": o_proj.weight,
                        "down": down_proj.weight}  # (front_rope multiplies front's)
        self.configs: dict[str, str] = {}

    def at(self, configs: dict[str, str]) -> Fused:
        """This layer with `configs` chosen (those of its offered units; the rest stay unfused)."""
        other = copy.copy(self)
        other.configs = {u: c for u, c in configs.items() if u in self.offered}
        return other

    def unit(self, unit: str, config: str, x: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The unit's kernel with `config` on x [rows, I] (and for "o" and "down" the residual hidden [rows, H]),
        wherever it is called (the table's checks and timings too)."""
        kw = {"front": {"norm": self.norms[0]}, "gated": {"norm": self.norms[1], "gated": True}}.get(unit, {})
        return product(x, self.weights[unit], config, residual=hidden, **kw)

    def rotated(self, config: str, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The front_rope kernel with `config` on x [B, n, H]: q [B, heads, n, d], k and v written at slots [B, n] of
        keys, values (wherever it is called: the table's checks and timings too)."""
        return front_rope(x, self.weights["front"], config, self.norms[0], rope, slots, keys, values, self.heads)

    def front_rope(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache,
                   layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The input norm, q|k|v, the rotary and the cache's K/V write of hidden [B, n, H] as one kernel: (q
        [B, heads, n, d], the keys and values to attend [B, kv, width, d]); None where not chosen or not runnable."""
        config = self.configs.get("front_rope")
        found = slot_buffers(cache, layer_idx, hidden) if config is not None and hidden.is_contiguous() else None
        if found is None:
            return None
        slots, keys, values = found
        q = self.rotated(config, hidden, rope, slots, keys, values)
        return q, keys[:, :, :cache.width], values[:, :, :cache.width]

    def _run(self, unit: str, x: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        config = self.configs.get(unit)
        if config is None or not launchable(x) or not x.is_contiguous():
            return None
        rows = x.numel() // x.shape[-1]
        out = self.unit(unit, config, x.view(rows, x.shape[-1]), hidden)
        return out.view(*x.shape[:-1], out.shape[-1])

    def front(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """q|k|v of the normed hidden [B, n, H] -> [B, n, (heads + 2·kv)·d]."""
        return self._run("front", hidden)

    def gated(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """act(gate)·up of the normed hidden [B, n, H] -> [B, n, intermediate]."""
        return self._run("gated", hidden)

    def add(self, unit: str, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden + x·Wᵀ for unit "o" (x: the attention's [B, n, heads·d]) or "down" (x: [B, n, intermediate])."""
        if not hidden.is_contiguous():
            return None
        return self._run(unit, x, hidden.view(-1, hidden.shape[-1]))
