"""Where a decode round's time goes: our AR loop against a trained drafter's rounds, in the sampler as it runs.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/profile_round.py logs/recipe/prophet_complete/drafter [--gamma 2]
    ... --paths '[[0], [1]]'   # a static tree's rounds instead of a chain's
    ... --compare-kernels   # v(γ+1) with one kernel forced for every row count above 1, against the measured choice
    ... --draft-precision q4a8   # the drafter's weight copies (engine.draft_precision; default the engine's, q8)

For a few HumanEval prompts (T = 0, chain γ, the measured kernels): the median verify and draft time per round, and
v = verify / AR step measured in decode (bench_ar.py's verify-cost curve times a bare forward between other
forwards); then torch.profiler over one prompt each, the ops with the most self CPU time per round. It answers
"is it the GEMMs or the framework" for this machine, and how a verify of γ+1 tokens compares with an AR step.

    python3 experiments/profile_round.py <drafter> --device cuda   # on a GPU: the sampler's default CUDA graphs, and
                                                                   # each op's GPU time beside its CPU time"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.base import load_base  # noqa: E402
from specdec.checkpoint import load_drafter  # noqa: E402
from specdec.data.prompts import humaneval, render_chat  # noqa: E402
from specdec.engines import build  # noqa: E402
from specdec.engines.config import EngineConfig  # noqa: E402
from specdec.engines.cpu.kernels import CANDIDATES, default_table  # noqa: E402
from specdec.engines.measure import machine_key  # noqa: E402
from specdec.sampling.decode import SamplerConfig, generate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter", help="a drafter checkpoint dir (train.py's <run>/drafter)")
    ap.add_argument("--gamma", type=int, default=2)
    ap.add_argument("--paths", help="a static tree's paths as JSON, e.g. '[[0], [1]]' (instead of a chain of --gamma)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--top", type=int, default=15, help="ops listed per profile")
    ap.add_argument("--compare-kernels", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the table then lists GPU time too)")
    ap.add_argument("--draft-precision", default=EngineConfig.draft_precision,
                    help="engine.draft_precision: fp32, bf16, q8, q4 or q4a8")
    args = ap.parse_args()
    base = load_base(device=args.device)
    gpu = base.device.type == "cuda"
    drafter = load_drafter(args.drafter, base)
    fast = build(EngineConfig(draft_precision=args.draft_precision), device=base.device)  # evaluate.py's engine=auto
    prompts = [render_chat(base.tokenizer, [{"role": "user", "content": it["turns"][0]}])
               for it in humaneval(args.prompts + 1, split="tune")]
    shape = dict(tree="static", paths=json.loads(args.paths)) if args.paths else dict(gamma=args.gamma)
    ar, spec = SamplerConfig(max_new_tokens=args.new), SamplerConfig(max_new_tokens=args.new, **shape)
    generate(base, prompts[:1], None, ar, engine=fast), generate(base, prompts[:1], drafter, spec,
                                                                 engine=fast)  # warm-up (kernel table too)
    where = torch.cuda.get_device_name(base.device) if gpu else machine_key()
    print(f"[{where}] {f'tree {args.paths}' if args.paths else f'γ = {args.gamma}'}, draft precision "
          f"{args.draft_precision}; ms per round, medians")
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    for p in prompts[1:]:  # one prompt at a time, AR and the drafter back to back: drift hits both alike
        a, r = generate(base, [p], None, ar, engine=fast), generate(base, [p], drafter, spec, engine=fast)
        tau = (sum(r.accepted[0]) + len(r.accepted[0])) / len(r.accepted[0])
        print(f"AR step {ms(a.step_verify_s):.1f} | drafter: verify {ms(r.step_verify_s):.1f} "
              f"(v = {statistics.median(r.step_verify_s) / statistics.median(a.step_verify_s):.2f}), "
              f"draft {ms(r.step_draft_s):.1f}, overhead {ms(r.step_overhead_s):.1f} (AR {ms(a.step_overhead_s):.1f}), "
              f"τ {tau:.2f}")
    if args.compare_kernels:
        compare_kernels(base, drafter, prompts[1:], ar, spec, fast)
        return
    for name, d, cfg in (("AR", None, ar), ("drafter", drafter, spec)):
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * gpu) as prof:
            r = generate(base, prompts[1:2], d, cfg, engine=fast)
        n = len(r.step_verify_s)
        print(f"\n{name}: {n} rounds, {1e3 * (r.total_s - r.ttft_s) / n:.1f} ms a round; self CPU time per round"
              + (" (and self GPU time)" if gpu else "") + ":")
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]:
            on_gpu = f"  GPU {e.self_device_time_total / 1e3 / n:6.2f} ms" if gpu else ""
            print(f"  {e.key[:44]:44s} {e.self_cpu_time_total / 1e3 / n:7.2f} ms  {e.count / n:7.1f} calls{on_gpu}")


def compare_kernels(base, drafter, prompts, ar, spec, fast, passes: int = 2) -> None:
    """v(γ+1) in decode (median verify / median AR step, per prompt) with the measured kernel choice, and with each
    candidate forced for every row count above 1 (one row keeps its measured kernel, so the AR step is the same)."""
    table = default_table()
    measured = {shape: dict(c) for shape, c in table.choice.items()}
    v: dict[str, list[float]] = {}
    for _ in range(passes):  # interleaved passes: drift hits every choice alike
        for kind in ["measured", *CANDIDATES]:
            for shape, choice in table.choice.items():
                for rows in choice:
                    choice[rows] = measured[shape][rows] if kind == "measured" or rows == 1 else kind
            table._by_rows.clear()  # the per-shape lookup is rebuilt from the edited choice
            for p in prompts:
                try:
                    a, r = generate(base, [p], None, ar, engine=fast), generate(base, [p], drafter, spec, engine=fast)
                except (RuntimeError, ValueError):  # a kernel that cannot take these rows (mv: one row only)
                    v[kind] = []
                    break
                v.setdefault(kind, []).append(statistics.median(r.step_verify_s) / statistics.median(a.step_verify_s))
    table.choice = measured
    table._by_rows.clear()
    for kind, vs in v.items():
        print(f"v(n) with {kind:14s} " + (f"{statistics.median(vs):.2f}  ({len(vs)} prompt runs)" if vs
                                                         else "—  (cannot take these rows)"))


if __name__ == "__main__":
    main()
