"""The native small-M product against the kernel table without it, in one process (ratios in one run: these machines
are noisy): T_n of the base's verify forward with each table, rounds interleaved, and the per-shape timings of every
candidate as the table measured them on this machine.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/bench_native.py      # -> experiments/results/bench/native.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.base import load_base  # noqa: E402
from specdec.sampling import native  # noqa: E402
from specdec.sampling.cost import forward_costs  # noqa: E402
from specdec.sampling.kernels import CANDIDATES, DEFAULT_CACHE, KernelTable, machine_key  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="experiments/results/bench")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        sys.exit("the native kernel is not built on this machine (no C compiler, or SPECDEC_NATIVE=0)")
    base = load_base(dtype="float32", device="cpu")
    # two tables over the same candidates but one: the one without native lives beside the default one
    tables = {"without native": KernelTable(DEFAULT_CACHE.with_name("kernels-without-native.json"),
                                            candidates={k: c for k, c in CANDIDATES.items() if k != "native"}),
              "with native": KernelTable()}
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in args.ns} for name in tables}
    for _ in range(args.rounds):  # interleaved rounds: drift hits both alike
        for name, table in tables.items():
            for n, t in forward_costs(base, args.ns, reps=5, table=table).items():
                times[name][n].append(t)
    med = {name: {n: statistics.median(ts) for n, ts in by_n.items()} for name, by_n in times.items()}
    shapes = {k: {r: {c: round(s * 1e6, 1) for c, s in t.items()} for r, t in by_rows.items() if r in (1, 2, 5, 8)}
              for k, by_rows in tables["with native"].timings.items()}
    result = {"machine": machine_key(), "ns": args.ns, "rounds": args.rounds,
              "t_ms": {name: {n: round(t * 1e3, 2) for n, t in m.items()} for name, m in med.items()},
              "v": {name: {n: round(t / m[1], 3) for n, t in m.items()} for name, m in med.items()},
              "native_vs_without": {n: round(med["without native"][n] / med["with native"][n], 3) for n in args.ns},
              "per_shape_us": shapes, "choice": tables["with native"].choice}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "native.json").write_text(json.dumps(result, indent=1))
    (out / "native.md").write_text(render(result, args))
    print(render(result, args))


def render(r: dict, args) -> str:
    ns = r["ns"]
    lines = [f"# Native small-M product vs the kernel table without it: {r['machine']}", "",
             f"`OMP_NUM_THREADS={args.threads} .venv/bin/python experiments/bench_native.py` — T_n of one verify "
             f"forward (SmolLM2 fp32, 128-token prompt, lm_head included), median of {r['rounds']} interleaved rounds "
             "× 5 reps per table, one process.", "",
             "| | " + " | ".join(f"n = {n}" for n in ns) + " |", "|---" * (len(ns) + 1) + "|"]
    for name in r["t_ms"]:
        lines.append(f"| T_n ms, {name} | " + " | ".join(f"{r['t_ms'][name][n]:.1f}" for n in ns) + " |")
    for name in r["v"]:
        lines.append(f"| v(n), {name} | " + " | ".join(f"{r['v'][name][n]:.2f}" for n in ns) + " |")
    lines.append("| without / with native | " + " | ".join(f"{r['native_vs_without'][n]:.2f}×" for n in ns) + " |")
    lines += ["", "Per-shape timings of every candidate as the table measured them (µs per product, best of 3 passes "
              "over all weights of the shape):", "", "| shape | rows | " + " | ".join(CANDIDATES) + " | chosen |",
              "|---|---|" + "---|" * (len(CANDIDATES) + 1)]
    for shape, by_rows in r["per_shape_us"].items():
        for rows, t in by_rows.items():
            cells = " | ".join(f"{t[c]:.0f}" if c in t else "–" for c in CANDIDATES)
            lines.append(f"| {shape} | {rows} | {cells} | {r['choice'][shape][rows]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
