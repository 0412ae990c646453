"""CUDA products and attention for decoding, chosen by measurement on the GPU that runs them.

A verify multiplies every weight by a few rows. cuBLAS serves one row with a matrix-vector kernel and two or more with
float32 GEMM kernels made for large tiles, which at a few rows take far longer than the one-row kernel: that is most of
why a verify of a few tokens costs well over one decode step. `small_m_linear` runs Triton kernels for up to 16 rows, of
two kinds (CONFIGS): each program reads a block of W's rows once for all the x rows (x·Wᵀ, float32 products and sums,
the order of the sum its own), either through tl.dot on a 16-row tile or, a matrix-vector kernel over the call's own
rows, as elementwise products summed once at the end; optionally over a slice of the inputs (split-K, the slices summed
by one more kernel, so the result does not depend on timing). And SDPA with an additive mask runs the memory-efficient
attention kernel; for a few queries the same formula as two matmuls and a softmax (`math_attention`) can be faster, so
it is a candidate too.

Nothing is assumed: on first use on a GPU, each weight shape's products are timed per row count, cuBLAS (F.linear)
against every Triton configuration, one pass over the model's own weights of that shape recorded as a CUDA graph and
replayed (as the sampler runs them), and the attention's forms per query count over a layer's geometry the same
way (with Triton also cuda_layer's one-kernel attention, and its rotary + K/V write against the PyTorch ops), and then
per layer geometry and row count each of cuda_fused's units (a product with the norm before it or the SiLU and
residual add after it, one kernel) against the same ops unfused. The fastest is kept and cached per GPU (its name,
torch and Triton versions) next to the CPU table. Where Triton is missing, a configuration fails to build or gives
another product (checked against F.linear first), F.linear and SDPA stay: the fallback is PyTorch's own.

The measured kernels run only inside CUDA graph recordings, where they were timed. Launched from Python a Triton kernel
costs far more than cuBLAS's launch, enough to make a product that wins inside a graph lose outside one (an lm_head
after a recorded forward, a dynamic tree drafted op by op). So a product outside a graph stays cuBLAS's. Measurements
of each choice: experiments/pages/cuda.md."""

from __future__ import annotations

import json
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from specdec.engines import measure
from specdec.engines.cuda import fused as cuda_fused
from specdec.engines.cuda import layer as cuda_layer
from specdec.engines.eager.lean import NO_UNITS, LeanLayer, Units, decode_linears, lean_layers
from specdec.engines.measure import per_count, store
from specdec.sampling.rotary import lean_rope

# row and query counts measured: the Triton products take up to 16 rows (more take F.linear), the attention and the
# rotary + K/V write up to a recorded graph's 64 queries (more: PyTorch's); other dtypes take PyTorch's throughout
ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
MAX_ROWS = 16  # one block of x rows per program (tl.dot's smallest tile side)
# name -> (kind, output rows per program, inputs per step, split-K slices, warps, pipeline stages). Two kinds:
# - "dot": x rows padded to a 16-row tile, one tl.dot per step (float32 FMAs);
# - "rows": as many x rows as the call has (the next power of two: one compiled variant per bucket), each step's
#   products summed elementwise into a [rows, outputs, inputs] register block and reduced once at the end: a
#   matrix-vector kernel that reads each weight once for all rows.
# A grid that spans few wide programs (a large weight) to many narrow ones over input slices (576-1536 inputs, 576-3072
# outputs: too few programs else).
CONFIGS: dict[str, tuple[str, int, int, int, int, int]] = {
    "triton_o16_k64": ("dot", 16, 64, 1, 2, 3),
    "triton_o32_k64": ("dot", 32, 64, 1, 4, 3),
    "triton_o64_k64": ("dot", 64, 64, 1, 4, 3),
    "triton_o16_k128": ("dot", 16, 128, 1, 4, 3),
    "triton_o16_k64_s2": ("dot", 16, 64, 2, 2, 3),
    "triton_o16_k64_s4": ("dot", 16, 64, 4, 2, 3),
    "triton_o32_k64_s4": ("dot", 32, 64, 4, 4, 3),
    "triton_o16_k32_s8": ("dot", 16, 32, 8, 2, 3),
    "rows_o8_k128": ("rows", 8, 128, 1, 4, 2),
    "rows_o16_k64": ("rows", 16, 64, 1, 4, 2),
    "rows_o32_k32": ("rows", 32, 32, 1, 4, 2),
    "rows_o4_k256_s2": ("rows", 4, 256, 2, 4, 2),
    "rows_o8_k64_s4": ("rows", 8, 64, 4, 2, 2),
    "rows_o64_k32": ("rows", 64, 32, 1, 8, 2),
}
TOLERANCE = 1e-4  # of the output's largest magnitude: float32 sums in another order, not another product
REPLAYS = 20  # replays of a recorded pass, timed together
DEFAULT_CACHE = measure.cache_path("kernels_cuda.json")

