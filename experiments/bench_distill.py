"""Self-distillation throughput: our batched decode loop vs HF `generate` at the same batch, same prompts, same run.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/bench_distill.py [--prompts 64] [--batch 32] [--max-new-tokens 256]

The prompts are the first stdlib_tasks requests (what `make distill` answers), greedy, sorted by length and
batched as `specdec.data.distill` does. Throughput = generated response tokens / wall time, prefill included."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.base import load_base  # noqa: E402
from specdec.data.distill import _eos, _hf, _ours, _prompt_rows  # noqa: E402
from specdec.data.prompts import render_chat  # noqa: E402
from specdec.data.stdlib_tasks import stdlib_tasks  # noqa: E402
from specdec.sampling.decode import SamplerConfig  # noqa: E402
from specdec.sampling.kernels import machine_key  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", default="experiments/results/bench/distill.json")
    args = ap.parse_args()
    base = load_base(device="cpu")
    rows = _prompt_rows(stdlib_tasks(args.prompts), args.prompts)
    prompts = sorted((render_chat(base.tokenizer, m) for _, m in rows), key=len)
    ids = [i for i, _ in rows]
    results = {}
    for name, kernels, engine in [("ours", "measured", _ours), ("ours, cpu_kernels=stock", "stock", _ours),
                                  ("hf generate", "stock", _hf)]:
        cfg = SamplerConfig(max_new_tokens=args.max_new_tokens, cpu_kernels=kernels)
        run = engine(base, cfg, _eos(base, cfg), 0)
        run(prompts[:2], ids[:2]) if name == "ours" else None  # kernel measurement + warm-up, not timed
        t0, tokens = time.perf_counter(), 0
        for lo in range(0, len(prompts), args.batch):
            tokens += sum(len(r) for r in run(prompts[lo : lo + args.batch], ids[lo : lo + args.batch]))
        seconds = time.perf_counter() - t0
        results[name] = {"tokens": tokens, "seconds": round(seconds, 1), "tok_s": round(tokens / seconds, 1)}
        print(f"{name:26s} {tokens:7d} tokens {seconds:7.1f} s {tokens / seconds:7.1f} tok/s", flush=True)
    hf = results["hf generate"]["tok_s"]
    report = {"cpu": machine_key(), "machine": platform.machine(), "threads": torch.get_num_threads(),
              "prompts": len(prompts), "batch": args.batch, "max_new_tokens": args.max_new_tokens,
              "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1), "results": results,
              "speedup_vs_hf": {k: round(v["tok_s"] / hf, 2) for k, v in results.items()},
              "command": f"OMP_NUM_THREADS={torch.get_num_threads()} .venv/bin/python experiments/bench_distill.py "
                         f"--prompts {args.prompts} --batch {args.batch} --max-new-tokens {args.max_new_tokens}"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["speedup_vs_hf"]), "->", args.out)


if __name__ == "__main__":
    main()
