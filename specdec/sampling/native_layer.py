"""A lean decoder layer as one native call (layer.c), for a batch of one row on the CPU, where measurement picks it.

The lean layer (lean.py) still dispatches ~15 PyTorch ops per layer and token; on a 2-core CPU that framework overhead
is ~40 % of a 135M model's AR step. `NativeLayer` runs the same layer (the same fused weights, in smallm.c's packed
layout, the same slot cache, mask and rotary table) in one ctypes call. It is attached to a LeanLayer by
`measured_kernels` only where, on this machine, a whole stack of them is faster than the lean layers with their
measured kernels (`attach`: timed per row count by `measure`, stored with the kernel table); anything it does not
take (a batch of several rows, autograd, another dtype or device, more rows than measured) runs the lean layer as
before. Before use, each native layer is checked against its lean layer on random tokens (`agrees`), like the lean
layer against the HF one."""

from __future__ import annotations

import ctypes
import hashlib
import time
from typing import TYPE_CHECKING, Collection, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdec.sampling import native
from specdec.sampling.cache import SlotCache
from specdec.sampling.lean import LeanLayer, lean_layers, lean_rope

if TYPE_CHECKING:
    from specdec.sampling.kernels import KernelTable

ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)  # row counts measured; more rows run the lean layer
BF16_TOLERANCE = 2e-2  # a layer with bfloat16 weights against the exact lean one (kernels.TOLERANCE["bf16"])
PROMPT = 128  # the cached window the measurement attends over (a short prompt, as make bench's)


