"""The small-M product of smallm.c, built on first use by this machine's C compiler for this machine's CPU: one more
candidate for the kernel table (kernels.py), used where measurement on this machine picks it; and, in the same library,
a whole lean decoder layer over that product (layer.c, used through native_layer.py where measurement picks it), and a
drafter's whole greedy chain over both (chain.c: the prophet's and Hydra's, through native_chain.py).

Why a whole layer and not single ops: at one token a decoder layer is ~15 small PyTorch ops whose dispatch costs
more than their arithmetic, so replacing one op (a norm, an attention) saves little; one call for the layer, with a
vectorised exp, removes the dispatch.

No compiler, a flag it rejects, a library that does not load: `available()` is then False and the kernel table
simply has one candidate fewer (kernels.py measures what exists; PyTorch's own product is always there). The build takes
under a second and is cached under ~/.cache/specdec/native/, keyed by the source, the compiler and the CPU's model
and instruction-set flags: -march=native code from another CPU could stop this one with an illegal instruction."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import torch

from specdec.engines import measure

SOURCE = Path(__file__).with_name("smallm.c")  # the products (what the kernel table's signature covers)
LAYER_SOURCE = Path(__file__).with_name("layer.c")  # a whole decoder layer over them (native_layer.py)
CHAIN_SOURCE = Path(__file__).with_name("chain.c")  # a drafter's greedy chain over both (native_chain.py)
SOURCES = (SOURCE, LAYER_SOURCE, CHAIN_SOURCE)  # what one library is built from
CACHE = measure.cache_path("native")
# tried in order: the first set the compiler accepts is used (-march=native is not on every compiler and target;
# without OpenMP the kernel runs on one thread and measurement will rarely pick it, but it stays correct)
FLAGS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])
build_s = 0.0  # seconds spent compiling in this process (reported by make bench, never hidden)


def _cpu_signature() -> str:
    """The CPU's identity as the compiler sees it: model, family and the instruction-set flags."""
    fields = measure.cpu_fields()
    keys = ("model name", "cpu family", "model", "flags", "Features", "CPU part")
    return "\n".join(f"{k}: {fields[k]}" for k in keys if k in fields) or platform.processor() + platform.machine()


def _build(compiler: str) -> Path | None:
    """The shared library for this CPU, compiled now unless cached; None when no flag set compiles."""
    global build_s
    sources = list(SOURCES)
    source = b"".join(s.read_bytes() for s in sources)
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha1(source + version.encode() + _cpu_signature().encode()).hexdigest()[:16]
    failed: list[str] = []  # why the flag sets before the one that compiled did not
    for flags in FLAGS:
        target = CACHE / f"smallm-{key}-{'_'.join(f.strip('-') for f in flags)}.so"
        if target.exists():
            return target
        t0 = time.perf_counter()
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            out = Path(tmp) / target.name
            done = compile_library(compiler, flags, sources, out, failed)
            build_s += time.perf_counter() - t0
            if done is None:
                return None
            if done:
                os.replace(out, target)  # atomic: a concurrent process sees the whole library or none
                if failed and "-march=native" not in flags:  # said out loud: without it the kernels are far slower
                    print(f"[specdec] native kernels built with {' '.join(flags)}: {failed[0]}", flush=True)
                return target
    return None


def compile_library(compiler: str, flags: list[str], sources: list[Path], out: Path,
                    errors: list[str] | None = None) -> bool | None:
    """Compile `sources` into the one shared library `out` with `flags`: whether it compiled (if not, the compiler's
    first error line is appended to `errors`); None when the compiler could not be run at all."""
    try:
        done = subprocess.run([compiler, *flags, "-shared", "-fPIC", *map(str, sources), "-o", str(out)],
                              capture_output=True, timeout=120, text=True)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode and errors is not None:
        first = next((l for l in done.stderr.splitlines() if "error" in l), done.stderr.strip()[:200])
        errors.append(f"{' '.join(flags)} failed ({first.strip()})")
    return done.returncode == 0


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@lru_cache(maxsize=None)
def _load() -> ctypes.CDLL | None:
    if os.environ.get("SPECDEC_NATIVE", "1") == "0":
        return None
    compiler = find_compiler()
    if compiler is None or not all(s.exists() for s in SOURCES):
        return None
    path = _build(compiler)
    if path is None:
        return None
    try:
        return open_library(path)
    except (OSError, AttributeError):
        return None


