"""Why a verify of a few tokens costs more than a decode step on a GPU: the kernels of one recorded verify forward,
and the forward's time with other forms of its two kinds of op (the products and the attention).

    python3 experiments/profile_verify.py [--device cuda] [--ns 1 2 5 9 16] [--out DIR]

1. The kernels: torch.profiler over replays of the base's recorded (CUDA graph) verify forward at each n of --kernels,
   each kernel's GPU time per forward, summed by kernel name. Where the profiler sees no kernels inside a graph
   replay, the same static forward run eagerly is profiled instead (its kernels' GPU times are the same work).
2. The forms: v(n) = T_n / T_1 of the recorded forward (cost.forward_times, as make bench measures it) with every
   nn.Linear product and the attention computed another way, patched in for that measurement only:
     linear      F.linear, PyTorch's default (cuBLAS picks gemv at one row, a gemm kernel at more)
     rows_mv     one matrix-vector product per row (n gemv kernels over the same weight, which the L2 holds)
     bmm_rows    one batched product, a [1, I] x [I, O] per row with the weight shared (stride 0)
     mm_t        (W·xᵀ)ᵀ: cuBLAS's other operand order
   and for the attention: sdpa (PyTorch's scaled_dot_product_attention with the additive mask: the memory-efficient
   kernel) against math (the same formula as explicit matmul + softmax). Each form's logits at the largest n are
   compared with the default's (max |Δ|, fp32 rounding). Then the sampler's own choice, cuda_kernels=measured
   (specdec/engines/cuda/kernels.py: per shape and row count cuBLAS or a Triton small-M kernel, per query count SDPA
   or matmul + softmax, measured on this GPU), and the kernels of its recorded forward at the same n.
Writes DIR/profile_verify.json. On a CPU it runs too (no graphs: eager forwards), which is how it is tested."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.base import load_base  # noqa: E402
from specdec.engines import EngineConfig, build  # noqa: E402
from specdec.engines.cuda import fused as cuda_fused  # noqa: E402
from specdec.engines.cuda import graphs  # noqa: E402
from specdec.engines.cuda import kernels as cuda_kernels  # noqa: E402
from specdec.engines.cuda.engine import CudaEngine  # noqa: E402
from specdec.engines.eager.engine import EagerEngine  # noqa: E402
from specdec.engines.measure import machine_key  # noqa: E402
from specdec.sampling.context import SamplingContext  # noqa: E402
from specdec.sampling.cost import forward_times  # noqa: E402

_LINEAR, _SDPA = F.linear, F.scaled_dot_product_attention


def rows_mv(x, w, b=None):
    rows = x.reshape(-1, x.shape[-1])  # [M, I]
    if rows.shape[0] == 1:
        return _LINEAR(x, w, b)
    y = torch.stack([torch.mv(w, r) for r in rows]).view(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b


def bmm_rows(x, w, b=None):
    rows = x.reshape(-1, x.shape[-1])  # [M, I]
    m = rows.shape[0]
    y = torch.bmm(rows[:, None], w.T[None].expand(m, -1, -1)).view(*x.shape[:-1], w.shape[0])  # [M, 1, O]
    return y if b is None else y + b


def mm_t(x, w, b=None):
    rows = x.reshape(-1, x.shape[-1])
    y = torch.mm(w, rows.T).T.reshape(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b


def math_attention(q, k, v, attn_mask=None, scale=None, enable_gqa=False, **_):
    """SDPA's signature over cuda_kernels.math_attention (matmul + softmax with grouped KV heads)."""
    return cuda_kernels.math_attention(q, k, v, attn_mask, scale if scale is not None else q.shape[-1] ** -0.5)


LINEARS = {"linear": _LINEAR, "rows_mv": rows_mv, "bmm_rows": bmm_rows, "mm_t": mm_t}
ATTENTIONS = {"sdpa": _SDPA, "math": math_attention}


@contextmanager
def forms(linear: str, attention: str):
    """Patch the product and attention forms in for one measurement; recorded graphs are dropped before and after."""
    graphs._POOLS.pop(BASE.model, None)  # fresh pools (a pool's memory is not recorded into again after its graphs go)
    F.linear, F.scaled_dot_product_attention = LINEARS[linear], ATTENTIONS[attention]
    try:
        yield
    finally:
        F.linear, F.scaled_dot_product_attention = _LINEAR, _SDPA
        graphs._POOLS.pop(BASE.model, None)