class _Layer(ctypes.Structure):
    """layer.c's layer_t."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("norm1", "norm2", "qkv", "o", "gate_up", "down", "keys",
                                                        "values")] + \
               [(name, ctypes.c_int) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                                   "max_len")] + \
               [("eps", ctypes.c_float), ("scaling", ctypes.c_float), ("bf16", ctypes.c_int)]


_SCRATCH = torch.empty(0)  # layer.c's working memory, shared by every native layer (they run one after another)


def _scratch(floats: int) -> torch.Tensor:
    global _SCRATCH
    if _SCRATCH.numel() < floats:
        _SCRATCH = torch.empty(floats)
    return _SCRATCH


class NativeLayer:
    """One LeanLayer's forward through layer.c (see the module docstring); `operand(weight)` -> its packed copy, in
    bfloat16 where `bf16` (a drafter's layer whose products may be rounded: draft_precision=bf16)."""

    def __init__(self, fast: LeanLayer, operand, bf16: bool = False):
        self.fast, self.bf16 = fast, bf16
        norm1, norm2, o_proj, down_proj, act = fast._parts
        self.lib = native._library()
        self.weights = (fast.qkv.weight, o_proj.weight, fast.gate_up.weight, down_proj.weight)
        self.packed = [operand(w) for w in self.weights]  # kept alive: layer.c reads them by address
        self.packed_from = [(w.data_ptr(), w._version) for w in self.weights]  # see `current`
        s = self.struct = _Layer()
        s.hidden, s.heads, s.kv_heads = fast.qkv.weight.shape[1], fast.heads, fast.kv_heads
        s.head_dim, s.intermediate, s.scaling = fast.head_dim, fast.intermediate, fast.scaling
        s.qkv, s.o, s.gate_up, s.down = (p.blocks.data_ptr() for p in self.packed)
        (s.norm1, s.norm2), s.eps = (m.weight.data_ptr() for m in fast.norms), fast.norms[0].variance_epsilon
        s.bf16 = int(bf16)

    @property
    def current(self) -> bool:
        """Whether the packed copies are still of the layer's weights (not replaced, not changed in place)."""
        return self.packed_from == [(w.data_ptr(), w._version) for w in self.weights]

    @staticmethod
    def supports(fast: LeanLayer) -> bool:
        """Whether layer.c computes this lean layer: float32 on the CPU, no biases, SiLU, RMSNorms of F.rms_norm's
        formula. (Its output is then compared with the lean layer's: `agrees`.)"""
        norm1, norm2, o_proj, down_proj, act = fast._parts
        weights = (fast.qkv.weight, o_proj.weight, fast.gate_up.weight, down_proj.weight)
        norms = [getattr(m, "weight", None) for m in fast.norms]  # read by address: [H] float32, contiguous
        return (native.available() and hasattr(native._library(), "smallm_layer")
                and all(w.dtype == torch.float32 and w.device.type == "cpu" for w in weights)
                and all(isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.device.type == "cpu"
                        and w.is_contiguous() and w.shape == (weights[0].shape[1],) for w in norms)
                and all(l.bias is None for l in (fast.qkv, o_proj, fast.gate_up, down_proj))
                and _is_silu(act) and fast.head_dim % 16 == 0 and fast.head_dim <= 128
                # both norms lean as F.rms_norm (lean._fused_norm kept the module itself where that formula differs)
                and all(f is not m for f, m in zip((norm1, norm2), fast.norms)))

    def bind(self, cache: SlotCache, like: torch.Tensor) -> bool:
        """Point the struct at this layer's key and value stores in `cache` (made if new; like: the hidden state
        [1, n, H]); False where layer.c cannot write them."""
        keys, values = cache.buffers(self.fast.layer_idx, like, self.fast.kv_heads, self.fast.head_dim)
        if not (keys.dtype == torch.float32 and keys.is_contiguous() and values.is_contiguous()):
            return False
        s = self.struct
        s.keys, s.values, s.max_len = keys.data_ptr(), values.data_ptr(), keys.shape[2]
        return True

    def __call__(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                 cache: SlotCache) -> torch.Tensor | None:
        """The layer over hidden [1, n, H] as LeanLayer.forward takes it, or None where layer.c does not take the
        call (the caller then runs the lean layer)."""
        if not self.bind(cache, hidden):
            return None
        out = hidden.contiguous().clone()  # written in place (the input may be kept: feature layers)
        call = _Call(out, rope, mask, cache, [self])
        done = self.lib.smallm_layer(ctypes.byref(self.struct), out.data_ptr(), *call.args)
        return out if done == 0 else None


class _Call:
    """What every layer of one forward shares: the rows' rotary tables, slots, window, mask, scratch, threads, as
    layer.c's arguments after h and n (`args`)."""

    def __init__(self, out: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                 cache: SlotCache, layers: list[NativeLayer]):
        n, width = out.shape[1], cache.width
        # kept as attributes: layer.c reads them by address during the call
        self.slots = cache.write_slots.reshape(n).contiguous()  # [n] int64
        self.cos, self.sin = (t.reshape(n, -1).contiguous() for t in rope)  # [n, d] each
        self.mask = None if mask is None else mask.reshape(n, width).contiguous()  # [n, W] additive
        threads = torch.get_num_threads()
        shapes = {(l.struct.hidden, l.struct.heads, l.struct.kv_heads, l.struct.head_dim, l.struct.intermediate): l
                  for l in layers}  # one of each shape (a model's layers are all alike)
        scratch = _scratch(max(l.lib.smallm_layer_scratch(ctypes.byref(l.struct), n, width, threads)
                               for l in shapes.values()))
        self.args = (n, self.cos.data_ptr(), self.sin.data_ptr(), self.slots.data_ptr(), width,
                     None if self.mask is None else self.mask.data_ptr(), scratch.data_ptr(), threads)


def run_stack(fasts: Sequence[LeanLayer], hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              mask: torch.Tensor | None, cache: SlotCache,
              keep: Collection[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
    """The lean layers `fasts` over hidden [1, n, H] in ONE native call, as SamplingContext._run runs them one by one
    (-> the output [1, n, H] and {i: the input of layer i} for i in keep), where every one of them has its native
    form attached for n rows; None otherwise, or where layer.c does not take the call (nothing is changed then). One
    call rather than one per layer: each pays its Python argument handling, 30 times a step for SmolLM2."""
    b, n, _ = hidden.shape
    if b != 1 or hidden.dtype != torch.float32:
        return None
    for f in fasts:
        if f.native is None or n >= len(f.native_rows) or not f.native_rows[n]:
            return None
    return _run_stack([f.native for f in fasts], hidden, rope, mask, cache, keep)


_STACKS: dict[tuple[int, ...], tuple[list[NativeLayer], ctypes.Array]] = {}  # a few recent stacks' pointer arrays


def _run_stack(layers: list[NativeLayer], hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               mask: torch.Tensor | None, cache: SlotCache,
               keep: Collection[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
    ids = tuple(map(id, layers))
    if ids not in _STACKS:
        if len(_STACKS) >= 4:
            _STACKS.pop(next(iter(_STACKS)))
        _STACKS[ids] = (layers, (ctypes.c_void_p * len(layers))(*(ctypes.addressof(l.struct) for l in layers)))
    array = _STACKS[ids][1]
    if not all(l.bind(cache, hidden) for l in layers):
        return None
    out = hidden.contiguous().clone()  # written in place (the input may be kept)
    inputs = {i: torch.empty_like(out) for i in keep if i < len(layers)}
    kept = (ctypes.c_void_p * len(layers))(*(inputs[i].data_ptr() if i in inputs else None
                                             for i in range(len(layers)))) if inputs else None
    call = _Call(out, rope, mask, cache, layers)
    done = layers[0].lib.smallm_layers(array, len(layers), out.data_ptr(), *call.args, kept)
    return (out, inputs) if done == 0 else None


def _is_silu(act) -> bool:
    probe = torch.linspace(-20, 20, 101)
    try:
        return torch.equal(act(probe), F.silu(probe))
    except Exception:  # noqa: BLE001 — an activation that cannot run on a float32 CPU vector is not SiLU
        return False


def build(fast: LeanLayer, operand, bf16: bool = False) -> NativeLayer | None:
    """The native form of a lean layer, checked against it (`agrees`), or None where layer.c cannot take it."""
    if not NativeLayer.supports(fast):
        return None
    layer = NativeLayer(fast, operand, bf16)
    return layer if agrees(layer) else None


@torch.no_grad()
def agrees(layer: NativeLayer, n: int = 3) -> bool:
    """Whether the native layer gives the lean layer's output on n random tokens after a few cached ones (causal
    mask) and on one token that sees the whole window (no mask): what it adds to its input, to float32 rounding, or
    for a bfloat16 one to the kernel table's bf16 tolerance. The lean layer multiplies with PyTorch's own exact
    products for it: inside `measured_kernels` a drafter's may be patched to round its weights to bfloat16."""
    fast = layer.fast
    _, _, o_proj, down_proj, _ = fast._parts
    patched = {l: l.__dict__.pop("forward") for l in (fast.qkv, o_proj, fast.gate_up, down_proj)
               if "forward" in l.__dict__}
    try:
        return _agrees(layer, n)
    finally:
        for l, forward in patched.items():
            l.forward = forward


def _agrees(layer: NativeLayer, n: int) -> bool:
    fast = layer.fast
    w = fast.qkv.weight
    g = torch.Generator().manual_seed(0)
    past = 5
    for rows, masked in ((n, True), (1, False)):
        hidden = torch.randn(1, rows, w.shape[1], generator=g)
        angle = torch.randn(1, rows, fast.head_dim // 2, generator=g).repeat(1, 1, 2)
        rope = lean_rope(angle.cos(), angle.sin())
        width = past + rows
        mask = None
        if masked:
            allowed = torch.ones(rows, width, dtype=torch.bool).tril(past)
            mask = torch.zeros(1, 1, rows, width).masked_fill_(~allowed, torch.finfo(torch.float32).min)
        history = torch.randn(1, fast.kv_heads, past, fast.head_dim, generator=g)
        outs = []
        for run in (fast.lean_forward, layer):
            cache = SlotCache(width)
            cache.write_slots, cache.write_start, cache.width = torch.arange(past)[None], 0, past
            cache.update(history, -history, fast.layer_idx)  # the same earlier keys and values for both
            cache.write_slots, cache.write_start, cache.width = torch.arange(past, width)[None], past, width
            outs.append(run(hidden, rope, mask, cache))
        ref, got = outs
        if got is None or not bool(torch.isfinite(got).all()):
            return False
        # compared on what the layer adds to its input: the residual would hide an error in it
        tolerance = BF16_TOLERANCE if layer.bf16 else 1e-4
        if float((got - ref).abs().max()) > tolerance * float((ref - hidden).abs().max()):
            return False
    return True


@torch.no_grad()
def measure(natives: list[NativeLayer], reps: int = 3, counts: tuple[int, ...] = ROWS) -> dict[int, dict[str, float]]:
    """{rows: {"lean": s, "native": s}} for each row count of ROWS: seconds of a pass through all of the layers (a
    model's stack, in order) over `rows` new tokens after PROMPT cached ones, each way (the native layers in one
    call, the lean ones with whatever kernels are patched in at the time), interleaved, best of `reps`."""
    w = natives[0].fast.qkv.weight
    g = torch.Generator().manual_seed(0)
    found = {}
    for rows in counts:
        width = PROMPT + rows
        hidden = torch.randn(1, rows, w.shape[1], generator=g) * 0.1
        angle = torch.randn(1, rows, natives[0].fast.head_dim // 2, generator=g).repeat(1, 1, 2)
        rope = lean_rope(angle.cos(), angle.sin())
        allowed = torch.ones(rows, width, dtype=torch.bool).tril(PROMPT)
        mask = None if rows == 1 else torch.zeros(1, 1, rows, width).masked_fill_(
            ~allowed, torch.finfo(torch.float32).min)
        cache = SlotCache(width)
        cache.write_slots, cache.write_start, cache.width = torch.arange(PROMPT, width)[None], PROMPT, width
        best = {"lean": float("inf"), "native": float("inf")}
        for rep in range(reps + 1):  # the first pass of each is a warm-up, not kept
            for way in best:
                t = time.perf_counter()
                x = hidden
                if way == "native":  # in one call, as the sampler runs them (run_stack)
                    done = _run_stack(natives, x, rope, mask, cache)
                    if done is None:  # layer.c refuses the stack: never the faster way
                        continue
                for layer in natives if way == "lean" else ():
                    x = layer.fast.lean_forward(x, rope, mask, cache)
                if rep:
                    best[way] = min(best[way], time.perf_counter() - t)
        found[rows] = best
    return found


RECHECK_FACTOR = 1.5  # as kernels.py's: a stored choice that now loses by this factor at one row is measured again
_CHECKED: set[str] = set()  # stacks whose stored timings this process has re-checked


def attach(module: nn.Module, table: KernelTable, bf16: bool = False,
           exact: Collection[LeanLayer] = ()) -> list[LeanLayer]:
    """Give `module`'s lean layers their native form at the row counts where a pass through the stack of them
    measured faster native (measured once per machine and stack, stored in `table`, and re-checked once per process
    at one row). bf16: with bfloat16 copies of the weights (a drafter's, as its products may be), except for layers
    in `exact` (the base's, which a drafter may run too). Returns the layers it attached to (for `detach`); a layer
    already attached (nested use) is left."""
    natives = [n for n in stack(module, table, bf16, exact) if n.fast.native is None]
    if not natives:
        return []
    # the stack's shapes and precisions, the row counts and layer.c itself: a change to any is measured anew
    shapes = " ".join(f"{tuple(w.shape)}{'bf16' if n.bf16 else ''}" for n in natives for w in n.weights)
    key = hashlib.sha1((shapes + str(ROWS) + native.LAYER_SOURCE.read_text()).encode()).hexdigest()[:16]
    t0 = time.perf_counter()
    times = table.layers.get(key)
    if times is not None and key not in _CHECKED:  # once per process: does the stored choice still hold at 1 row?
        _CHECKED.add(key)
        fresh = measure(natives, reps=1, counts=(1,))[1]
        stored = min(times[1], key=times[1].get)
        if fresh[stored] > RECHECK_FACTOR * min(fresh.values()):
            times = None
    if times is None:
        times = table.layers[key] = measure(natives)
        table.save()
    _CHECKED.add(key)
    table.measure_s += time.perf_counter() - t0

    def faster(n: int) -> bool:  # n rows: the next measured count up decides
        t = times[min(r for r in ROWS if r >= n)]
        return t["native"] < t["lean"]

    rows = [False] + [faster(n) for n in range(1, max(ROWS) + 1)]
    if not any(rows):
        return []
    for layer in natives:
        layer.fast.native, layer.fast.native_rows = layer, rows
    return [layer.fast for layer in natives]


def detach(fasts: list[LeanLayer]) -> None:
    for fast in fasts:
        fast.native, fast.native_rows = None, []


def stack(module: nn.Module, table: KernelTable, bf16: bool = False,
          exact: Collection[LeanLayer] = ()) -> list[NativeLayer]:
    """The native forms of `module`'s lean layers that have one, in order, over packed copies of their weights (the
    table's, shared with the products' kernel where that is the packed one; bfloat16 ones where bf16, except for
    layers in `exact`): built and checked once, and again if a weight changed."""
    out = []
    for fast in lean_layers(module):
        rounded = bf16 and fast not in exact
        have = fast.native_built.get(rounded, False)
        if have is False or (have is not None and not have.current):
            have = fast.native_built[rounded] = build(fast, _operand(table, rounded), rounded)
        if have is not None:
            out.append(have)
    return out


def _operand(table: KernelTable, bf16: bool):
    """weight -> its packed copy (bfloat16 where bf16): the table's, where it offers the packed kernel."""
    name = "native_packed_bf16" if bf16 else "native_packed"
    if name in table.candidates or name in table.bf16:
        return lambda w: table.operand(name, w)
    return (lambda w: native.pack(w.to(torch.bfloat16))) if bf16 else native.pack