def open_library(path: Path | str) -> ctypes.CDLL:
    """A built smallm library with its functions' signatures set (AttributeError: a library built from other sources,
    which lacks one of them)."""
    # PyTorch (imported above) has loaded its OpenMP runtime; the library's libgomp/libomp dependency binds to that
    # one by its soname, so both share one thread pool instead of two fighting over the cores
    lib = ctypes.CDLL(str(path))
    vp, i32 = ctypes.c_void_p, ctypes.c_int

    def sign(name: str, restype, argtypes: list | None = None) -> None:
        fn = getattr(lib, name)
        fn.restype = restype
        if argtypes is not None:
            fn.argtypes = argtypes

    for name in ("smallm_gemm", "smallm_gemm_bf16", "smallm_packed", "smallm_packed_bf16", "smallm_packed_q4",
                 "smallm_packed_q8", "smallm_q4a8"):
        sign(name, None, [vp] * 3 + [i32] * 4)
    sign("smallm_pack_rows", i32)
    for name in ("smallm_calibrate", "smallm_reassociated_rows"):  # which blocks serve > 6 rows
        sign(name, i32)
    sign("smallm_set_reassociated_rows", i32, [i32])
    sign("smallm_set_prefetch", i32, [i32, i32])
    sign("smallm_prefetch", i32, [i32])
    sign("smallm_block_rows", i32, [])
    sign("smallm_fma_peak", ctypes.c_double, [i32])
    sign("smallm_q4a8_simd", i32, [])
    sign("smallm_evict", None, [vp, ctypes.c_long])
    sign("smallm_layer", i32, [vp, vp, i32, vp, vp, vp, i32, vp, vp, i32])
    sign("smallm_layer_scratch", ctypes.c_long, [vp, i32, i32, i32])
    sign("smallm_layers", i32, [vp, i32, vp, i32, vp, vp, vp, i32, vp, vp, i32, vp])
    sign("smallm_layers_normed", i32, lib.smallm_layers.argtypes + [vp, ctypes.c_float])
    sign("smallm_rms_norm", None, [vp, vp, vp, i32, i32, ctypes.c_float])
    sign("smallm_feature_chain", i32, [vp, vp, i32, vp, vp, ctypes.c_int64, vp, vp, i32, vp, vp, ctypes.c_float])
    sign("smallm_chain_work", ctypes.c_long, [vp])
    sign("smallm_head_chain", i32, [vp, i32, i32, vp, vp, i32, i32, vp, ctypes.c_int64, vp, i32, vp])
    sign("smallm_head_chain_work", ctypes.c_long, [i32] * 3)
    sign("smallm_feature_entries", i32, [vp, vp, i32, vp, i32] + [vp] * 4 + [i32, vp, vp, vp, i32, vp, vp, i32])
    lib.smallm_calibrate()  # a few ms: measured in every process, as the library runs here and now
    return lib


def available() -> bool:
    return _load() is not None


def reassociated_rows() -> int:
    """Up to how many rows the compact kernels sum per group of 32 columns first (smallm.c's reassociated blocks,
    measured against the plain ones where the library loaded: 6 or 12, 12 meaning every row count; 0 without
    AVX-512)."""
    return _library().smallm_reassociated_rows()


def block_rows() -> int:
    """The most x rows one pass of the compact kernels takes (their block heights are 1..this; 0: no library, or one
    whose prefetch distance is fixed)."""
    return _library().smallm_block_rows() if available() else 0


def prefetch(rows: int) -> int:
    """How far ahead (bytes) the compact kernels' blocks of `rows` x rows ask for their weights' codes."""
    return _library().smallm_prefetch(rows)


def set_prefetch(rows: int, ahead: int) -> None:
    """Set that distance for blocks of `rows` rows (0: every height); exact either way, only the speed differs."""
    _library().smallm_set_prefetch(rows, ahead)


@contextlib.contextmanager
def prefetch_kept(lib: ctypes.CDLL | None = None) -> Iterator[None]:
    """Every block height's prefetch distance (smallm.c keeps one for heights 1-12) restored on leaving the block, in
    `lib` (default: this process's library)."""
    lib = lib or _library()
    held = [lib.smallm_prefetch(rows) for rows in range(1, 13)]
    try:
        yield
    finally:
        for rows, ahead in enumerate(held, 1):
            lib.smallm_set_prefetch(rows, ahead)


def fma_peak(threads: int) -> float:
    """This CPU's float32 FMA throughput on `threads` threads, FLOP/s (smallm_fma_peak: ~20 ms)."""
    return _library().smallm_fma_peak(threads)


def int8_dots() -> bool:
    """Whether the library's q4a8 product (smallm_q4a8) sums with the CPU's integer dot products (AVX-512 VNNI, or
    AVX2's multiply-adds); its plain C form elsewhere is correct but never the faster, so the kernel table does not
    offer it there."""
    lib = _load()
    return lib is not None and lib.smallm_q4a8_simd() > 0


def evict(t: torch.Tensor) -> None:
    """Drop t's memory from the CPU's caches (smallm_evict): what reads it next reads it from memory."""
    _library().smallm_evict(t.data_ptr(), t.numel() * t.element_size())


