"""A/B the native library (specdec/engines/cpu/smallm.c, layer.c and chain.c) against its sources at another git
revision, in one process, the library built now (A) and from REV (B), interleaved per row count, each first in every
other round (the one that goes first reads slower). A kernel change is measured as a ratio on one machine state.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/ab_native.py --rev HEAD~1            # the packed products
    OMP_NUM_THREADS=2 .venv/bin/python experiments/ab_native.py --rev HEAD~1 --forward  # the sampler's verify forward
    OMP_NUM_THREADS=2 .venv/bin/python experiments/ab_native.py --rev HEAD~1 --compact  # the products from compact forms
    OMP_NUM_THREADS=2 .venv/bin/python experiments/ab_native.py --forward --prefetch 4096 8192  # one library, two
                                                                   # prefetch distances of its compact kernels

Without --forward: one pass over the base's decode products in call order (each layer's q|k|v, o, gate|up, down, then
the lm_head), the float32 packed kernel for all (with --compact: each from its exact compact form, compact.py); ms per
pass and the largest output difference relative to the largest output. With --forward: T_n, one verify forward of n chain tokens after a 128-token prompt (--prompt) as the sampler
runs it (measured kernels, native layers, compact weights, lm_head included), each library driving every native call;
ms per forward and the ratio B / A (both libraries drive the same layer structs: REV's layer.c must hold them alike)."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.base import load_base  # noqa: E402
from specdec.engines.cpu import compact, native, native_layer  # noqa: E402
from specdec.engines.cpu.engine import CpuEngine  # noqa: E402
from specdec.engines.cpu.kernels import measured_kernels  # noqa: E402
from specdec.engines.eager.lean import decode_linears, lean_layers  # noqa: E402
from specdec.engines.measure import cpu_model  # noqa: E402
from specdec.sampling.context import SamplingContext  # noqa: E402
from specdec.sampling.cost import WARMUP  # noqa: E402


def library_at(rev: str, tmp: Path):
    """The library's sources (smallm.c, layer.c, chain.c) as they were at git revision `rev`, compiled with the first
    flag set that builds (as native.py does). A revision whose library lacks a function this one calls is refused by
    native.open_library."""
    texts = {}
    for source in (native.SOURCE, native.LAYER_SOURCE, native.CHAIN_SOURCE):
        path = source.relative_to(ROOT).as_posix()
        texts[source.name] = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True,
                                            text=True, check=True).stdout
    return library_from(texts, tmp, rev)


def library_from(texts: dict[str, str], tmp: Path, what: str = "these sources"):
    """The library compiled from {file name: C source} in `tmp`, with the first flag set that builds."""
    sources = []
    for name, text in texts.items():
        (tmp / name).write_text(text)
        sources.append(tmp / name)
    compiler = native.find_compiler()
    for flags in native.FLAGS if compiler else ():
        if native.compile_library(compiler, flags, sources, tmp / "smallm.so"):
            return native.open_library(tmp / "smallm.so")
    raise RuntimeError(f"smallm.c at {what} does not compile here")


@contextlib.contextmanager
def using(lib, layers=()):
    """native's products through `lib` for the duration (packing included: its pack width may differ), and the native
    layers `layers` (NativeLayer) too."""
    before, held = native._library, [layer.lib for layer in layers]
    native._library = lambda: lib
    for layer in layers:
        layer.lib = lib
    try:
        yield
    finally:
        native._library = before
        for layer, was in zip(layers, held):
            layer.lib = was


@contextlib.contextmanager
def setting(entry, layers=()):
    """`entry`: a library, or (library, bytes): that library with its compact kernels' prefetch distance set to bytes
    for every block height (smallm_set_prefetch), restored after."""
    lib, ahead = entry if isinstance(entry, tuple) else (entry, None)
    with native.prefetch_kept(lib) if ahead is not None else contextlib.nullcontext(), using(lib, layers):
        if ahead is not None:
            lib.smallm_set_prefetch(0, ahead)
        yield


def alternating(libs: dict, rnd: int) -> list:
    """The (name, library) pairs of round `rnd`: each goes first every other round (one always first read slower)."""
    order = list(libs.items())
    return order[::-1] if rnd % 2 else order


def forward_ab(base, libs: dict, rows: list[int], rounds: int, prompt: int = 128) -> dict:
    """{(library, n): [ms]} of the sampler's verify forward over n chain tokens after `prompt` tokens, the libraries
    (or (library, prefetch distance) settings: `setting`) interleaved."""
    with torch.no_grad(), measured_kernels(base):
        layers = {id(l): l for f in lean_layers(base) for l in native_layer.rows_of(f) if l is not None}.values()
        ctx = SamplingContext(base, 1, prompt + max(rows) + 1, CpuEngine())
        ctx.commit_layout(prompt)
        ctx.base_forward(torch.randint(0, base.vocab_size, (1, prompt)))
        ctx.commit(torch.tensor([prompt]), [prompt])
        times = {(name, n): [] for name in libs for n in rows}
        for rnd in range(rounds + WARMUP):
            for n in rows:
                tokens = torch.randint(0, base.vocab_size, (1, n))
                for name, lib in alternating(libs, rnd):
                    with setting(lib, layers):
                        ctx.tree_layout(torch.arange(n), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
                        start = time.perf_counter()
                        hidden, _ = ctx.base_forward(tokens)
                        base.lm_head(hidden)
                        if rnd >= WARMUP:
                            times[(name, n)].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD~1", help="the git revision of the native sources to compare against")
    ap.add_argument("--rows", type=int, nargs="+", help="row counts (default 1 3 5 8 12; with --forward 1 5 9)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 5; with --forward 20)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--forward", action="store_true", help="time the sampler's verify forward instead of the products")
    ap.add_argument("--compact", action="store_true",
                    help="the products from the weights' exact compact forms (compact.py: SmolLM2's Q4_1 layers, Q8_0 "
                         "lm_head) instead of the float32 packed kernel")
    ap.add_argument("--prompt", type=int, default=128,
                    help="with --forward: tokens before the verify (the attention's window; HumanEval's decodes reach "
                         "300-400)")
    ap.add_argument("--prefetch", type=int, nargs="+",
                    help="with --forward: the library built now at these prefetch distances (bytes) instead of --rev")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = load_base(device="cpu")
    if args.forward:
        rows, rounds = args.rows or [1, 5, 9], args.rounds or 20
        with tempfile.TemporaryDirectory() as tmp:
            if args.prefetch:  # the first distance is the reference ("now"), the others compared with it
                libs = {("now" if i == 0 else f"prefetch {b}"): (native._library(), b)
                        for i, b in enumerate(args.prefetch)}
            else:
                libs = {"now": native._library(), args.rev: library_at(args.rev, Path(tmp))}
            times = forward_ab(base, libs, rows, rounds, args.prompt)
        print(f"{cpu_model()}, {args.threads} threads: T_n, one verify forward of n tokens after {args.prompt} "
              f"(measured kernels, native layers, compact weights, lm_head), ms (median of {rounds} interleaved rounds)")
        print("| native library | " + " | ".join(f"n = {n}" for n in rows) + " |")
        print("|---|" + "---|" * len(rows))
        med = {k: statistics.median(v) for k, v in times.items()}
        for name in libs:
            label = f"{name} (prefetch {libs[name][1]})" if name == "now" and args.prefetch else name
            print(f"| {label} | " + " | ".join(f"{med[(name, n)]:.2f}" for n in rows) + " |")
        for name in list(libs)[1:]:
            print(f"| {name} / now | " + " | ".join(f"{med[(name, n)] / med[('now', n)]:.3f}" for n in rows) + " |")
        return
    args.rows, args.rounds = args.rows or [1, 3, 5, 8, 12], args.rounds or 5
    weights = [l.weight.detach() for l in decode_linears(base.model.model)] + [base.lm_head.weight.detach()]
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        libs = {"now": native._library(), args.rev: library_at(args.rev, Path(tmp))}
        packed = {}
        for name, lib in libs.items():
            with using(lib):
                packed[name] = [compact.form(w) for w in weights] if args.compact else [native.pack(w) for w in weights]
        product = compact.gemm if args.compact else native.packed_gemm
        times = {(name, m): [] for name in libs for m in args.rows}
        outs = {}
        for rnd in range(args.rounds):
            for m in args.rows:
                xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights}
                for name, lib in alternating(libs, rnd):  # interleaved: both see the same machine state
                    with using(lib):
                        start = time.perf_counter()
                        outs[name] = [product(xs[w.shape[1]], p) for w, p in zip(weights, packed[name])]
                        times[(name, m)].append((time.perf_counter() - start) * 1e3)
        a, b = outs["now"], outs[args.rev]  # the last round's outputs, same inputs
        diff = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))
    kernel = "compact forms' kernels" if args.compact else "packed kernel"
    print(f"{cpu_model()}, {args.threads} threads: one pass over {len(weights)} products, {kernel}, ms "
          f"(median of {args.rounds} interleaved rounds)")
    print("| smallm.c | " + " | ".join(f"{m} rows" for m in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for name in libs:
        print(f"| {name} | " + " | ".join(f"{statistics.median(times[(name, m)]):.1f}" for m in args.rows) + " |")
    print(f"largest output difference / largest output: {diff:.1e}")


if __name__ == "__main__":
    main()
