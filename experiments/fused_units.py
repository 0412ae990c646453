"""What each of cuda_fused's configurations costs per unit and row count, against the same ops unfused, on this GPU.

    python3 experiments/fused_units.py [--device cuda] [--rows 1 5 9 16] [--layers 30] [--out DIR]

The CUDA table (cuda_kernels.CudaTable._measure_fused) keeps only each unit's fastest form; this prints them all, to see
where a kernel loses and why (which row counts, which units). Each unit runs over --layers distinct weights of the
base's shapes (SmolLM2-135M's by default: hidden 576, q|k|v 960 of 9 + 3 + 3 heads of 64, mlp 1536), one pass
recorded as a CUDA graph and replayed, so the weights stream from memory as in a forward rather than sit in the L2; µs
per call. "torch" is the unfused PyTorch ops (F.rms_norm, F.linear, F.silu, the adds; for front_rope the rotary and
K/V write of the lean forward after them). A configuration that fails to build or computes something
else (beyond the table's float32 tolerance) is marked so. On a CPU it runs too (eager calls, Triton interpreted where
TRITON_INTERPRET=1), which is how it is tested. Writes DIR/fused_units.json."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.engines.cuda import fused as cuda_fused  # noqa: E402
from specdec.engines.cuda import layer as cuda_layer  # noqa: E402
from specdec.engines.cuda.kernels import TOLERANCE  # noqa: E402
from specdec.sampling.rotary import lean_rope  # noqa: E402


def per_call(calls: list, device: torch.device) -> float:
    """µs per call of `calls` (closures) run in order: best of 5 rounds of 10 CUDA graph replays on a GPU; elsewhere one
    eager pass (a CPU runs this only to test it: interpreted kernels' times mean nothing)."""
    replays, rounds = (10, 5) if device.type == "cuda" else (1, 1)
    for c in calls:  # (compiles and warms)
        c()
    if device.type == "cuda":
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for c in calls:
                    c()
        run = graph.replay
    else:
        def run():
            for c in calls:
                c()
    best = float("inf")
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(replays):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / (replays * len(calls)) * 1e6)
    return best


def unit_ops(unit: str, w: torch.Tensor, norm: torch.Tensor, x: torch.Tensor, r: torch.Tensor, heads: int, kv: int,
             d: int) -> tuple[Callable, Callable]:
    """(the unfused PyTorch ops, config -> the fused kernel) of one unit on weight w [O or 2·O, I]; front_rope: x is
    one sequence of m tokens, its K/V written to slots of a 512-slot cache."""
    eps = 1e-5
    if unit == "front_rope":
        angle = torch.randn(1, x.shape[0], d, device=x.device)
        rope = lean_rope(angle.cos(), angle.sin())
        slots = torch.arange(x.shape[0], device=x.device)[None] + 256
        keys, values = (torch.zeros(1, kv, 512, d, device=x.device) for _ in range(2))
        x3 = x[None]  # [1, m, I]

        def unfused():
            qkv = F.linear(F.rms_norm(x3, (x.shape[1],), norm, eps), w)
            return cuda_layer.rope_write_torch(qkv, *rope, slots, keys, values, heads)
        return unfused, lambda c: cuda_fused.front_rope(x3, w, c, (norm, eps), rope, slots, keys, values, heads)
    if unit == "front":
        return (lambda: F.linear(F.rms_norm(x, (x.shape[1],), norm, eps), w)), (
            lambda c: cuda_fused.product(x, w, c, norm=(norm, eps)))
    if unit == "gated":
        def gated():
            y = F.linear(F.rms_norm(x, (x.shape[1],), norm, eps), w)  # [m, 2·O]: gate | up
            return F.silu(y[:, :w.shape[0] // 2]) * y[:, w.shape[0] // 2:]
        return gated, lambda c: cuda_fused.product(x, w, c, norm=(norm, eps), gated=True)
    return (lambda: r + F.linear(x, w)), lambda c: cuda_fused.product(x, w, c, residual=r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 9, 16])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--qkv", type=int, default=960)
    ap.add_argument("--mlp", type=int, default=1536)
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], help="query heads, KV heads, head size")
    ap.add_argument("--configs", nargs="*", default=list(cuda_fused.CONFIGS))
    ap.add_argument("--out", default="experiments/results/fused_units")
    args = ap.parse_args()
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    h = args.hidden
    # unit -> (outputs of its weight, inputs, outputs of the unit)
    shapes = {"front": (args.qkv, h, args.qkv), "front_rope": (args.qkv, h, args.qkv),
              "gated": (2 * args.mlp, h, args.mlp), "o": (h, h, h), "down": (h, args.mlp, h)}
    heads, kv, d = args.heads
    if args.qkv != (heads + 2 * kv) * d:
        raise SystemExit(f"--qkv {args.qkv} is not (heads + 2·kv)·d of --heads {heads} {kv} {d}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"[{name}] µs per call, {args.layers} distinct weights per pass; '!' computes something else, 'fail' did "
          f"not build")
    results: dict[str, dict[int, dict[str, float | str]]] = {}
    for unit, (o, i, out) in shapes.items():
        weights = [torch.randn(o, i, device=device, generator=g) / i ** 0.5 for _ in range(args.layers)]
        norms = [torch.rand(i, device=device, generator=g) + 0.5 for _ in range(args.layers)]
        results[unit] = {}
        for m in args.rows:
            x = torch.randn(m, i, device=device, generator=g)
            r = torch.randn(m, out, device=device, generator=g)
            ops = [unit_ops(unit, w, nw, x, r, heads, kv, d) for w, nw in zip(weights, norms)]
            row: dict[str, float | str] = {"torch": per_call([u for u, _ in ops], device)}
            want = ops[0][0]()
            for config in args.configs:
                calls = [(lambda f=f: f(config)) for _, f in ops]
                try:
                    got = calls[0]()
                    if not torch.allclose(got, want, rtol=0, atol=TOLERANCE * float(want.abs().max())):
                        row[config] = "!"
                        continue
                    row[config] = per_call(calls, device)
                except Exception as e:  # noqa: BLE001 (a configuration this GPU's Triton cannot build)
                    row[config] = f"fail: {type(e).__name__}"
            results[unit][m] = row
            timed = {c: t for c, t in row.items() if isinstance(t, float)}
            best = min(timed, key=timed.get)
            cells = " ".join(f"{c.removeprefix('fused_')} {t:.2f}" if isinstance(t, float) else
                             f"{c.removeprefix('fused_')} {t}" for c, t in row.items())
            print(f"{unit:5s} m={m:2d} best {best.removeprefix('fused_')} ({row['torch'] / timed[best]:.2f}x torch) | "
                  f"{cells}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_units.json").write_text(json.dumps({"device": name, "layers": args.layers, "shapes": shapes,
                                                      "us_per_call": results}, indent=1))


if __name__ == "__main__":
    main()
