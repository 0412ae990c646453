"""A/B the native packed product (specdec/sampling/smallm.c) against its source at another git revision, in one process:
one pass over the base's decode products in call order (each layer's q|k|v, o, gate|up, down, then the lm_head), the
packed kernel for all, the library built now (A) and from REV (B), interleaved, per row count. A kernel change is
measured as a ratio on one machine state, with the outputs compared.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/ab_native.py --rev HEAD~1

Prints ms per pass (median of the rounds) for both and the largest output difference relative to the largest output."""

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
from specdec.sampling import native  # noqa: E402
from specdec.sampling.kernels import cpu_model  # noqa: E402
from specdec.sampling.lean import decode_linears  # noqa: E402


def library_at(rev: str, tmp: Path):
    """smallm.c as it was at git revision `rev`, compiled with the first flag set that builds (as native.py does)."""
    source = subprocess.run(["git", "show", f"{rev}:specdec/sampling/smallm.c"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    (tmp / "smallm.c").write_text(source)
    compiler = native.find_compiler()
    for flags in native.FLAGS if compiler else ():
        if native.compile_library(compiler, flags, [tmp / "smallm.c"], tmp / "smallm.so"):
            return native.open_library(tmp / "smallm.so")
    raise RuntimeError(f"smallm.c at {rev} does not compile here")


@contextlib.contextmanager
def using(lib):
    """native's products through `lib` for the duration (packing included: its pack width may differ)."""
    before = native._library
    native._library = lambda: lib
    try:
        yield
    finally:
        native._library = before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD~1", help="the git revision of smallm.c to compare against")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 3, 5, 8, 12])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = load_base(device="cpu")
    weights = [l.weight.detach() for l in decode_linears(base.model.model)] + [base.lm_head.weight.detach()]
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        libs = {"now": native._library(), args.rev: library_at(args.rev, Path(tmp))}
        packed = {}
        for name, lib in libs.items():
            with using(lib):
                packed[name] = [native.pack(w) for w in weights]
        times = {(name, m): [] for name in libs for m in args.rows}
        outs = {}
        for _ in range(args.rounds):
            for m in args.rows:
                xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights}
                for name, lib in libs.items():  # interleaved: both see the same machine state
                    with using(lib):
                        start = time.perf_counter()
                        outs[name] = [native.packed_gemm(xs[w.shape[1]], p) for w, p in zip(weights, packed[name])]
                        times[(name, m)].append((time.perf_counter() - start) * 1e3)
        a, b = outs["now"], outs[args.rev]  # the last round's outputs, same inputs
        diff = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))
    print(f"{cpu_model()}, {args.threads} threads: one pass over {len(weights)} products, packed kernel, ms "
          f"(median of {args.rounds} interleaved rounds)")
    print("| smallm.c | " + " | ".join(f"{m} rows" for m in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for name in libs:
        print(f"| {name} | " + " | ".join(f"{statistics.median(times[(name, m)]):.1f}" for m in args.rows) + " |")
    print(f"largest output difference / largest output: {diff:.1e}")


if __name__ == "__main__":
    main()
