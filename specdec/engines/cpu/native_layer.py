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
import weakref
from typing import Collection, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdec.engines.cpu import compact, native
from specdec.engines.cpu.compact import Compact
from specdec.engines.eager.lean import LeanLayer, lean_layers, rms_form
from specdec.sampling.cache import SlotCache
from specdec.sampling.rotary import lean_rope

# draft_precision -> the kernel table's candidates it offers a drafter's weights (kernels.py), and so the native
# layer forms ("q8", "q4", "q4a8") a drafter's layers may be held in
QUANT_LEVELS = {"q8": ("native_q8",), "q4": ("native_q8", "native_q4"),
                "q4a8": ("native_q8", "native_q4", "native_q4a8")}
# row counts measured; more rows run the lean layer. Past 16 they are a prompt's prefill (a HumanEval chat prompt is
# ~120-200 tokens), which also runs through the native layers where they measure faster
ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 32, 64, 128, 192, 256)
PROMPT = 128  # the cached window the measurement attends over (a short prompt, as make bench's)
# The compact kernels' prefetch distances tried per block height (smallm.c; the first is its compiled default), over a
# pass through a base's stack of compact native layers: another is taken only if it wins by PREFETCH_MARGIN
# (tune_prefetch). Timed through the stack in one call, as a decode runs it (the layers' attention and norms between
# the products give the prefetches time to run ahead), not product by product from Python.
PREFETCH_BYTES = (4096, 8192, 16384)
PREFETCH_MARGIN, PREFETCH_PASSES = 1.02, 5
STREAM_BYTES = 32 << 20  # a stack whose compact weights hold fewer fits a large last-level cache: nothing to tune


class _Layer(ctypes.Structure):
    """layer.c's layer_t."""

    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("weights", ctypes.c_void_p * 4),
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p)] + \
               [(name, ctypes.c_int) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                                   "max_len")] + \
               [("eps", ctypes.c_float), ("scaling", ctypes.c_float), ("formats", ctypes.c_int * 4)]


# layer.c's code for how a product's copy holds its weight (`_held_as`)
FORMATS = {"float32": 0, "bfloat16": 1, "bf16": 1, "q4": 2, "q8": 3, "q4a8": 4}


def _held_as(copy) -> str:
    """A compact.Compact's kind, or a native.Packed's dtype (float32, bfloat16)."""
    return copy.kind if isinstance(copy, Compact) else str(copy.blocks.dtype).removeprefix("torch.")


_SCRATCH = torch.empty(0)  # layer.c's working memory, shared by every native layer (they run one after another)


def _scratch(floats: int) -> torch.Tensor:
    global _SCRATCH
    if _SCRATCH.numel() < floats:
        _SCRATCH = torch.empty(floats)
    return _SCRATCH