def _library() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError("the native kernel was not built on this machine")
    return lib


def _product(kernels: dict[torch.dtype, Callable], x: torch.Tensor, w: torch.Tensor, inputs: int,
             outputs: int) -> torch.Tensor:
    """y [M, outputs] = x [M, I] times the operand w (whose dtype picks the kernel; `inputs` its I), checked first."""
    if x.dtype != torch.float32 or w.dtype not in kernels or x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError("the native products take a float32 x and a float32 or bfloat16 weight, on the CPU")
    x, w = x.contiguous(), w.contiguous()
    m, i = x.shape
    if inputs != i:
        raise ValueError(f"native product: x {tuple(x.shape)} and a weight of {inputs} inputs do not multiply")
    y = x.new_empty(m, outputs)
    kernels[w.dtype](x.data_ptr(), w.data_ptr(), y.data_ptr(), m, i, outputs, torch.get_num_threads())
    return y


def small_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, I] · w [O, I]ᵀ -> [M, O], x float32 and w float32 (exact) or bfloat16 (the weights rounded, the sums in
    float32); raises for anything else, off the CPU, or when the library is missing: the kernel table then leaves this
    candidate out."""
    lib = _library()
    return _product({torch.float32: lib.smallm_gemm, torch.bfloat16: lib.smallm_gemm_bf16}, x, w, w.shape[1],
                    w.shape[0])


HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page
ARENA = 32 << 20  # copies are carved one after another from regions of this size (a larger one gets its own)
HUGE_FROM = 64 << 10  # smaller copies stay where PyTorch put them
_arena: list = [None, 0]  # the current region (uint8 tensor) and its bytes handed out


def _region(n: int) -> torch.Tensor | None:
    """n bytes (uint8) of a private anonymous mapping advised MADV_HUGEPAGE, starting on a huge page; None where
    the OS offers no such advice."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:  # private: a shared anonymous mapping follows shmem's THP setting, usually never
        region = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive as long as any view of it
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + n]


def huge_pages(t: torch.Tensor) -> torch.Tensor:
    """t copied into memory that Linux backs with 2 MB pages, or t itself (under HUGE_FROM bytes, off the CPU, where
    the OS offers no such advice, or with SPECDEC_HUGE_PAGES=0, for an A/B in two processes). Copies are carved in
    order from shared regions of ARENA bytes, so that a model's products, packed one after another, lie in one run of
    huge pages (SmolLM2's are 0.25-1.3 MB each).

    The products stream their weights from memory once a step, and with 4 KB pages every 4 KB costs a TLB miss and
    stops the hardware prefetcher (it does not cross a page). Where transparent huge pages are "madvise", nothing gets
    them unless it asks, hence the advice here. A region is unmapped once no copy in it is left (the one being carved
    stays mapped)."""
    n = t.numel() * t.element_size()
    if n < HUGE_FROM or t.device.type != "cpu" or os.environ.get("SPECDEC_HUGE_PAGES", "1") == "0":
        return t
    if n > ARENA:
        raw = _region(n)
    else:
        region, used = _arena
        if region is None or used + n > ARENA:
            region, used = _region(ARENA), 0
        raw = None if region is None else region[used : used + n]
        _arena[:] = [region, (used + n + 63) // 64 * 64]  # the next copy starts on a cache line
    if raw is None:
        return t
    out = raw.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


@dataclass(frozen=True)
class Packed:
    """A weight [O, I] in smallm_packed's layout: blocks [ceil(O/R), I, R] (R = the library's pack width; block b holds
    output rows b·R .. b·R + R − 1 column by column, zero-padded past O), float32 or bfloat16."""

    blocks: torch.Tensor
    out_features: int


def pack(w: torch.Tensor) -> Packed:
    """w [O, I] (float32, or bfloat16 for a drafter's rounded copy) -> its packed copy."""
    r = _library().smallm_pack_rows()
    o, i = w.shape
    padded = torch.cat([w, w.new_zeros(-o % r, i)]) if o % r else w
    return Packed(huge_pages(padded.reshape(-1, r, i).transpose(1, 2).contiguous()), o)


def packed_gemm(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """x [M, I] · Wᵀ -> [M, O] from W's packed copy (see `pack`); the same checks as small_gemm."""
    lib = _library()
    return _product({torch.float32: lib.smallm_packed, torch.bfloat16: lib.smallm_packed_bf16}, x, w.blocks,
                    w.blocks.shape[1], w.out_features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (H,), weight, eps) for float32 CPU x [..., H] in one native call (layer.c's norm: the same formula,
    its sum in another order): for a drafter's norms, where one call beats F.rms_norm's ~10 small ops."""
    x = x.contiguous()
    out = torch.empty_like(x)
    h = x.shape[-1]
    _library().smallm_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // h, h, eps)
    return out