_KERNELS: dict[str, object] = {}  # kind -> the Triton kernel, built on first use


def _triton_kernel(kind: str):
    if kind not in _KERNELS:
        import triton
        import triton.language as tl

        # program (p, s): outputs p·BLOCK_O.. of every x row, over inputs s·span .. (s+1)·span of I. The row count and
        # slab stride vary by call: not specialised on (a new variant would compile mid-decode).
        @triton.jit(do_not_specialize=["m", "stride_split"])
        def dot(x, w, y, m, o, i, span, stride_x, stride_w, stride_y, stride_split,
                BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr):
            rows = tl.arange(0, BLOCK_M)
            outs = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
            start = tl.program_id(1) * span
            acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
            for k in range(0, span, BLOCK_K):
                cols = start + k + tl.arange(0, BLOCK_K)
                xs = tl.load(x + rows[:, None] * stride_x + cols[None, :],
                             mask=(rows[:, None] < m) & (cols[None, :] < i), other=0.0)  # [BLOCK_M, BLOCK_K]
                ws = tl.load(w + outs[:, None] * stride_w + cols[None, :],
                             mask=(outs[:, None] < o) & (cols[None, :] < i), other=0.0)  # [BLOCK_O, BLOCK_K]
                acc += tl.dot(xs, tl.trans(ws), input_precision="ieee")  # float32 FMAs, not TF32
            out = y + tl.program_id(1) * stride_split + rows[:, None] * stride_y + outs[None, :]
            tl.store(out, acc, mask=(rows[:, None] < m) & (outs[None, :] < o))

        @triton.jit(do_not_specialize=["m", "stride_split"])
        def rows(x, w, y, m, o, i, span, stride_x, stride_w, stride_y, stride_split,
                 BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr):
            r = tl.arange(0, BLOCK_M)
            outs = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
            start = tl.program_id(1) * span
            acc = tl.zeros((BLOCK_M, BLOCK_O, BLOCK_K), dtype=tl.float32)
            for k in range(0, span, BLOCK_K):
                cols = start + k + tl.arange(0, BLOCK_K)
                xs = tl.load(x + r[:, None] * stride_x + cols[None, :],
                             mask=(r[:, None] < m) & (cols[None, :] < i), other=0.0)  # [BLOCK_M, BLOCK_K]
                ws = tl.load(w + outs[:, None] * stride_w + cols[None, :],
                             mask=(outs[:, None] < o) & (cols[None, :] < i), other=0.0)  # [BLOCK_O, BLOCK_K]
                acc += xs[:, None, :] * ws[None, :, :]  # [BLOCK_M, BLOCK_O, BLOCK_K]
            out = y + tl.program_id(1) * stride_split + r[:, None] * stride_y + outs[None, :]
            tl.store(out, tl.sum(acc, axis=2), mask=(r[:, None] < m) & (outs[None, :] < o))

        _KERNELS.update(dot=dot, rows=rows)
    return _KERNELS[kind]


