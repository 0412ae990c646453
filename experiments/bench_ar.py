"""Plain autoregressive decoding: our sampler loop (no drafter) vs HF `generate`, same run, same prompts.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/bench_ar.py            # what `make bench` runs
    .venv/bin/python experiments/bench_ar.py --prompts 3 --max-new-tokens 32   # quick look

SmolLM2-135M (fp32, sdpa), HumanEval prompts rendered with the base's chat template, T = 0, batch 1. Each
prompt is decoded by every method (order rotating), after one warm-up of each that is not timed; the
speedup is mean tok/s ours / mean tok/s HF (SPEC.md §4) and the pooled ratio Σtok/Σt."""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.base import load_base  # noqa: E402
from specdec.data.prompts import humaneval, render_chat  # noqa: E402
from specdec.sampling.decode import SamplerConfig, generate  # noqa: E402


def run_ours(base, prompt: list[int], max_new: int, kernels: str = "measured") -> tuple[int, float]:
    r = generate(base, [prompt], None, SamplerConfig(max_new_tokens=max_new, eos_token_id=[], cpu_kernels=kernels))
    return r.num_generated[0], r.total_s


def run_hf(base, prompt: list[int], max_new: int) -> tuple[int, float]:
    ids = torch.tensor([prompt], device=base.device)
    t0 = time.perf_counter()
    out = base.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                              min_new_tokens=max_new, do_sample=False, pad_token_id=base.tokenizer.eos_token_id)
    return out.shape[1] - ids.shape[1], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = load_base(dtype="float32", device="cpu")
    prompts = [render_chat(base.tokenizer, [{"role": "user", "content": it["turns"][0]}])
               for it in humaneval(args.prompts)]

    # Same greedy tokens from both (a correctness check that costs nothing here).
    ours_toks = generate(base, [prompts[0]], None, SamplerConfig(max_new_tokens=16, eos_token_id=[])).tokens[0]
    hf_toks = base.model.generate(torch.tensor([prompts[0]]), max_new_tokens=16, min_new_tokens=16,
                                  do_sample=False, pad_token_id=base.tokenizer.eos_token_id)[0, len(prompts[0]):]
    run_ours(base, prompts[0], 8), run_hf(base, prompts[0], 8)  # warm-up, not timed

    runners = {"ours": run_ours, "ours_stock": lambda *a: run_ours(*a, kernels="stock"), "hf": run_hf}
    rows = {name: [] for name in runners}
    for i, p in enumerate(prompts):
        names = list(runners)
        for name in names[i % 3:] + names[: i % 3]:  # rotate the order: drift on a noisy machine hits all alike
            rows[name].append(runners[name](base, p, args.max_new_tokens))

    def stats(r):
        return sum(n / t for n, t in r) / len(r), sum(n for n, _ in r) / sum(t for _, t in r)

    (ours_mean, ours_pool), (hf_mean, hf_pool) = stats(rows["ours"]), stats(rows["hf"])
    stock_mean, stock_pool = stats(rows["ours_stock"])
    print(f"device cpu ({platform.processor() or platform.machine()}), fp32, threads {torch.get_num_threads()}, "
          f"batch 1, T=0, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"base {base.name}, {len(prompts)} HumanEval prompts, {args.max_new_tokens} new tokens")
    print(f"greedy tokens identical (16 tokens, prompt 0): {ours_toks.tolist() == hf_toks.tolist()}\n")
    print("| method | tok/s (mean over prompts) | tok/s (pooled) | speedup vs HF generate |")
    print("|---|---|---|---|")
    print(f"| AR, our sampler | {ours_mean:.1f} | {ours_pool:.1f} | {ours_mean / hf_mean:.2f}x (pooled {ours_pool / hf_pool:.2f}x) |")
    print(f"| AR, our sampler, cpu_kernels=stock | {stock_mean:.1f} | {stock_pool:.1f} | {stock_mean / hf_mean:.2f}x (pooled {stock_pool / hf_pool:.2f}x) |")
    print(f"| AR, HF generate | {hf_mean:.1f} | {hf_pool:.1f} | 1.00x |")
    print(f"\ncommand: OMP_NUM_THREADS={args.threads} .venv/bin/python experiments/bench_ar.py "
          f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens} --threads {args.threads}")


if __name__ == "__main__":
    main()