class NativeLayer:
    """One LeanLayer's forward through layer.c (see the module docstring); `operand(weight)` -> the copy of it layer.c
    reads (native.Packed or compact.Compact), as `form` makes them: exact = float32, bf16 = rounded to bfloat16 (a
    drafter's, draft_precision=bf16), q8 / q4 = rounded to Q8_0 / Q4_1 blocks where its rows are whole groups of 32,
    else to bfloat16 (a drafter's, draft_precision=q8 or q4), q4a8 = as q4 with float16 scales, multiplied by its inputs
    rounded to int8 (draft_precision=q4a8), compact = each weight's exact compact form where it has
    one, else float32."""

    def __init__(self, fast: LeanLayer, operand, form: str = "exact"):
        self.fast, self.form = fast, form
        # its products multiply with rounded weights (checked against the lean layer on those very numbers: `held`)
        self.rounded = form in ("bf16", "q8", "q4", "q4a8")
        # ... and its inputs too (q4a8): checked against the lean layer to that rounding (`agrees`)
        self.rounds_inputs = form == "q4a8"
        norm1, norm2, o_proj, down_proj, act = fast._parts
        self.lib = native._library()
        self.weights = (fast.qkv.weight, o_proj.weight, fast.gate_up.weight, down_proj.weight)
        self.packed = [operand(w) for w in self.weights]  # kept alive: layer.c reads them by address
        self.packed_from = [(w.data_ptr(), w._version) for w in self.weights]  # see `current`
        self._bound: tuple[weakref.ref, int] | None = None  # (the cache, its version) the struct points into
        s = self.struct = _Layer()
        s.hidden, s.heads, s.kv_heads = fast.qkv.weight.shape[1], fast.heads, fast.kv_heads
        s.head_dim, s.intermediate, s.scaling = fast.head_dim, fast.intermediate, fast.scaling
        s.weights[:] = [p.blocks.data_ptr() for p in self.packed]
        s.formats[:] = [FORMATS[_held_as(p)] for p in self.packed]
        (s.norm1, s.norm2), s.eps = (m.weight.data_ptr() for m in fast.norms), fast.norms[0].variance_epsilon

    def held(self) -> list[torch.Tensor]:
        """The float32 weights layer.c multiplies with, one per product: the layer's own, or for a rounded form the
        numbers its copies round them to."""
        if not self.rounded:
            return list(self.weights)  # float32 copies, or exact compact forms: the same numbers
        return [w.to(torch.bfloat16).float() if _held_as(p) == "bfloat16" else compact.rounded(w, p.kind)
                for w, p in zip(self.weights, self.packed)]

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
        return (native.available()
                and all(w.dtype == torch.float32 and w.device.type == "cpu" for w in weights)
                and all(isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.device.type == "cpu"
                        and w.is_contiguous() and w.shape == (weights[0].shape[1],) for w in norms)
                and all(l.bias is None for l in (fast.qkv, o_proj, fast.gate_up, down_proj))
                and _is_silu(act) and fast.head_dim % 16 == 0 and fast.head_dim <= 128
                # both norms lean as F.rms_norm (lean._fused_norm kept the module itself where that formula differs)
                and all(f is not m for f, m in zip((norm1, norm2), fast.norms)))

    def bind(self, cache: SlotCache, like: torch.Tensor) -> bool:
        """Point the struct at this layer's key and value stores in `cache` (made if new; like: the hidden state
        [1, n, H]); False where layer.c cannot write them. Done again only when the cache or its buffers changed
        (SlotCache.version): a forward binds every layer, ~3 µs each in Python."""
        seen = self._bound
        if seen is not None and seen[0]() is cache and seen[1] == cache.version:
            return True
        keys, values = cache.buffers(self.fast.layer_idx, like, self.fast.kv_heads, self.fast.head_dim)
        if not (keys.dtype == torch.float32 and keys.is_contiguous() and values.is_contiguous()):
            return False
        s = self.struct
        s.keys, s.values, s.max_len = keys.data_ptr(), values.data_ptr(), keys.shape[2]
        self._bound = (weakref.ref(cache), cache.version)
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
                 cache: SlotCache, shapes: list[NativeLayer]):
        """shapes: one layer of each shape in the forward (`_shapes`), which size the scratch."""
        n, width = out.shape[1], cache.width
        # kept as attributes: layer.c reads them by address during the call
        self.slots = cache.write_slots.reshape(n).contiguous()  # [n] int64
        self.cos, self.sin = (t.reshape(n, -1).contiguous() for t in rope)  # [n, d] each
        self.mask = None if mask is None else mask.reshape(n, width).contiguous()  # [n, W] additive
        threads = torch.get_num_threads()
        scratch = _scratch(max(l.lib.smallm_layer_scratch(ctypes.byref(l.struct), n, width, threads) for l in shapes))
        self.args = (n, self.cos.data_ptr(), self.sin.data_ptr(), self.slots.data_ptr(), width,
                     None if self.mask is None else self.mask.data_ptr(), scratch.data_ptr(), threads)