def small_m_linear(x: torch.Tensor, w: torch.Tensor, config: str) -> torch.Tensor:
    """x [M, I] @ w [O, I]ᵀ -> [M, O] (float32, M ≤ MAX_ROWS, both contiguous) with CONFIGS[config]."""
    kind, block_o, block_k, split, warps, stages = CONFIGS[config]
    m, i = x.shape
    o = w.shape[0]
    if m > MAX_ROWS or x.dtype != torch.float32 or w.dtype != torch.float32 or w.stride(1) != 1:
        raise ValueError("small_m_linear takes up to 16 float32 rows and a float32 weight with contiguous rows")
    x = x.contiguous()
    y = torch.empty((split, m, o), dtype=x.dtype, device=x.device)  # one slab per input slice
    grid = ((o + block_o - 1) // block_o, split)
    span = -(-i // (block_k * split)) * block_k  # inputs per slice, whole steps of block_k
    block_m = MAX_ROWS if kind == "dot" else 1 << (m - 1).bit_length()  # rows: the next power of two
    _triton_kernel(kind)[grid](x, w, y, m, o, i, span, x.stride(0), w.stride(0), y.stride(1), y.stride(0),
                               BLOCK_M=block_m, BLOCK_O=block_o, BLOCK_K=block_k, num_warps=warps,
                               num_stages=stages)
    return y[0] if split == 1 else y.sum(0)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v, the heads that share a KV head as one block of rows: q [B, h, n, d], k, v
    [B, kv, W, d], mask [B, 1, n, W] additive or None -> [B, h, n, d]. (What SDPA computes; as two batched matmuls and
    a softmax.)"""
    b, h, n, d = q.shape
    kv = k.shape[1]
    g = h // kv  # query heads per KV head: q heads kv_i·g .. kv_i·g + g-1 read KV head kv_i
    s = torch.matmul(q.reshape(b, kv, g * n, d), k.transpose(-1, -2)) * scale  # [B, kv, g·n, W]
    if mask is not None:
        s = (s.view(b, kv, g, n, -1) + mask[:, :, None]).view(b, kv, g * n, -1)
    return torch.matmul(torch.softmax(s, dim=-1), v).view(b, h, n, d)


def available() -> bool:
    """Whether Triton imports (the Triton candidates are offered only then)."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 — missing or broken: PyTorch's kernels only
        return False
    return True


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


ATTENTIONS: dict[str, Callable] = {"sdpa": _sdpa, "math": math_attention}
ATTENTION_WIDTH = 512  # key slots the attention forms are timed over (a graph pool's width for decodes of 257-512)


def _signature() -> str:
    """The candidates and the kernels' source, hashed: a table measured before either changed is measured again."""
    source = "".join(Path(m.__file__).read_text() for m in (cuda_fused, cuda_layer)) + Path(__file__).read_text()
    configs = {**CONFIGS, **cuda_fused.CONFIGS}
    return measure.signature(" ".join(f"{k}={v}" for k, v in configs.items()) + source)


class CudaTable:
    """Fastest product per (weight shape, row count) and attention form per (layer geometry, query count) on this GPU,
    measured once and cached in `path`."""

    def __init__(self, device: torch.device, path: Path | str | None = DEFAULT_CACHE, rows: tuple[int, ...] = ROWS,
                 triton: bool | None = None):
        self.device = torch.device(device)
        self.path = Path(path).expanduser() if path is not None else None
        self.rows = rows
        self.triton = available() if triton is None else triton
        self.key = measure.gpu_key(self.device)
        self.signature = _signature()
        self.choice: dict[str, dict[int, str]] = {}  # "OxI" -> {rows: candidate}
        self.timings: dict[str, dict[int, dict[str, float]]] = {}  # "OxI" -> rows -> candidate -> seconds
        self.attention: dict[str, dict[int, str]] = {}  # "heads H, kv K, d D:dtype" -> {queries: form}
        self.rope: dict[str, dict[int, str]] = {}  # the same geometries -> {queries: "torch" or "triton"}
        self.eager: dict[str, dict[int, str]] = {}  # the same -> {queries: the faster of SDPA and matmul + softmax}
        # "hidden H, mlp I, <geometry>" -> {rows: {cuda_fused unit: its configuration, or "torch": unfused}}
        self.fused: dict[str, dict[int, dict[str, str]]] = {}
        self.measure_s = 0.0  # time spent measuring in this process (reported, never hidden)
        if self.path is not None and self.path.exists():
            stored = json.loads(self.path.read_text()).get(self.key, {})
            if stored.get("candidates") == self.signature and stored.get("triton") == self.triton:
                self.choice = {s: {int(r): k for r, k in c.items()} for s, c in stored["choice"].items()}
                self.timings = {s: {int(r): t for r, t in c.items()} for s, c in stored["timings"].items()}
                self.attention = {g: {int(n): f for n, f in c.items()} for g, c in stored["attention"].items()}
                self.rope = {g: {int(n): f for n, f in c.items()} for g, c in stored.get("rope", {}).items()}
                self.eager = {g: {int(n): f for n, f in c.items()} for g, c in stored.get("eager", {}).items()}
                self.fused = {g: {int(n): u for n, u in c.items()} for g, c in stored.get("fused", {}).items()}

    def candidates(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
        found = {"linear": _linear}
        if self.triton:
            found.update({name: (lambda x, w, c=name: small_m_linear(x, w, c)) for name in CONFIGS})
        return found

    def attention_forms(self) -> dict[str, Callable]:
        """Attention forms (q, k, v, mask, scale) -> [B, h, n, d]: SDPA, matmul + softmax, and with Triton the
        one-kernel forms of cuda_layer."""
        forms = dict(ATTENTIONS)
        if self.triton:
            forms.update({name: (lambda q, k, v, mask, scale, f=name: cuda_layer.attention(q, k, v, mask, scale, f))
                          for name in cuda_layer.FORMS})
        return forms

    def save(self) -> None:
        store(self.path, self.key, {"candidates": self.signature, "triton": self.triton, "choice": self.choice,
                                    "timings": self.timings, "attention": self.attention, "rope": self.rope,
                                    "eager": self.eager, "fused": self.fused})

    @torch.no_grad()
    def prepare(self, weights: list[torch.Tensor], layers: list) -> None:
        """Measure every weight shape and layer geometry not yet in the table (on those very weights)."""
        by_shape: dict[str, list[torch.Tensor]] = {}
        for w in weights:
            by_shape.setdefault(_shape_key(w), []).append(w)
        geometries = {_geometry(f): f for f in layers}
        blocks: dict[str, list] = {}
        for f in layers:
            blocks.setdefault(_block(f), []).append(f)
        missing = {s: ws for s, ws in by_shape.items() if s not in self.choice}
        new_geometries = {g: f for g, f in geometries.items()
                          if not all(g in known for known in (self.attention, self.rope, self.eager))}
        new_blocks = {k: fs for k, fs in blocks.items() if k not in self.fused}
        if not missing and not new_geometries and not new_blocks:
            return
        t0 = time.perf_counter()
        for shape, ws in missing.items():
            self.timings[shape] = {rows: self._time_products(ws, rows) for rows in self.rows}
            self.choice[shape] = {rows: min(t, key=t.get) for rows, t in self.timings[shape].items()}
        for geometry, f in new_geometries.items():
            self.attention[geometry], self.eager[geometry] = self._measure_attention(f)
            self.rope[geometry] = self._measure_rope(f)
        for block, fs in new_blocks.items():  # (after the products: the unfused forms use their choice)
            self.fused[block] = self._measure_fused(fs)
        self.measure_s += time.perf_counter() - t0
        self.save()

    def _time_products(self, weights: list[torch.Tensor], rows: int) -> dict[str, float]:
        """Seconds per product of each candidate that reproduces F.linear, at `rows` rows: one pass over (up to 32 of)
        the shape's weights, recorded and replayed (on a GPU), best of 3 interleaved passes."""
        ws = weights[:32]
        x = torch.randn(rows, ws[0].shape[1], dtype=ws[0].dtype, device=ws[0].device)
        reference = F.linear(x, ws[0])
        usable = {}
        for name, fn in self.candidates().items():
            try:  # one that fails to build here, or gives another product, is left out
                if torch.allclose(fn(x, ws[0]), reference, rtol=0, atol=TOLERANCE * float(reference.abs().max())):
                    usable[name] = fn
            except Exception:  # noqa: BLE001
                continue
        passes = {name: (lambda fn=fn: [fn(x, w) for w in ws]) for name, fn in usable.items()}
        return {name: t / len(ws) for name, t in _best_of(passes, self.device).items()}

    def _measure_attention(self, layer) -> tuple[dict[int, str], dict[int, str]]:
        """{queries: form} for a layer's geometry: each form over ATTENTION_WIDTH key slots, half of them masked; and
        {queries: the fastest PyTorch form}, what a Triton form falls back to where it does not run."""
        choice, eager = {}, {}
        for n in self.rows:
            b, d = 1, layer.head_dim
            dev, dtype = self.device, layer.qkv.weight.dtype
            q = torch.randn(b, layer.heads, n, d, device=dev, dtype=dtype)
            k, v = (torch.randn(b, layer.kv_heads, ATTENTION_WIDTH, d, device=dev, dtype=dtype) for _ in range(2))
            mask = torch.zeros(b, 1, n, ATTENTION_WIDTH, device=dev, dtype=dtype)
            mask[..., ATTENTION_WIDTH // 2:] = torch.finfo(dtype).min
            reference = _sdpa(q, k, v, mask, layer.scaling)
            usable = {}
            for name, fn in self.attention_forms().items():
                try:  # one that fails to build here, or computes something else, is left out
                    if torch.allclose(fn(q, k, v, mask, layer.scaling), reference, rtol=0,
                                      atol=TOLERANCE * float(reference.abs().max())):
                        usable[name] = fn
                except Exception:  # noqa: BLE001
                    continue
            # a forward runs one per layer: 30 in a row, as the pass of products does
            passes = {name: (lambda fn=fn: [fn(q, k, v, mask, layer.scaling) for _ in range(30)])
                      for name, fn in usable.items()}
            times = _best_of(passes, self.device)
            choice[n] = min(times, key=times.get)
            eager[n] = min((f for f in times if f in ATTENTIONS), key=times.get)
        return choice, eager

    def _measure_rope(self, layer) -> dict[int, str]:
        """{queries: "torch" or "triton"} for a layer's geometry: its rotary and K/V write as the lean forward's PyTorch
        ops or cuda_layer's one kernel, which is offered only where it writes bitwise what they write."""
        if not self.triton:
            return {}
        choice = {}
        dev, dtype = self.device, layer.qkv.weight.dtype
        d, heads, kv = layer.head_dim, layer.heads, layer.kv_heads
        for n in self.rows:
            qkv = torch.randn(1, n, (heads + 2 * kv) * d, device=dev, dtype=dtype)
            angle = torch.randn(1, 1, n, d, device=dev, dtype=dtype)
            cos, sin = angle.cos(), angle.sin()
            slots = torch.arange(n, device=dev)[None] + ATTENTION_WIDTH // 2
            stores = {name: [torch.zeros(1, kv, ATTENTION_WIDTH, d, device=dev, dtype=dtype) for _ in range(2)]
                      for name in ("torch", "triton")}
            forms = {"torch": cuda_layer.rope_write_torch, "triton": cuda_layer.rope_write}
            written = {}
            for name, fn in list(forms.items()):
                try:
                    written[name] = [fn(qkv, cos, sin, slots, *stores[name], heads), *stores[name]]
                except Exception:  # noqa: BLE001 — fails to build here: the PyTorch ops
                    forms.pop(name)
            if "triton" in forms and not all(map(torch.equal, written["torch"], written["triton"])):
                forms.pop("triton")
            passes = {name: (lambda fn=fn, b=stores[name]: [fn(qkv, cos, sin, slots, *b, heads) for _ in range(30)])
                      for name, fn in forms.items()}
            times = _best_of(passes, self.device)
            choice[n] = min(times, key=times.get)
        return choice

    def _measure_fused(self, layers: list) -> dict[int, dict[str, str]]:
        """{rows: {unit: configuration or "torch"}} for cuda_fused's units over layers of one geometry, up to its 16
        rows: each unfused (the layer's norm, the product this table chose for the shape at that count, the ops after;
        for front_rope the front unit as chosen just before it, then the rotary + K/V write as chosen) against every
        configuration that reproduces it (each way of launching once), timed as one pass over all the layers."""
        if not self.triton:
            return {}
        f0 = layers[0]
        dev, dtype = self.device, f0.qkv.weight.dtype
        hidden, inter, heads = f0.qkv.weight.shape[1], f0.intermediate, f0.heads * f0.head_dim
        rope_at = per_count(self.rope.get(_geometry(f0), {}), max(self.rows), "torch")
        forms = [_unit_forms(f, self._product, rope_at) for f in layers]
        offered = [u for u in cuda_fused.UNITS if all(u in fs for fs in forms)]
        choice = {}
        for n in (r for r in self.rows if r <= cuda_fused.MAX_ROWS):
            x, h = (torch.randn(n, hidden, device=dev, dtype=dtype) for _ in range(2))
            angle = torch.randn(1, n, f0.head_dim, device=dev, dtype=dtype)
            rope = lean_rope(angle.cos(), angle.sin())
            slots = torch.arange(n, device=dev)[None] + ATTENTION_WIDTH // 2
            given = {"front": (x,), "gated": (x,), "o": (torch.randn(n, heads, device=dev, dtype=dtype), h),
                     "down": (torch.randn(n, inter, device=dev, dtype=dtype), h)}

            def inputs(unit: str) -> tuple:  # the same each time; a unit that writes the cache gets buffers of its own
                if unit == "front_rope":
                    return (x.view(1, n, hidden), rope, slots, *(torch.zeros(
                        1, f0.kv_heads, ATTENTION_WIDTH, f0.head_dim, device=dev, dtype=dtype) for _ in range(2)))
                return given[unit]

            choice[n] = {}
            for unit in offered:
                args, chosen = inputs(unit), choice[n]
                unfused, fused = forms[0][unit]
                reference = _flat(unfused(n, chosen, *inputs(unit)))
                usable = {"torch": None}
                for name in cuda_fused.distinct(n):
                    try:  # one that fails to build here, or computes something else, is left out
                        if torch.allclose(_flat(fused(name, *inputs(unit))), reference, rtol=0,
                                          atol=TOLERANCE * float(reference.abs().max())):
                            usable[name] = name
                    except Exception:  # noqa: BLE001
                        continue
                passes = {name: (lambda c=name: [u(n, chosen, *args) if c == "torch" else f(c, *args)
                                                 for u, f in (fs[unit] for fs in forms)]) for name in usable}
                times = _best_of(passes, self.device)
                choice[n][unit] = min(times, key=times.get)
        return choice

    def _product(self, weight: torch.Tensor, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> x·Wᵀ with the candidate this table chose for the weight's shape at `rows` rows."""
        name = per_count(self.choice.get(_shape_key(weight), {}), max(self.rows), "linear")[rows]
        return (lambda x: F.linear(x, weight)) if name == "linear" else (lambda x: small_m_linear(x, weight, name))

    def fused_plan(self, layer) -> list[cuda_fused.Fused | None]:
        """Per row count 0..max(rows): the layer's units measured faster fused (None: every unit unfused)."""
        chosen = self.fused.get(_block(layer), {})
        whole = cuda_fused.Fused(layer)  # (the units it offers found once, not per row count)
        plans = {n: whole.at({u: c for u, c in units.items() if c != "torch"}) for n, units in chosen.items()}
        names = per_count({n: str(n) for n, p in plans.items() if p.configs}, max(self.rows), "")
        return [plans[int(name)] if name else None for name in names]

    def plan(self, weight: torch.Tensor) -> list[str | None]:
        """Candidate per row count 0..max(rows) for this weight (the smallest measured row count ≥ rows); None where
        F.linear was fastest (so its forward pays no extra call)."""
        names = per_count(self.choice.get(_shape_key(weight), {}), max(self.rows), "linear")
        return [None if name == "linear" else name for name in names]

    def attention_plan(self, layer) -> list[Callable | None]:
        """Attention form per query count 0..max(rows) for a lean layer; None where SDPA was fastest. A Triton form
        runs only where cuda_layer.launchable (inside graph recordings); launched from Python, the faster PyTorch
        form at that count."""
        known, geometry, most = self.attention_forms(), _geometry(layer), max(self.rows)

        def gated(fn: Callable, eager: Callable) -> Callable:
            return lambda q, k, v, mask, scale: (fn if cuda_layer.launchable(q) else eager)(q, k, v, mask, scale)

        forms = per_count(self.attention.get(geometry, {}), most, "sdpa")
        eager = per_count(self.eager.get(geometry, {}), most, "sdpa")  # (launched op by op, e.g. a dynamic tree's)
        return [None if form == "sdpa" else known[form] if form in ATTENTIONS else gated(known[form], known[fallback])
                for form, fallback in zip(forms, eager)]

    def rope_plan(self, layer) -> list[Callable | None]:
        """Per query count 0..max(rows): cuda_layer.fused_rope_write where it was measured faster, else None."""
        forms = per_count(self.rope.get(_geometry(layer), {}), max(self.rows), "torch")
        return [None if form == "torch" else cuda_layer.fused_rope_write for form in forms]


def _best_of(passes: dict[str, Callable[[], object]], device: torch.device, rounds: int = 3) -> dict[str, float]:
    """Seconds of one call of each pass, best of `rounds` interleaved rounds (drift hits every candidate alike). On a
    GPU each pass is recorded as a CUDA graph (after a warm-up that builds its kernels) and replayed REPLAYS times
    between two events: what a decode's recorded forward pays, with no launch cost; elsewhere (tests, Triton
    interpreted: nothing to build, no time worth comparing) each pass runs once, timed as it runs."""
    if device.type != "cuda":
        rounds = 1
    runs = {}
    for name, run in passes.items():
        if device.type == "cuda":
            run()  # builds (Triton compiles on first use), outside any recording
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                run()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()  # its own memory pool, freed with it
            with torch.cuda.graph(graph):
                run()
            runs[name] = graph.replay
        else:
            runs[name] = run
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, replay in runs.items():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(REPLAYS):
                    replay()
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3 / REPLAYS
            else:
                t0 = time.perf_counter()
                replay()
                seconds = time.perf_counter() - t0
            best[name] = min(best[name], seconds)
    return best


def _unit_forms(layer, product: Callable, rope_at: list[str]) -> dict[str, tuple[Callable, Callable]]:
    """unit -> (unfused(rows, chosen, *inputs), fused(config, *inputs)) of the cuda_fused units a lean layer offers,
    the unfused form as the lean forward computes it (`product(weight, rows)`: the product chosen for that shape;
    front_rope: the front unit as `chosen` {unit: config} says, then the rotary + K/V write as rope_at[rows] says)."""
    norm1, norm2, o_proj, down_proj, act = layer._parts
    inter, fused = layer.intermediate, cuda_fused.Fused(layer)

    def front(n: int, chosen: dict, x: torch.Tensor) -> torch.Tensor:
        config = chosen.get("front", "torch")
        return product(layer.qkv.weight, n)(norm1(x)) if config == "torch" else fused.unit("front", config, x)

    def front_rope(n: int, chosen: dict, x: torch.Tensor, rope: tuple, slots: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        qkv = front(n, chosen, x.view(-1, x.shape[-1])).view(*x.shape[:2], -1)
        write = cuda_layer.rope_write if rope_at[n] == "triton" else cuda_layer.rope_write_torch
        return write(qkv, *rope, slots, keys, values, layer.heads), keys, values

    unfused = {"front": lambda n, chosen, x: front(n, {}, x), "front_rope": front_rope,
               "gated": lambda n, chosen, x: (lambda gu: act(gu[:, :inter]) * gu[:, inter:])(
                   product(layer.gate_up.weight, n)(norm2(x))),
               "o": lambda n, chosen, x, h: h + product(o_proj.weight, n)(x),
               "down": lambda n, chosen, x, h: h + product(down_proj.weight, n)(x)}
    kernels = {u: (lambda c, *inputs, u=u: fused.unit(u, c, *inputs)) for u in fused.offered}
    kernels["front_rope"] = lambda c, x, rope, slots, keys, values: (
        fused.rotated(c, x, rope, slots, keys, values), keys, values)
    return {u: (unfused[u], kernels[u]) for u in fused.offered}


def _flat(out: torch.Tensor | tuple) -> torch.Tensor:
    """A unit's output as one tensor (front_rope's q and the buffers it wrote, end to end) to compare."""
    return torch.cat([t.reshape(-1) for t in out]) if isinstance(out, tuple) else out


def _block(layer) -> str:
    """A lean layer's sizes: what its fused units are measured per."""
    return f"hidden {layer.qkv.weight.shape[1]}, mlp {layer.intermediate}, {_geometry(layer)}"


def _shape_key(w: torch.Tensor) -> str:
    return f"{w.shape[0]}x{w.shape[1]}:{str(w.dtype).removeprefix('torch.')}"


def _geometry(layer) -> str:
    dtype = str(layer.qkv.weight.dtype).removeprefix("torch.")
    return f"heads {layer.heads}, kv {layer.kv_heads}, d {layer.head_dim}:{dtype}"


_TABLES: dict[str, CudaTable] = {}
_ACTIVE: list[str] = []  # the tables in use (their keys), innermost last: part of a recorded graph's key


def active() -> str | None:
    """Which measured forms the current forwards run with (None: PyTorch's own), for CUDA graph keys: a graph records
    the kernels of the forms it was captured under, so another setting must record its own."""
    return _ACTIVE[-1] if _ACTIVE else None


def default_table(device: torch.device) -> CudaTable:
    """The process-wide table of this GPU (measured lazily, cached per GPU on disk)."""
    key = str(device)
    if key not in _TABLES:
        _TABLES[key] = CudaTable(device)
    return _TABLES[key]


@contextmanager
def measured(*modules: nn.Module, table: CudaTable | None = None, fused: bool = True) -> Iterator[CudaTable | None]:
    """Within the block, each float32 nn.Linear of `modules` that a decode multiplies with (the lean layers' fused
    ones, heads) runs the product measured fastest for its shape and row count, and each lean layer the attention form
    measured fastest for its query count and, with `fused`, its products fused with the ops around them where that
    measured faster (cuda_fused). Shapes and geometries not seen on this GPU are measured on entry
    (`table.measure_s`). Modules not on a GPU are left alone (unless a table is given: tests)."""
    linears = [m for mod in modules for m in decode_linears(mod)
               if type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.dim() == 2
               and (m.weight.device.type == "cuda" or table is not None)]
    if not linears:
        yield None
        return
    table = table or default_table(linears[0].weight.device)
    layers = [f for mod in modules for f in lean_layers(mod) if f.qkv.weight.dtype == torch.float32]
    table.prepare([m.weight for m in linears], layers)
    patched, seen = [], set()
    for lin in linears:
        plan = table.plan(lin.weight)
        if id(lin) in seen or not any(plan) or "forward" in lin.__dict__:  # nested use keeps the outer plan
            continue
        seen.add(id(lin))
        lin.forward = _forward(lin, plan)
        patched.append(lin)
    attended = []
    for f in layers:
        if f not in _UNITS:  # (nested use keeps the outer forms)
            _UNITS[f] = Units(table.attention_plan(f), table.rope_plan(f), table.fused_plan(f) if fused else [])
            attended.append(f)
    _ACTIVE.append(f"{table.key} {table.signature}{'' if fused else ' unfused'}")
    try:
        yield table
    finally:
        _ACTIVE.pop()
        for lin in patched:
            del lin.forward
        for f in attended:
            _UNITS.pop(f, None)


# The CUDA engine's own table of each lean layer's measured forms (nothing of it is kept on the layers): lean layer ->
# its attention, rotary-write and fused units by row count, for the duration of a `measured` block
_UNITS: weakref.WeakKeyDictionary[LeanLayer, Units] = weakref.WeakKeyDictionary()


def units(fast: LeanLayer) -> Units:
    """The forms `measured` chose for the layer (none outside a `measured` block: the PyTorch ops)."""
    return _UNITS.get(fast, NO_UNITS)


def _forward(lin: nn.Linear, plan: list[str | None]) -> Callable[[torch.Tensor], torch.Tensor]:
    """lin's forward through the small-M kernel its plan names for each row count: only inside a graph recording, where
    it was timed (launched from Python a Triton kernel loses to cuBLAS: module docstring), and in float32; on the CPU,
    Triton's interpreter in tests."""
    weight = lin.weight

    def run(name: str, x: torch.Tensor) -> torch.Tensor | None:
        if x.dtype != torch.float32 or not cuda_layer.launchable(x):
            return None
        return small_m_linear(x, weight, name)

    return measure.patched_forward(lin, plan, run)
