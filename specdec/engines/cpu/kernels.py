"""CPU matrix products for decoding, chosen by measurement on the machine that runs them.

A decode step multiplies every weight of the base by a handful of rows (1 for plain decoding, γ+1 or a tree's
nodes for a verify). PyTorch's default kernel for that shape (MKL's sgemm, x·Wᵀ) is fast on some CPUs and
several times slower than the alternatives on others, and which alternative wins depends on the CPU, the weight's
shape and the row count. So nothing is assumed:
on first use, every candidate is timed on the model's OWN weights (all of them of one shape, so the timing
streams memory as a real step does) for each row bucket, the fastest is kept per (shape, rows) and the table
is cached per machine (CPU model, threads, torch version) under ~/.cache/specdec/kernels.json. Machines that
report the same CPU model still differ, and a table timed while another job ran is wrong: each process re-checks
the stored choice once (RECHECK_ROWS) and measures a shape again when it fails. And since a kernel's time alone is
not its time among the others a forward runs, a model's products are also timed as a whole (`arbitrate`).

While decoding, each CPU nn.Linear of the base (and of the drafter) gets a forward that looks its row count up
in that table: one Python call per linear, no interception of other ops. Candidates compute the same product
in the same dtype; one that is missing or fails on this build is left out, and `linear` (PyTorch's default)
is always there as the fallback.

A drafter's linears may also be offered the BF16 candidates, which multiply with a bfloat16 copy of the weight (half
the bytes to stream; x and the sums stay float32): a rounded drafter weight changes what is drafted, never what the
base accepts, so verification stays lossless. They are measured beside the exact ones and used only where faster,
under a shape key of their own; the base's products never see them. Under draft_precision=q8 they are also offered
the Q8 candidate: the weight rounded to llama.cpp's Q8_0 blocks (1.0625 bytes per weight, the compact q8 kernel); under
q4 the Q4 one too (Q4_1 blocks, 0.625 bytes per weight, the compact q4 kernel).

A weight that holds its float32 numbers in an exact compact form (compact.py: a GGUF's Q4_1 / Q8_0 blocks, or bfloat16
values) is also offered the COMPACT candidate, which multiplies with exactly those numbers from a fifth to a half of
the bytes, under a shape key of its own too (the form's kind appended)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from specdec.engines import measure
from specdec.engines.cpu import compact, native, native_layer
from specdec.engines.cpu.native_layer import QUANT_LEVELS
from specdec.engines.eager.lean import _fused, decode_linears, lean_layers
from specdec.engines.measure import machine_key, per_count, store

Kernel = Callable[[torch.Tensor, Any], torch.Tensor]  # (x [M, I], operand: the weight or its packed copy) -> [M, O]
# Row buckets measured; more rows: `linear`. Past 64 they are a prompt's prefill (~100-300 tokens of a HumanEval chat
# prompt): a large share of a short answer's time, and a product at 100-300 rows has its own fastest kernel too.
ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256)
LARGE_ROWS, LARGE_WEIGHTS = 64, 4  # past LARGE_ROWS products are compute-bound: LARGE_WEIGHTS weights a timing suffice
# A stored choice is re-checked once per process at these row counts (an AR step, a γ=1 and a γ=4 verify): one pass of
# every candidate; if the stored kernel is now SLOWER than the best by this factor, the table was measured while the
# machine was busy (a stray job can inflate some candidates' times and not others') and the shape is measured again.
RECHECK_ROWS = (1, 2, 5)
RECHECK_FACTOR = 1.5
# Per-shape timings miss what a forward's MIX of kernels costs (kernels run back to back share the caches, the
# prefetcher and the threads' wake-ups, so the per-shape winners together can lose to one kernel for every shape). So
# for a model's products, at these row counts, one pass in call order with the per-shape choices is timed against one
# with each single kernel for every shape; a single kernel that wins by WHOLE_MARGIN is used for that row count
# (KernelTable.arbitrate).
WHOLE_ROWS = (1, 2, 3, 4, 5, 6, 8)
# a shape whose weights hold fewer than STREAM_BYTES is timed from memory (evicted from the caches before each pass) if
# one is at least COLD_BYTES (see _time; a smaller weight is timed as it is: tests' tiny models)
STREAM_BYTES, COLD_BYTES = 32 << 20, 1 << 20
WHOLE_MARGIN = 1.05


@dataclass(frozen=True)
class Candidate:
    run: Kernel  # (x [M, I], pack(w)) -> x·Wᵀ [M, O], contiguous
    pack: Callable[[torch.Tensor], Any] | None = None  # weight [O, I] -> the operand `run` reads; None: w
    # a rounding candidate's: weight -> the float32 weight its operand holds, whose product it is checked against
    rounded: Callable[[torch.Tensor], torch.Tensor] | None = None


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _mm_nn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # W·xᵀ: the weight is read row-major by MKL's NN path, which some CPUs run far faster at small M than x·Wᵀ
    return torch.mm(w, x.T).T.contiguous()  # callers .view() the result


def _mv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # one row as a matrix-vector product (BLAS gemv), threaded unlike a 1-row gemm on some builds
    if x.shape[0] != 1:
        raise ValueError("mv takes one row")
    return torch.mv(w, x[0])[None]


def _bmm_split(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # W as [n, O/n, I] (see _split_rows): bmm gives each thread its own block of output rows (PyTorch's GEMV uses one
    # thread); with one row the result [n, O/n, 1] already is x·Wᵀ's memory layout
    n, o, i = w.shape
    m = x.shape[0]
    y = torch.bmm(w, x.T.expand(n, i, m))  # [n, O/n, M]
    return y.view(1, n * o) if m == 1 else y.reshape(n * o, m).T.contiguous()


def _split_rows(w: torch.Tensor) -> torch.Tensor:
    # the weight's rows in one block per thread: a view, no copy
    n = torch.get_num_threads()
    o, i = w.shape
    if n < 2 or o % n:
        raise ValueError("bmm_split needs >= 2 threads dividing the output rows")
    return w.view(n, o // n, i)


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # oneDNN's inner product


def _native(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # specdec/engines/cpu/smallm.c: each thread streams its block of W once, the few x rows held in registers
    return native.small_gemm(x, w)


def _native_packed(x: torch.Tensor, w: native.Packed) -> torch.Tensor:
    # smallm.c's packed layout: every weight load serves all the rows, no horizontal sums (flat in rows up to ~12)
    return native.packed_gemm(x, w)


def _linear_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # PyTorch's own bfloat16 product (x rounded too): fast where the CPU has bf16 instructions, else slow, so measured
    return F.linear(x.to(w.dtype), w).float()


def _to_bf16(w: torch.Tensor) -> torch.Tensor:
    return w.to(torch.bfloat16)


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    # oneDNN's blocked weight layout, made once: no per-call reorder (a second copy of the weight in memory)
    return torch.ops.mkldnn._reorder_linear_weight(w, 8)


CANDIDATES: dict[str, Candidate] = {
    "linear": Candidate(_linear),
    "mm_nn": Candidate(_mm_nn),
    "mv": Candidate(_mv),
    "bmm_split": Candidate(_bmm_split, _split_rows),
    "onednn": Candidate(_onednn),
    "onednn_packed": Candidate(_onednn, _onednn_pack),
    "native": Candidate(_native),
    "native_packed": Candidate(_native_packed, native.pack),
}
# the weight rounded to bfloat16: for a drafter's linears only (see the module docstring)
BF16: dict[str, Candidate] = {
    "native_bf16": Candidate(_native, _to_bf16),
    "native_packed_bf16": Candidate(_native_packed, lambda w: native.pack(_to_bf16(w))),
    "linear_bf16": Candidate(_linear_bf16, _to_bf16),
}
BF16_KEY = "~bf16"  # shape-key suffix of a weight that may take the BF16 candidates
# the weight rounded to llama.cpp's Q8_0 or Q4_1 blocks (compact.quantize_q8 / quantize_q4 / quantize_q4a8): for a
# drafter's linears under draft_precision=q8 (Q8_0), q4 (either) or q4a8 (any of them, or Q4_1 blocks multiplied by x
# rounded to int8: integer dot products), offered beside the BF16 ones, under shape keys suffixed "~q8", "~q4", "~q4a8"
QUANT: dict[str, Candidate] = {
    f"native_{kind}": Candidate(compact.gemm, getattr(compact, f"quantize_{kind}"),
                                lambda w, k=kind: compact.rounded(w, k))
    for kind in ("q8", "q4", "q4a8")}
ROUNDS_INPUT = {"native_q4a8"}  # candidates that round x too: checked to TOLERANCE["a8"]
# the weight's own float32 numbers from their exact compact form: exact, offered to weights that have one
COMPACT: dict[str, Candidate] = {"native_compact": Candidate(compact.gemm, compact.pack)}
COMPACT_KEY = "~exact-"  # shape-key suffix (+ the form's kind) of a weight that may take the COMPACT candidate
# A candidate passes its check when within this fraction of the output's largest magnitude of the exact product (a
# bf16 weight is off by up to 2^-9 of itself; the sum of 576-1536 such products stays well inside 2 %)
# (a rounding candidate is checked against the product of the weight it rounded to, so to the exact tolerance)
# (a candidate that rounds x too: compact.A8_TOLERANCE)
TOLERANCE = {"exact": 1e-3, "bf16": 2e-2, "a8": compact.A8_TOLERANCE}
# cpu_kernels=native: a shape's kernel, the first of these it is offered (the fewest bytes a weight: an exact compact
# form, then the drafter's rounded copies as draft_precision allows, then float32 in smallm.c's packed layout)
FORCED = ("native_compact", "native_q4a8", "native_q4", "native_q8", "native_packed_bf16", "native_packed")
DEFAULT_CACHE = measure.cache_path("kernels.json")


class KernelTable:
    """Fastest kernel per (weight shape, row bucket) on this machine, measured once and cached in `path`."""

    def __init__(self, path: Path | str | None = DEFAULT_CACHE, candidates: dict[str, Candidate] | None = None,
                 rows: tuple[int, ...] = ROWS, bf16: dict[str, Candidate] | None = None,
                 compact: dict[str, Candidate] | None = None, quant: dict[str, Candidate] | None = None,
                 forced: bool = False):
        # forced (cpu_kernels=native): nothing is timed or stored; each shape takes the first of FORCED it offers that
        # passes its check, each stack of native layers the first of FORCED_LAYERS it has (native_layer.attach)
        self.forced = forced
        path = None if forced else path
        self.path = Path(path).expanduser() if path is not None else None
        self.candidates = dict(CANDIDATES if candidates is None else candidates)
        self.bf16 = dict(BF16 if bf16 is None else bf16)  # offered to shape keys with BF16_KEY
        self.compact = dict(COMPACT if compact is None else compact)  # offered to shape keys with COMPACT_KEY
        # offered to shape keys with a "~q8" / "~q4" / "~q4a8" suffix (by default q4a8's only where it sums with
        # integer dot products: its plain C form is never the faster, and timing it at up to 256 rows takes seconds)
        self.quant = dict(QUANT if quant is None else quant)
        if quant is None and not native.int8_dots():
            self.quant = {n: c for n, c in self.quant.items() if n not in ROUNDS_INPUT}
        self.rows = rows
        self.key = machine_key()
        self.choice: dict[str, dict[int, str]] = {}  # "OxI" -> {row bucket: kernel name}
        self.timings: dict[str, dict[int, dict[str, float]]] = {}  # "OxI" -> rows -> kernel -> seconds per product
        self.uniform: dict[str, dict[int, str]] = {}  # a model's shapes in call order (hash) -> {rows: kernel for all}
        # a stack of native layers (hash, see native_layer.attach) -> {rows: {"lean": s, "native": s}} for one pass
        self.layers: dict[str, dict[int, dict[str, float]]] = {}
        # a stack of compact native layers (hash, see native_layer.attach) -> {block height: prefetch bytes}
        self.prefetch: dict[str, dict[int, int]] = {}
        self.measure_s = 0.0  # time spent measuring in this process (reported, never hidden)
        self.check_s = 0.0  # time spent re-checking stored choices in this process (reported too)
        # (id(weight), kernel) -> (weakref to the weight, its version, packed operand): packed once, not per call
        self._packed: dict[tuple[int, str], tuple[weakref.ref, int, Any]] = {}
        self._by_rows: dict[str, list[str]] = {}  # shape -> kernel name per row count (see _names)
        self._checked: set[str] = set()  # shapes whose stored choice was re-checked in this process
        self.remeasured: list[str] = []  # shapes a re-check found measured on a busy machine (measured again)
        # what a stored choice was made among: a table measured before a candidate was added (or the native source
        # changed) never saw it, so it is measured again rather than re-checked shape by shape
        self.signature = _signature({**self.candidates, **self.bf16, **self.compact, **self.quant}, rows)
        if self.path is not None and self.path.exists():
            stored = json.loads(self.path.read_text()).get(self.key, {})
            if stored.get("candidates") != self.signature:
                stored = {}
            self.choice = {s: {int(r): k for r, k in c.items()} for s, c in stored.get("choice", {}).items()}
            self.timings = {s: {int(r): t for r, t in c.items()} for s, c in stored.get("timings", {}).items()}
            self.uniform = {m: {int(r): k for r, k in c.items()} for m, c in stored.get("uniform", {}).items()}
            self.layers = {m: {int(r): t for r, t in c.items()} for m, c in stored.get("layers", {}).items()}
            self.prefetch = {m: {int(r): b for r, b in c.items()} for m, c in stored.get("prefetch", {}).items()}

    # -- measuring -------------------------------------------------------------------------------------
    def _offered(self, shape: str) -> dict[str, Candidate]:
        """The candidates a shape key may use: the exact ones, the BF16 ones for a drafter's weights (and the QUANT ones
        of its level under draft_precision=q8, q4 or q4a8) and the COMPACT ones for weights with an exact compact
        form."""
        rounding = shape.split(COMPACT_KEY)[0]  # "OxI:dtype~bf16~<level>" for a drafter's weight with a level
        level = next((lv for lv in QUANT_LEVELS if rounding.endswith(f"~{lv}")), None)
        quant = {n: c for n, c in self.quant.items() if level is not None and n in QUANT_LEVELS[level]}
        return {**self.candidates, **(self.bf16 if BF16_KEY in shape else {}), **quant,
                **(self.compact if COMPACT_KEY in shape else {})}

    def prepare(self, weights: list[torch.Tensor], bf16: bool = False, compact: bool = False, quant: str = "") -> None:
        """Measure every shape among `weights` (CPU, 2-D) not yet in the table, on those very weights; re-check
        (once per process) the stored choice of the others, and measure again a shape that fails it. bf16: the
        weights may also take the BF16 candidates (a drafter's, when the sampler allows it), and with quant ("q8",
        "q4" or "q4a8", its draft_precision) that level's QUANT ones; compact: the COMPACT ones, those that have an
        exact compact form."""
        by_shape: dict[str, list[torch.Tensor]] = {}
        for w in weights:
            by_shape.setdefault(_shape_key(w, bf16, compact, quant), []).append(w)
        if self.forced:
            for shape, ws in by_shape.items():
                if shape not in self.choice:
                    self.choice[shape] = self._forced(ws[0], self._offered(shape))
            return
        t0 = time.perf_counter()
        stale = [s for s, ws in by_shape.items() if s in self.choice and s not in self._checked and self._stale(s, ws)]
        self._checked.update(by_shape)
        self.remeasured += stale
        self.check_s += time.perf_counter() - t0
        missing = {s: ws for s, ws in by_shape.items() if s not in self.choice or s in stale}
        if not missing:
            return
        t0 = time.perf_counter()
        for shape, ws in missing.items():
            self.choice[shape], self.timings[shape] = self._measure(ws, self._offered(shape))
            self._by_rows.pop(shape, None)
        self.measure_s += time.perf_counter() - t0
        self.save()
        if stale:
            print(f"[specdec] kernels: the stored choice for {', '.join(stale)} lost its re-check on this machine; "
                  f"measured again ({time.perf_counter() - t0:.1f} s)", flush=True)

    def _stale(self, shape: str, weights: list[torch.Tensor]) -> bool:
        """Whether the stored choice for `shape` loses clearly to another candidate in one fresh pass now (or names
        a kernel this process lacks)."""
        offered = self._offered(shape)
        for rows in RECHECK_ROWS:
            stored = self.choice[shape].get(rows)
            if stored is None:
                continue
            if stored not in offered:
                return True
            fresh = self._time(weights, rows, 1, offered)
            if stored not in fresh or fresh[stored] > RECHECK_FACTOR * min(fresh.values()):
                return True
        return False

    @torch.no_grad()
    def _forced(self, weight: torch.Tensor, offered: dict[str, Candidate]) -> dict[int, str]:
        """{row bucket: kernel} without timing: at every bucket the first of FORCED that `offered` holds and that
        gives the product's numbers at one row and at a few (as `_time` checks them); "linear" where none does."""
        x = torch.randn(5, weight.shape[1], dtype=weight.dtype, generator=torch.Generator().manual_seed(0))
        for name in (n for n in FORCED if n in offered):
            cand = offered[name]
            tol = TOLERANCE["a8" if name in ROUNDS_INPUT else "bf16" if name in self.bf16 else "exact"]
            try:  # a kernel missing from this build, or wrong, is left out
                operand = cand.pack(weight) if cand.pack else weight
                reference = F.linear(x, cand.rounded(weight) if cand.rounded else weight)
                if all(torch.allclose(cand.run(x[:m], operand), reference[:m], rtol=tol,
                                      atol=tol * float(reference[:m].abs().max())) for m in (1, 5)):
                    return {rows: name for rows in self.rows}
            except Exception:  # noqa: BLE001 — any failure means "not on this machine"
                continue
        return {rows: "linear" for rows in self.rows}

    @torch.no_grad()
    def _measure(self, weights: list[torch.Tensor],
                 offered: dict[str, Candidate]) -> tuple[dict[int, str], dict[int, dict[str, float]]]:
        choice, timings = {}, {}
        for rows in self.rows:
            best = self._time(weights, rows, 3, offered)
            timings[rows] = best
            choice[rows] = min(best, key=best.get) if best else "linear"
        return choice, timings

    @torch.no_grad()
    def _time(self, weights: list[torch.Tensor], rows: int, passes: int,
              offered: dict[str, Candidate]) -> dict[str, float]:
        """Seconds per product of every usable candidate of `offered` at `rows` rows: the best of `passes`
        interleaved passes.
        Every weight of the shape once per pass (up to 32 of them, ~the layers of a small base): the products then
        stream from memory as in a real step instead of hitting a cache-warm copy. A shape with fewer weights than
        STREAM_BYTES (a drafter's, which has one of each) fits a large last-level cache, where in a decode the base's
        whole step has gone through the caches between two of its products: each candidate's operands are evicted
        from the caches (native.evict) before its pass, if one is at least COLD_BYTES. (Timed in the caches, the
        float32 candidates, which share one operand and run back to back, would warm it for each other and beat a
        copy that streams half the bytes from memory, the opposite of what a decode sees.)"""
        ws = weights[: 32 if rows <= LARGE_ROWS else LARGE_WEIGHTS]
        size = sum(w.numel() * w.element_size() for w in ws)
        cold = size < STREAM_BYTES and size >= len(ws) * COLD_BYTES and native.available()
        x = torch.randn(rows, ws[0].shape[1], dtype=ws[0].dtype)
        exact = F.linear(x, ws[0])
        usable = {}
        for name, cand in offered.items():
            tol = TOLERANCE["a8" if name in ROUNDS_INPUT else "bf16" if name in self.bf16 else "exact"]
            try:  # a kernel missing from this build, or wrong, is left out
                operands = [cand.pack(w) for w in ws] if cand.pack else ws
                reference = F.linear(x, cand.rounded(ws[0])) if cand.rounded else exact
                if not torch.allclose(cand.run(x, operands[0]), reference, rtol=tol,
                                      atol=tol * float(reference.abs().max())):
                    continue
                usable[name] = (cand.run, operands)
            except Exception:  # noqa: BLE001 — any failure means "not on this machine"
                continue
        best = {name: float("inf") for name in usable}
        for _ in range(passes):  # interleaved passes, best of them: drift hits every candidate alike
            for name, (fn, operands) in usable.items():
                for op in operands if cold else ():
                    for tensor in _tensors(op):
                        native.evict(tensor)
                t = time.perf_counter()
                for op in operands:
                    fn(x, op)
                best[name] = min(best[name], (time.perf_counter() - t) / len(operands))
        return best

    def save(self) -> None:
        store(self.path, self.key, {"candidates": self.signature, "choice": self.choice, "timings": self.timings,
                                    "uniform": self.uniform, "layers": self.layers, "prefetch": self.prefetch})

    @torch.no_grad()
    def arbitrate(self, weights: list[torch.Tensor], bf16: bool = False, compact: bool = False,
                  quant: str = "") -> dict[int, str]:
        """{rows: kernel} for the row counts at which one kernel for every weight beats the per-shape choices over a
        pass of `weights` (a model's, in the order a forward multiplies with them); measured once per machine and
        model (cached with the table), after `prepare` (with the same `bf16` and `compact`)."""
        if self.forced:
            return {}
        keys = [_shape_key(w, bf16, compact, quant) for w in weights]
        model = hashlib.sha1(" ".join(keys).encode()).hexdigest()[:16]
        if model in self.uniform:
            return self.uniform[model]
        t0 = time.perf_counter()
        found = {}
        for rows in (r for r in WHOLE_ROWS if r in self.rows):
            xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
            passes = {"": [(p, w) for w in weights
                           for p in [self.plan(w, bf16=bf16, compact=compact, quant=quant)[rows]]]}
            for name, cand in {n: c for k in set(keys) for n, c in self._offered(k).items()}.items():
                try:  # a kernel that fails on any of the shapes cannot serve them all
                    ops = [(cand.run, self.operand(name, w)) for w in weights]
                    for (fn, op), w in zip(ops, weights):
                        fn(xs[w.shape[1]], op)
                    passes[name] = [(op, w) for op, w in zip(ops, weights)]
                except Exception:  # noqa: BLE001
                    continue
            best = {name: float("inf") for name in passes}
            for _ in range(3):  # interleaved passes, best of them: drift hits every option alike
                for name, ops in passes.items():
                    best[name] = min(best[name], self._pass_time(ops, xs))
            winner = min(best, key=best.get)
            if winner and best[winner] * WHOLE_MARGIN < best[""]:
                found[rows] = winner
        self.uniform[model] = found
        self.measure_s += time.perf_counter() - t0
        self.save()
        return found

    @staticmethod
    def _pass_time(ops: list[tuple[tuple[Kernel, torch.Tensor] | None, torch.Tensor]],
                   xs: dict[int, torch.Tensor]) -> float:
        """Seconds of one pass of products: ((kernel, operand) or None for F.linear, weight) each, in order."""
        t = time.perf_counter()
        for op, w in ops:
            if op is None:
                F.linear(xs[w.shape[1]], w)
            else:
                op[0](xs[w.shape[1]], op[1])
        return time.perf_counter() - t

    # -- using -----------------------------------------------------------------------------------------
    def plan(self, weight: torch.Tensor, uniform: dict[int, str] | None = None, bf16: bool = False,
             compact: bool = False, quant: str = "") -> list[tuple[Kernel, torch.Tensor] | None]:
        """(kernel, operand) per row count 0..max(rows) for this weight (the smallest measured bucket ≥ rows; uniform:
        {bucket: kernel} that overrides the weight's own choice, see `arbitrate`; bf16, compact, quant: as `prepare`'s);
        None where plain F.linear was fastest (so the common path pays no extra call)."""
        names = self._names(_shape_key(weight, bf16, compact, quant))
        if uniform:
            buckets = [None] + [min((b for b in self.rows if b >= r), default=None) for r in range(1, len(names))]
            names = [uniform.get(b, n) if b is not None else n for b, n in zip(buckets, names)]
        operands = {n: (self._candidate(n).run, self.operand(n, weight)) for n in set(names) - {"linear"}}
        return [operands.get(n) for n in names]

    def _names(self, shape: str) -> list[str]:
        """Kernel name per row count 0..max(rows) for a shape ("linear" throughout for an unmeasured one); kept
        once measured, since a shape's choice never changes after that."""
        if shape in self._by_rows:
            return self._by_rows[shape]
        choice = self.choice.get(shape, {})
        names = per_count(choice, max(self.rows), "linear")
        if choice:
            self._by_rows[shape] = names
        return names

    def _candidate(self, name: str) -> Candidate:
        return self.candidates.get(name) or self.bf16.get(name) or self.quant.get(name) or self.compact[name]

    def operand(self, name: str, weight: torch.Tensor) -> Any:
        """The candidate's packed weight, made once per weight (and again if the weight changed in place); it is
        dropped with the weight."""
        cand = self._candidate(name)
        if cand.pack is None:
            return weight
        key = (id(weight), name)
        ref, version, operand = self._packed.get(key, (None, None, None))
        if ref is None or ref() is not weight or version != weight._version:
            with torch.no_grad():
                operand = cand.pack(weight.detach())
            self._packed[key] = (weakref.ref(weight, lambda _, k=key: self._packed.pop(k, None)), weight._version,
                                 operand)
        return operand