def run_stack(fasts: Sequence[LeanLayer], hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              mask: torch.Tensor | None, cache: SlotCache, keep: Collection[int] = (),
              norm: nn.Module | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
    """The lean layers `fasts` over hidden [1, n, H] in ONE native call, as SamplingContext._run runs them one by one
    (-> the output [1, n, H] and {i: the input of layer i} for i in keep), where every one of them has its native
    form attached for n rows; None otherwise, or where layer.c does not take the call (nothing is changed then). One
    call rather than one per layer: each pays its Python argument handling, 30 times a step for SmolLM2. norm: a final
    RMSNorm the output then goes through (in the same call where it is F.rms_norm's formula, else as a module)."""
    b, n, _ = hidden.shape
    if b != 1 or hidden.dtype != torch.float32:
        return None
    natives = [for_rows(f, n) for f in fasts]
    if any(layer is None for layer in natives):
        return None
    rms = rms_form(norm) if norm is not None else None
    done = _run_stack(natives, hidden, rope, mask, cache, keep, rms)
    if done is None or norm is None or rms is not None:
        return done
    return norm(done[0]), done[1]


# a few recent stacks: (their layers, the pointer array layer.c walks, one layer of each shape among them)
_STACKS: dict[tuple[int, ...], tuple[list[NativeLayer], ctypes.Array, list[NativeLayer]]] = {}


def _shapes(layers: list[NativeLayer]) -> list[NativeLayer]:
    """One layer of each shape among `layers` (a model's layers are all alike)."""
    return list({(l.struct.hidden, l.struct.heads, l.struct.kv_heads, l.struct.head_dim, l.struct.intermediate): l
                 for l in layers}.values())


def pointers(layers: list[NativeLayer]) -> tuple[ctypes.Array, list[NativeLayer]]:
    """The pointer array layer.c walks for `layers` and one layer of each shape among them, kept for a few recent
    stacks (a caller that holds the array longer keeps its own reference)."""
    ids = tuple(map(id, layers))
    if ids not in _STACKS:
        if len(_STACKS) >= 4:
            _STACKS.pop(next(iter(_STACKS)))
        _STACKS[ids] = (layers, (ctypes.c_void_p * len(layers))(*(ctypes.addressof(l.struct) for l in layers)),
                        _shapes(layers))
    return _STACKS[ids][1:]


def _run_stack(layers: list[NativeLayer], hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               mask: torch.Tensor | None, cache: SlotCache, keep: Collection[int] = (),
               norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
    array, shapes = pointers(layers)
    if not all(l.bind(cache, hidden) for l in layers):
        return None
    out = hidden.contiguous().clone()  # written in place (the input may be kept)
    inputs = {i: torch.empty_like(out) for i in keep if i < len(layers)}
    kept = (ctypes.c_void_p * len(layers))(*(inputs[i].data_ptr() if i in inputs else None
                                             for i in range(len(layers)))) if inputs else None
    call = _Call(out, rope, mask, cache, shapes)
    lib = layers[0].lib
    if norm is None:
        done = lib.smallm_layers(array, len(layers), out.data_ptr(), *call.args, kept)
    else:  # the final norm's weight [H] float32, read by address during the call
        done = lib.smallm_layers_normed(array, len(layers), out.data_ptr(), *call.args, kept, norm[0].data_ptr(),
                                        norm[1])
    return (out, inputs) if done == 0 else None


def _is_silu(act) -> bool:
    probe = torch.linspace(-20, 20, 101)
    try:
        return torch.equal(act(probe), F.silu(probe))
    except Exception:  # noqa: BLE001 — an activation that cannot run on a float32 CPU vector is not SiLU
        return False


def build(fast: LeanLayer, operand, form: str = "exact") -> NativeLayer | None:
    """The native form of a lean layer, checked against it (`agrees`), or None where layer.c cannot take it."""
    if not NativeLayer.supports(fast):
        return None
    layer = NativeLayer(fast, operand, form)
    return layer if agrees(layer) else None


@torch.no_grad()
def agrees(layer: NativeLayer, n: int = 3) -> bool:
    """Whether the native layer gives the lean layer's output on n random tokens after a few cached ones (causal
    mask) and on one token that sees the whole window (no mask): what it adds to its input, to float32 rounding. The
    lean layer multiplies with PyTorch's own products for it, of the numbers the native one holds (`held`: a rounded
    form's rounded weights), whatever `measured_kernels` patched in."""
    fast = layer.fast
    _, _, o_proj, down_proj, _ = fast._parts
    linears = (fast.qkv, o_proj, fast.gate_up, down_proj)
    patched = {l: l.__dict__.pop("forward") for l in linears if "forward" in l.__dict__}
    if layer.rounded:
        for l, w in zip(linears, layer.held()):
            l.forward = lambda x, w=w: F.linear(x, w)
    try:
        return _agrees(layer, n)
    finally:
        for l in linears:
            l.__dict__.pop("forward", None)
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
        # compared on what the layer adds to its input: the residual would hide an error in it (a q4a8 layer's products
        # round their inputs too: compact.A8_TOLERANCE)
        tolerance = compact.A8_TOLERANCE if layer.rounds_inputs else 1e-4
        if float((got - ref).abs().max()) > tolerance * float((ref - hidden).abs().max()):
            return False
    return True


@torch.no_grad()
def measure(ways: dict[str, list[NativeLayer]], reps: int = 3,
            counts: tuple[int, ...] = ROWS) -> dict[int, dict[str, float]]:
    """{rows: {"lean": s, way: s, ...}} for each row count of ROWS: seconds of a pass through a stack of layers (a
    model's, in order) over `rows` new tokens after PROMPT cached ones, as each way's native layers (in one call) and
    as the lean layers of the first way's (with whatever kernels are patched in at the time), interleaved, best of
    `reps`."""
    first = next(iter(ways.values()))
    g = torch.Generator().manual_seed(0)
    found = {}
    for rows in counts:
        hidden, rope, mask, cache = _pass_inputs(first, rows, g)
        best = {way: float("inf") for way in ("lean", *ways)}
        for rep in range(reps + 1):  # the first pass of each is a warm-up, not kept
            for way in best:
                t = time.perf_counter()
                if way == "lean":
                    x = hidden
                    for layer in first:
                        x = layer.fast.lean_forward(x, rope, mask, cache)
                elif _run_stack(ways[way], hidden, rope, mask, cache) is None:  # in one call, as the sampler runs them
                    continue  # layer.c refuses the stack: never the faster way
                if rep:
                    best[way] = min(best[way], time.perf_counter() - t)
        found[rows] = best
    return found


def _pass_inputs(layers: list[NativeLayer], rows: int, g: torch.Generator):
    """A pass's inputs over `rows` new tokens after PROMPT cached ones: hidden [1, rows, H], rope, mask, cache."""
    width = PROMPT + rows
    hidden = torch.randn(1, rows, layers[0].fast.qkv.weight.shape[1], generator=g) * 0.1
    angle = torch.randn(1, rows, layers[0].fast.head_dim // 2, generator=g).repeat(1, 1, 2)
    allowed = torch.ones(rows, width, dtype=torch.bool).tril(PROMPT)
    mask = None if rows == 1 else torch.zeros(1, 1, rows, width).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    cache = SlotCache(width)
    cache.write_slots, cache.write_start, cache.width = torch.arange(PROMPT, width)[None], PROMPT, width
    return hidden, lean_rope(angle.cos(), angle.sin()), mask, cache


def _stack_time(layers: list[NativeLayer], *inputs) -> float | None:
    """Seconds of one pass through the stack in one call (None where layer.c refuses it)."""
    t = time.perf_counter()
    return None if _run_stack(layers, *inputs) is None else time.perf_counter() - t


def tune_prefetch(layers: list[NativeLayer]) -> dict[int, int]:
    """{block height: bytes}: per block height of the compact kernels (native.block_rows), the prefetch distance of
    PREFETCH_BYTES at which a pass through `layers` (a base's stack, in one call) over that many new tokens is fastest,
    interleaved, best of PREFETCH_PASSES; the compiled default unless another wins by PREFETCH_MARGIN. {} where the
    library cannot set it or the stack's compact weights would not stream from memory. Leaves the library as it was."""
    held = sum(p.nbytes for l in layers for p in l.packed if isinstance(p, Compact))
    heights = native.block_rows()
    if not heights or held < STREAM_BYTES:
        return {}
    g, found, n = torch.Generator().manual_seed(0), {}, len(PREFETCH_BYTES)
    for rows in range(1, heights + 1):
        hidden, rope, mask, cache = _pass_inputs(layers, rows, g)
        best = {ahead: float("inf") for ahead in PREFETCH_BYTES}
        with native.prefetch_kept():
            for p in range(PREFETCH_PASSES + 1):  # interleaved, each distance first in turn; the first, a warm-up
                for ahead in PREFETCH_BYTES[p % n:] + PREFETCH_BYTES[:p % n]:
                    native.set_prefetch(rows, ahead)
                    dt = _stack_time(layers, hidden, rope, mask, cache)
                    if dt is None:
                        return {}  # layer.c refuses the stack: nothing to tune
                    if p:
                        best[ahead] = min(best[ahead], dt)
        winner = min(best, key=best.get)
        found[rows] = winner if best[winner] * PREFETCH_MARGIN < best[PREFETCH_BYTES[0]] else PREFETCH_BYTES[0]
    return found


# cpu_kernels=native: a stack's way, the first of these it has (the fewest bytes a weight, as kernels.FORCED)
FORCED_LAYERS = ("compact", "q4a8", "q4", "q8", "native")
RECHECK_FACTOR = 1.5  # as kernels.py's: a stored choice that now loses by this factor at one row is measured again
_CHECKED: set[str] = set()  # stacks whose stored timings this process has re-checked


def attach(module: nn.Module, table, bf16: bool = False, exact: Collection[LeanLayer] = (),
           compact: bool = True, quant: str = "") -> list[LeanLayer]:
    """Give `module`'s lean layers, per row count, the native form that a pass through the stack of them measured
    fastest, where one beat the lean layers (measured once per machine and stack, stored in `table`, and re-checked
    once per process at one row). The ways measured: "native" (float32 weights; bfloat16 copies where bf16, a
    drafter's, except for layers in `exact`: the base's, which a drafter may run too), with bf16 and quant (q8, q4 or
    q4a8) also "q8" (those bfloat16 copies as Q8_0 blocks instead), under q4 "q4" too (as Q4_1 blocks), under q4a8
    "q4a8" as well (Q4_1 blocks times int8-rounded inputs), and, where compact
    and some weight has an exact compact form (compact.py), "compact" (those forms, the rest as "native"). Returns the
    layers it attached to (for `detach`); a layer already attached (nested use) is left."""
    fasts = [f for f in lean_layers(module) if not rows_of(f)]
    if not fasts:
        return []

    def forms(exact_form: str, rounded: str = "bf16") -> dict[LeanLayer, NativeLayer]:
        return stack(fasts, table, lambda f: rounded if bf16 and f not in exact else exact_form)


    ways = {"native": forms("exact")}
    for name in QUANT_LEVELS.get(quant, ()) if bf16 else ():  # "native_q8", "native_q4", ...: forms "q8", "q4", ...
        if name in table.quant:  # (q4a8's only where the table offers it: see KernelTable)
            ways[name.removeprefix("native_")] = forms("exact", name.removeprefix("native_"))
    if compact:
        held = forms("compact")
        if any(isinstance(p, Compact) for l in held.values() if l.form == "compact" for p in l.packed):
            ways["compact"] = held
    ways = {name: by for name, by in ways.items() if by}
    if not ways:
        return []
    # the stack's shapes and forms, the row counts and layer.c itself: a change to any is measured anew
    text = " ".join(f"{name}:" + ",".join(f"{tuple(p.blocks.shape)}{_held_as(p)}"
                                          for l in by.values() for p in l.packed) for name, by in ways.items())
    key = hashlib.sha1((text + str(ROWS) + native.LAYER_SOURCE.read_text()).encode()).hexdigest()[:16]
    stacks = {name: list(by.values()) for name, by in ways.items()}
    if table.forced:  # cpu_kernels=native: the first way of FORCED_LAYERS it has, at every row count, nothing timed
        way = next(w for w in FORCED_LAYERS if w in ways)
        return _attach(fasts, ways, [way] * max(ROWS))
    t0 = time.perf_counter()
    times = table.layers.get(key)
    if times is not None and key not in _CHECKED:  # once per process: does the stored choice still hold at 1 row?
        _CHECKED.add(key)
        fresh = measure(stacks, reps=1, counts=(1,))[1]
        stored = min(times[1], key=times[1].get)
        if stored not in fresh or fresh[stored] > RECHECK_FACTOR * min(fresh.values()):
            times = None
    if times is None:
        times = table.layers[key] = measure(stacks)
        table.save()
    _CHECKED.add(key)
    table.measure_s += time.perf_counter() - t0

    def fastest(n: int) -> str:  # n rows: the next measured count up decides
        t = times[min(r for r in ROWS if r >= n)]
        return min(t, key=t.get)

    if "compact" in stacks and "compact" in {fastest(n) for n in range(1, native.block_rows() + 1)}:
        # the base's compact products: how far ahead they ask for their weights, per block height (process-wide)
        if key not in table.prefetch:
            t0 = time.perf_counter()
            table.prefetch[key] = tune_prefetch(stacks["compact"])
            table.measure_s += time.perf_counter() - t0
            table.save()
        for rows, ahead in table.prefetch[key].items():
            native.set_prefetch(rows, ahead)
    return _attach(fasts, ways, [fastest(n) for n in range(1, max(ROWS) + 1)])


def _attach(fasts: list[LeanLayer], ways: dict[str, dict[LeanLayer, NativeLayer]], picks: list[str]) -> list[LeanLayer]:
    """Attach to each layer its form of the way picked for each row count 1..max(ROWS); the layers attached."""
    attached = []
    for f in fasts:
        rows = [None] + [ways[way].get(f) if way in ways else None for way in picks]
        if any(rows):
            _ROWS[f] = rows
            attached.append(f)
    return attached


def detach(fasts: list[LeanLayer]) -> None:
    for fast in fasts:
        _ROWS.pop(fast, None)


# The CPU engine's own table of lean layers' native forms (nothing of it is kept on the layers):
# lean layer -> for a batch of one with n rows, its native form [n] (None: the lean forward), attached by `attach`
# where a pass measured faster, for the duration of a `measured_kernels` block
_ROWS: weakref.WeakKeyDictionary[LeanLayer, list] = weakref.WeakKeyDictionary()
# lean layer -> per form its weights are held in, its native form once built (None: it has none), for `stack`
_BUILT: weakref.WeakKeyDictionary[LeanLayer, dict] = weakref.WeakKeyDictionary()


def rows_of(fast: LeanLayer) -> list:
    """The layer's attached native forms by row count ([] where none is attached)."""
    return _ROWS.get(fast, [])


def for_rows(fast: LeanLayer, n: int) -> NativeLayer | None:
    """The native form attached for n rows of a batch of one, or None."""
    rows = _ROWS.get(fast)
    return rows[n] if rows is not None and n < len(rows) else None


def stack(fasts: Sequence[LeanLayer], table,
          form_of=lambda fast: "exact") -> dict[LeanLayer, NativeLayer]:
    """{lean layer: its native form} for those of `fasts` that have one, each held as form_of(layer) (NativeLayer's
    forms) over copies of its weights (the kernel table's, shared with the products' kernels where they are the same):
    built and checked once per form, and again if a weight changed."""
    out = {}
    for fast in fasts:
        form = form_of(fast)
        built = _BUILT.setdefault(fast, {})
        have = built.get(form, False)
        if have is False or (have is not None and not have.current):
            have = built[form] = build(fast, _operand(table, form), form)
        if have is not None:
            out[fast] = have
    return out


def _operand(table, form: str):
    """weight -> the copy layer.c reads as `form`: the table's where it offers that candidate. compact: the weight's
    exact compact form where it has one (compact.py), else its float32 packed copy."""
    if form == "compact":
        exact = _operand(table, "exact")
        return lambda w: compact.form(w) or exact(w)
    if form in ("q8", "q4", "q4a8"):  # the table's own rounding where it offers it (shared with the products' kernel)
        name = f"native_{form}"
        rounded = (lambda w: table.operand(name, w)) if name in table.quant else getattr(compact, f"quantize_{form}")
        copy = _operand(table, "bf16")

        def blocks(w: torch.Tensor):
            try:
                return rounded(w)
            except ValueError:  # rows that are not whole groups of 32: its bfloat16 copy (layer.c reads either)
                return copy(w)

        return blocks
    name = "native_packed_bf16" if form == "bf16" else "native_packed"
    if name in table.candidates or name in table.bf16:
        return lambda w: table.operand(name, w)
    return (lambda w: native.pack(w.to(torch.bfloat16))) if form == "bf16" else native.pack
