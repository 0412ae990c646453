"""A lean decoder layer's products with the small ops around them, as one Triton kernel each, for a GPU's recorded
forward over up to 16 rows.

A 135M base on a GPU is launch-bound: on an H200 a recorded forward of SmolLM2 at one token spent 1,160 µs of kernels
(experiments/results/cuda_s37, verify_forms.log), of which each layer's two RMSNorm kernels (159 µs in all), two
residual adds (71), the SiLU (49) and the multiply by up (36) do a few thousand floats of work each, and every kernel
leaves a gap of ~1 µs on the stream besides. Here they ride along with the products next to them:

- unit "front": RMSNorm(x)·W_qkvᵀ, the input norm as the product's prologue (each program sums its rows' squares
  itself: a row is 576 floats, read from L2 in one load where the rows fit NORM_TILE);
- unit "gated": silu(x'·W_gateᵀ)·(x'·W_upᵀ), x' = RMSNorm(x): the post-attention norm before, the activation and the
  multiply after, each program reading the gate rows and the up rows of its outputs;
- units "o" and "down": r + x·Wᵀ, the residual add after the o_proj and down_proj products.

So a layer runs 7 kernels (the four units, the rotary + K/V write, the attention and its join) where it ran 13.
The products are cuda_kernels' matrix-vector kind ("rows": every x row against each block of W's rows, float32 products
summed in another order than cuBLAS's) without split-K (an epilogue needs the whole sum). cuda_kernels' table times each
unit per layer geometry and row count, unfused (the norm, the product measured fastest for that shape, the ops after)
against every configuration below, one pass over all the layers of that geometry recorded as a CUDA graph, and keeps a
fused form only where it reproduces the unfused one (to the table's float32 tolerance) and is faster. Like the other
Triton kernels they run only inside graph recordings (cuda_layer.launchable). On an H200 (forty-first session,
experiments/results/cuda_s41) our graphed AR loop ran 1.21× the same loop unfused, T_1 1.17 ms against 1.37; with
the norm's rows loaded at once (forty-second session, another H200, results/cuda_s42/norm_prologue) 1.31×, T_1 1.21 ms
against 1.40."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from specdec.sampling.cuda_layer import launchable
from specdec.sampling.lean import rms_form

MAX_ROWS = 16  # rows per call (one register block of x rows per program)
UNITS = ("front", "gated", "o", "down")
# name -> (outputs per program, inputs per step, warps, rows per program: 0 all of the call's). A program covers
# BLOCK_O outputs of its rows: 576-1536 outputs make 72-1536 programs for an H200's 132 SMs (times the row groups).
# Each step's products go into a [rows, outputs, inputs] register block, summed once at the end (cuda_kernels' "rows"
# kind), so the block grows with the padded row count: at 9-16 rows the gated unit's two blocks of o4_k128 cost ~3x
# its one-row call on an H200, where o2_k64_w4 costs 15.4-15.9 µs against its 5.7, and at 5 rows (padded to 8) every
# unit costs 1.6-2.1x its one-row call (experiments/fused_units.py, results/cuda_s42/fused_units). Two answers: smaller
# blocks (o1_k128_w4, o2_k128_w4, o2_k64_w4; o1_k128_w4 is also the fastest gated, o and down at one row there), and
# row groups ("_r2", "_r4": a program per block of outputs and group of rows, the weight read once from memory and
# again from the L2 for each further group; not yet measured on a GPU). (A tl.dot form, rows padded to a 16-row tile,
# and one summing every step, "each", were offered in the forty-first and forty-second sessions and never chosen for
# SmolLM2 on an H200: not offered.)
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

        @triton.jit(do_not_specialize=["m"])
        def fused(x, nw, w, r, y, m, o, i, eps, stride_x, stride_w, stride_r, stride_y, NORM: tl.constexpr,
                  GATED: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr,
                  BLOCK_K: tl.constexpr, NORM_K: tl.constexpr):
            # program (p, g): outputs p·BLOCK_O .. of rows g·BLOCK_M ..; GATED: W's rows o.. 2o-1 are the up rows of
            # rows 0.. o-1
            rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
            live = rows < m
            outs = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
            valid = outs < o
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
                if GATED:
                    us = tl.load(w + (outs + o)[:, None] * stride_w + cols[None, :],
                                 mask=valid[:, None] & inside[None, :], other=0.0)
                    acc_up += xs[:, None, :] * us[None, :, :]
            out = tl.sum(acc, 2)  # [BLOCK_M, BLOCK_O]
            if GATED:  # silu(gate) · up, SiLU as x / (1 + exp(-x))
                up = tl.sum(acc_up, 2)
                out = out / (1.0 + tl.exp(-out)) * up
            here = live[:, None] & valid[None, :]
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
    block_o, block_k, warps, group = CONFIGS[config]
    m, i = x.shape
    o = w.shape[0] // 2 if gated else w.shape[0]
    tensors = [x, w] + ([norm[0]] if norm else []) + ([residual] if residual is not None else [])
    if m > MAX_ROWS or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors) or (
            gated and w.shape[0] % 2) or (residual is not None and residual.shape != (m, o)):
        raise ValueError("the fused product takes up to 16 contiguous float32 rows and matching weights")
    block_m = min(1 << (m - 1).bit_length(), group or MAX_ROWS)  # rows per program
    # the norm's loads: whole rows where BLOCK_M of them fit NORM_TILE floats, else NORM_TILE floats of rows at a time
    norm_k = max(block_k, min(1 << (i - 1).bit_length(), NORM_TILE // block_m))
    y = torch.empty(m, o, dtype=x.dtype, device=x.device)
    nw, eps = norm if norm else (w, 0.0)  # (not read without NORM)
    r = residual if residual is not None else y  # (not read without RESIDUAL)
    _kernel()[(-(-o // block_o), -(-m // block_m))](
        x, nw, w, r, y, m, o, i, eps, x.stride(0), w.stride(0), r.stride(0), y.stride(0), NORM=norm is not None,
        GATED=gated, RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_O=block_o, BLOCK_K=block_k, NORM_K=norm_k,
        num_warps=warps)
    return y


def norms(layer) -> tuple[tuple[torch.Tensor, float] | None, ...]:
    """(weight, eps) of a lean layer's input and post-attention RMSNorms where F.rms_norm's formula is theirs (what
    the kernel computes), else None."""
    return tuple(rms_form(norm, layer.qkv.weight.device.type) for norm in layer.norms)


def units(layer) -> tuple[str, ...]:
    """The units a lean layer can run fused: each whose product has no bias (the kernel adds none), "front" and
    "gated" where the norm before them is F.rms_norm's, "gated" where the activation is SiLU."""
    _, _, o_proj, down_proj, act = layer._parts
    probe = torch.linspace(-8, 8, 97, device=layer.qkv.weight.device, dtype=layer.qkv.weight.dtype)
    first, second = norms(layer)
    return tuple(u for u, linear, ok in [
        ("front", layer.qkv, first is not None),
        ("gated", layer.gate_up, second is not None and torch.equal(act(probe), F.silu(probe))),
        ("o", o_proj, True), ("down", down_proj, True)] if ok and linear.bias is None)


class Fused:
    """One lean layer's fused units at one row count: unit -> configuration (a unit not in it runs unfused).
    `front`, `gated` and `add` return None where their unit is not chosen or cannot run here (launched from Python,
    not [rows, H] contiguous): the lean forward's PyTorch ops then."""

    def __init__(self, layer):
        """The layer's units, none chosen yet (`at` chooses)."""
        self.offered = units(layer)
        self.norms = norms(layer)
        _, _, o_proj, down_proj, _ = layer._parts
        self.weights = {"front": layer.qkv.weight, "gated": layer.gate_up.weight, "o": o_proj.weight,
                        "down": down_proj.weight}
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