def _tensors(operand: Any) -> list[torch.Tensor]:
    """The dense tensors an operand holds (a weight, a view of it, or a packed copy's fields)."""
    if isinstance(operand, torch.Tensor):
        return [operand] if operand.layout == torch.strided else []
    if dataclasses.is_dataclass(operand):
        return [t for f in dataclasses.fields(operand) for t in _tensors(getattr(operand, f.name))]
    return []


def _signature(candidates: dict[str, Candidate], rows: tuple[int, ...] = ROWS) -> str:
    """The candidates' names, the row buckets, how they are timed, the prefetch distances tried and the native kernel's
    source, hashed (a change to any measures the table anew)."""
    text = " ".join(sorted(candidates)) + f" rows {rows} streamed over {STREAM_BYTES} bytes, evicted from " + (
        f"{COLD_BYTES} ({LARGE_WEIGHTS} weights past {LARGE_ROWS} rows), prefetch {native_layer.PREFETCH_BYTES} ") + (
        native.SOURCE.read_text() if native.SOURCE.exists() else "")
    return measure.signature(text)


def _shape_key(w: torch.Tensor, bf16: bool = False, compact_ok: bool = False, quant: str = "") -> str:
    # a drafter's weight may hold an exact form too (a frozen copy of base rows: a draft vocab's lm_head)
    key = f"{w.shape[0]}x{w.shape[1]}:{str(w.dtype).removeprefix('torch.')}" + (BF16_KEY if bf16 else "")
    key += f"~{quant}" if bf16 and quant else ""
    form = compact.form(w) if compact_ok and w.device.type == "cpu" else None
    return key + (COMPACT_KEY + form.kind if form is not None else "")