@torch.no_grad()
def logits_at(base, n: int, prompt_len: int = 128) -> torch.Tensor:
    """The recorded forward's logits over n chain tokens after a fixed random prompt (the current forms)."""
    dev = base.device
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, base.vocab_size, (1, prompt_len), generator=g).to(dev)
    tokens = torch.randint(0, base.vocab_size, (1, n), generator=g).to(dev)
    ctx = SamplingContext(base, 1, prompt_len + n + 1, CudaEngine() if dev.type == "cuda" else EagerEngine())
    ctx.commit_layout(prompt_len)
    ctx.base_forward(prompt)
    ctx.commit(torch.tensor([prompt_len], device=dev), [prompt_len])
    out = None
    for _ in range(3):  # warm-ups, then the recorded replay
        ctx.tree_layout(torch.arange(n), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
        hidden, _ = ctx.base_forward(tokens)
        out = base.lm_head(hidden)
    return out.float().cpu()


@torch.no_grad()
def kernels(base, n: int, reps: int = 20, prompt_len: int = 128) -> tuple[dict[str, float], str]:
    """GPU time per forward by kernel name (µs) of the recorded verify forward over n tokens, and what was profiled."""
    dev = base.device
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, base.vocab_size, (1, prompt_len), generator=g).to(dev)
    tokens = torch.randint(0, base.vocab_size, (1, n), generator=g).to(dev)
    for recorded in (True, False):
        ctx = SamplingContext(base, 1, prompt_len + n + 1, CudaEngine(EngineConfig(cuda_graphs=recorded))
                              if dev.type == "cuda" else EagerEngine())
        ctx.commit_layout(prompt_len)
        ctx.base_forward(prompt)
        ctx.commit(torch.tensor([prompt_len], device=dev), [prompt_len])

        def once():
            ctx.tree_layout(torch.arange(n), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
            return base.lm_head(ctx.base_forward(tokens)[0])

        for _ in range(3):
            once()
        torch.cuda.synchronize(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                once()
            torch.cuda.synchronize(dev)
        per = defaultdict(float)
        for e in prof.key_averages():  # kernels (and copies): GPU time, no CPU time of their own
            if e.self_device_time_total > 0 and e.self_cpu_time_total == 0:
                per[e.key] += e.self_device_time_total / reps  # µs
        if per:
            return dict(sorted(per.items(), key=lambda kv: -kv[1])), "graph replay" if recorded else "eager"
    return {}, "none seen"


def row(label: str, times: dict[int, list[float]], ns: list[int], diff: float) -> dict:
    """One form's line: T_1 and v(n) from medians."""
    med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    v = {n: round(med[n] / med[1], 3) for n in ns}
    print(f"  {label} T_1 {med[1] * 1e3:6.2f}  " + "  ".join(f"v({n}) {v[n]:.2f}" for n in ns)
          + f"  (max |Δ logits| {diff:.1e})", flush=True)
    return {"t1_ms": round(med[1] * 1e3, 3), "v": v, "max_abs_diff": diff}


def kind(name: str) -> str:
    """A kernel's rough kind, for the summary."""
    low = name.lower()
    for key, words in (("gemm/gemv", ("gemm", "gemv", "sgemm", "cublas", "cutlass")), ("attention", ("fmha", "attention",
                        "flash", "efficient")), ("softmax", ("softmax",)), ("copy/index", ("copy", "index", "scatter",
                        "gather", "cat"))):
        if any(w in low for w in words):
            return key
    return "elementwise/other"


def main() -> None:
    global BASE
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 5, 9, 16])
    ap.add_argument("--kernels", type=int, nargs="*", default=[1, 5], help="n whose kernels are listed")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="experiments/results/profile_verify")
    args = ap.parse_args()
    BASE = base = load_base(device=args.device)
    gpu = base.device.type == "cuda"
    where = torch.cuda.get_device_name(base.device) if gpu else machine_key()
    report: dict = {"device": where, "cpu": machine_key(), "torch": torch.__version__, "ns": args.ns,
                    "command": "python3 experiments/profile_verify.py " + " ".join(sys.argv[1:])}

    if gpu:
        report["kernels_us"], report["kernels_profiled"] = {}, {}
        for n in args.kernels:
            per, what = kernels(base, n)
            report["kernels_us"][n], report["kernels_profiled"][n] = per, what
            by_kind = defaultdict(float)
            for name, us in per.items():
                by_kind[kind(name)] += us
            print(f"\n[{where}] n = {n} ({what}): {sum(per.values()):.0f} µs of kernels per forward; by kind: "
                  + ", ".join(f"{k} {us:.0f}" for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1])))
            for name, us in list(per.items())[:12]:
                print(f"  {us:8.1f} µs  {name[:110]}")

    ref = logits_at(base, max(args.ns))
    report["forms"] = {}
    print(f"\n[{where}] v(n) of the recorded verify forward, per form (T_1 in ms)")
    for linear in LINEARS:
        for attention in ATTENTIONS:
            if attention != "sdpa" and linear != "linear":
                continue  # the attention's form once, with the default products
            with forms(linear, attention):
                diff = float((logits_at(base, max(args.ns)) - ref).abs().max())
                times = forward_times(base, args.ns, reps=args.reps,
                                      engine=build(EngineConfig(cuda_kernels="stock"), base.device))
            report["forms"][f"{linear}+{attention}"] = row(f"{linear:9s} {attention:5s}", times, args.ns, diff)
    with cuda_kernels.measured(base.model) if gpu else nullcontext() as table:  # the sampler's choice on this GPU
        diff = float((logits_at(base, max(args.ns)) - ref).abs().max())
        graphs._POOLS.pop(BASE.model, None)
        times = forward_times(base, args.ns, reps=args.reps, engine=build(device=base.device))
        report["forms"]["measured"] = row("measured       ", times, args.ns, diff)
        if table is not None:
            report["measured"] = {"measure_s": round(table.measure_s, 1), "choice": table.choice,
                                  "attention": table.attention, "rope": table.rope, "fused": table.fused}
            print(f"  (measured in {table.measure_s:.1f} s: " + "; ".join(
                f"{s} " + ",".join(f"{n}:{k.removeprefix('triton_')}" for n, k in c.items())
                for s, c in (table.choice | table.attention | {f"rope {g}": c for g, c in table.rope.items()}).items())
                + "; fused " + "/".join(cuda_fused.UNITS) + ": " + "; ".join(
                    f"{g} " + ",".join(f"{n}:" + "/".join(u.get(k, "-").removeprefix("fused_") for k in cuda_fused.UNITS)
                                       for n, u in c.items()) for g, c in table.fused.items()) + ")")
            for n in args.kernels:
                per, what = kernels(base, n)
                report.setdefault("kernels_measured_us", {})[n] = per
                print(f"  measured forms, n = {n} ({what}): {sum(per.values()):.0f} µs of kernels per forward")
                for name, us in list(per.items())[:12]:
                    print(f"  {us:8.1f} µs  {name[:110]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_verify.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