_TABLE: KernelTable | None = None


# -- RMSNorms as one native call ---------------------------------------------------------------------------------
def norm_form(norm: nn.Module, exact: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """A Llama-style RMSNorm as one native call (native.rms_norm: float32 on the CPU) or one fused op (F.rms_norm)
    rather than its ~8: the first of them that gives bitwise the norm's own output on this device and dtype (with
    `exact` False, a drafter's norm, which only changes what is drafted: the native call also where it is within
    float32 rounding of it); otherwise the norm itself. In a decode every op comes after the base's forward evicted
    its code and data from the caches, where F.rms_norm (itself ~10 small ops on the CPU) costs several times one
    native call."""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    fused = _fused(norm)
    if not (isinstance(w, torch.Tensor) and w.dim() == 1 and isinstance(eps, float)):
        return norm

    def native_norm(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or not norm.weight.is_contiguous():
            return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)
        return native.rms_norm(x, norm.weight, eps)

    if w.dtype == torch.float32 and w.device.type == "cpu" and native.available():
        with torch.no_grad():
            probe = torch.randn(4, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w)
            want, got = norm(probe), native_norm(probe)
        if torch.equal(got, want) or not exact and torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            return native_norm
    return fused


# norm module -> {(its weight's dtype and device, exact): its native or fused form, or the module itself}
_NORMS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def _norm_form(norm: nn.Module, exact: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """`norm_form(norm, exact)`, decided once per norm, dtype, device and exactness."""
    w = getattr(norm, "weight", None)
    key = ((w.dtype, w.device) if isinstance(w, torch.Tensor) else None, exact)
    known = _NORMS.setdefault(norm, {})
    if key not in known:
        known[key] = norm_form(norm, exact)
    return known[key]


def fuse_norms(module: nn.Module, exact: bool = True) -> list[nn.Module]:
    """Every Llama-style RMSNorm under `module` (a drafter's, the base's final one) that one native call or F.rms_norm
    reproduces (bitwise; within float32 rounding where not `exact`: a drafter whose products may round) gets that as
    its forward, for a decode: fewer ops than its own ~8 (a drafter runs one or two per depth). Returns the norms patched (the caller deletes their `forward` after); one already patched is left
    to whoever did."""
    patched = []
    for m in module.modules():
        if "forward" in m.__dict__ or not isinstance(getattr(m, "variance_epsilon", None), float):
            continue
        fused = _norm_form(m, exact)
        if fused is not m:
            m.forward = fused
            patched.append(m)
    return patched


def default_table() -> KernelTable:
    """The process-wide table (measured lazily, cached per machine on disk)."""
    global _TABLE
    if _TABLE is None:
        _TABLE = KernelTable()
    return _TABLE


_FORCED_TABLE: KernelTable | None = None


def forced_table() -> KernelTable:
    """The process-wide table of cpu_kernels=native: the native kernels without measuring (KernelTable's `forced`)."""
    global _FORCED_TABLE
    if _FORCED_TABLE is None:
        _FORCED_TABLE = KernelTable(forced=True)
    return _FORCED_TABLE


@contextmanager
def measured_kernels(*modules: nn.Module, table: KernelTable | None = None, lean: bool = True,
                     bf16: Collection[nn.Module] = (), native_layers: bool = True,
                     compact: bool = True, quant: str = "") -> Iterator[KernelTable]:
    """Within the block, every CPU nn.Linear of `modules` multiplies with the kernel measured fastest for its
    shape and row count. Shapes never seen on this machine are measured on entry (see `table.measure_s`).
    lean: the decoder layers run by specdec.engines.eager.lean multiply through their fused q|k|v and gate|up linears,
    so those are patched (and measured) instead of the five they stand for. Each module's products are then
    arbitrated as a whole (`table.arbitrate`, once per machine and model). bf16: those of `modules` (drafters) whose
    linears may also take the BF16 candidates; a linear that another module holds too (a drafter sharing the base's
    lm_head) stays exact; quant: those may also take that level's QUANT candidates (draft_precision=q8, q4 or q4a8).
    native_layers (with lean):
    each module's lean layers also run as one native call each where a pass through them measures faster so
    (native_layer.attach, after the products are patched). compact: the weights that have an exact compact form
    (compact.py) may also be multiplied from it, and the native layers hold them so where that measures faster."""
    table = table or default_table()
    groups = []  # (a module's linears, whether they may take the BF16 candidates)
    for mod in modules:
        linears = [m for m in (decode_linears(mod) if lean else mod.modules())
                   if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dim() == 2]
        groups.append((linears, any(mod is b for b in bf16)))
    exact = {id(m) for ms, reduced in groups if not reduced for m in ms}
    groups = [([m for m in ms if id(m) not in exact] if reduced else ms, reduced) for ms, reduced in groups]
    for reduced in (False, True):
        table.prepare([m.weight for ms, r in groups if r == reduced for m in ms], bf16=reduced, compact=compact,
                      quant=quant)
    chosen = {}  # id -> (linear, the row counts its module runs with one kernel for all, bf16)
    for ms, reduced in groups:
        uniform = table.arbitrate([m.weight for m in ms], bf16=reduced, compact=compact, quant=quant) if ms else {}
        chosen.update({id(m): (m, uniform, reduced) for m in ms if id(m) not in chosen})
    patched = []
    for lin, uniform, reduced in chosen.values():
        plan = table.plan(lin.weight, uniform, bf16=reduced, compact=compact, quant=quant)
        if any(plan) and "forward" not in lin.__dict__:  # nested use keeps the outer plan
            lin.forward = _forward(lin, plan)
            patched.append(lin)
    # then whole layers in one native call where that measures faster than the lean layers with these kernels (a
    # drafter's in bfloat16 where its products may be, the layers another module runs too excepted)
    held = {fast for mod in modules if not any(mod is b for b in bf16) for fast in lean_layers(mod)} if lean else ()
    attached = [fast for mod in modules if lean and native_layers
                for fast in native_layer.attach(mod, table, any(mod is b for b in bf16), held, compact, quant)]
    # RMSNorms as one call each (a drafter's whose products may round: within float32 rounding of its own)
    norms = [norm for mod in modules if lean for norm in fuse_norms(mod, exact=not any(mod is b for b in bf16))]
    try:
        yield table
    finally:
        for module in (*patched, *norms):
            del module.forward
        native_layer.detach(attached)


def kernel_names(lin: nn.Linear, table: KernelTable) -> list[str]:
    """Within `measured_kernels`: the kernel lin's product runs at each row count 1, 2, ... (its plan's, "linear" for
    PyTorch's F.linear; [] for a linear left unpatched)."""
    plan = getattr(lin.__dict__.get("forward"), "plan", None)
    if plan is None:
        return []
    by_run = {c.run: n for group in (table.candidates, table.bf16, table.quant, table.compact)
              for n, c in group.items()}
    return [by_run.get(chosen[0], "?") if chosen is not None else "linear" for chosen in plan[1:]]


def _forward(lin: nn.Linear, plan: list[tuple[Kernel, torch.Tensor] | None]) -> Callable[[torch.Tensor], torch.Tensor]:
    """lin's forward through the kernel and operand its plan holds for each row count."""
    return measure.patched_forward(lin, plan, lambda chosen, x: chosen[0](x, chosen[1]))
