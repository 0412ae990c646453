"""Self-distillation throughput: our decode loop with continuous batching (what `specdec.data.distill` runs), the
same loop in fixed batches (what it ran before), and HF `generate` at the same batch, same prompts, same run.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/bench_distill.py [--prompts 256] [--batch 64] [--max-new-tokens 256]

The defaults are `make distill`'s batch (configs/distill.yaml) and four batches' worth of prompts: distillation
answers thousands of prompts in one continuous batch, so the drain at the end (the last rows finishing one by one)
is a small part of it; with 64 prompts at batch 32 (the earlier default) the queue ran dry while half of the answers
were still decoding, in a batch that shrank as they ended. ~15 min on 2 cores.

The prompts are the first stdlib_tasks requests (what `make distill` answers), greedy, sorted by length: at most
--batch rows live (continuous: a finished row takes the next prompt; fixed: consecutive batches, finished rows leave
theirs). Throughput = generated response tokens / wall time, prefill included. `same_as_fixed`: prompts whose
continuous answer equals the fixed-batch one (row counts differ, so the measured kernels' last bits may too).
Then one batch of ours split into prefill and decode, each with the FLOP rate it ran at (2 x the decoder layers'
parameters per token, + the lm_head's where logits are made), and the ceiling the prefill's rate would give."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.base import load_base  # noqa: E402
from specdec.data.distill import _eos, _hf, _ours, _prompt_rows  # noqa: E402
from specdec.data.prompts import render_chat  # noqa: E402
from specdec.data.stdlib_tasks import stdlib_tasks  # noqa: E402
from specdec.engines import EngineConfig, build  # noqa: E402
from specdec.engines.measure import machine_key  # noqa: E402
from specdec.sampling.decode import SamplerConfig, generate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", default="experiments/results/bench/distill.json")
    args = ap.parse_args()
    base = load_base(device="cpu")
    rows = _prompt_rows(stdlib_tasks(args.prompts), args.prompts)
    prompts = sorted((render_chat(base.tokenizer, m) for _, m in rows), key=len)
    ids = [i for i, _ in rows]
    engines = [("ours", "cpu", _ours), ("ours, fixed batches", "cpu", fixed_batches),
               ("ours, engine=eager", "eager", _ours),
               ("hf generate", "eager", lambda *a: _hf(*a, shard_size=len(prompts)))]
    results, answers = {}, {}
    for name, kind, engine in engines:
        cfg = SamplerConfig(max_new_tokens=args.max_new_tokens)
        run = (engine(base, cfg, _eos(base, cfg), 0, args.batch, EngineConfig(name=kind)) if engine is not _hf
               else engine(base, cfg, _eos(base, cfg), 0, args.batch))
        list(run(prompts[:2], ids[:2])) if name == "ours" else None  # kernel measurement + warm-up, not timed
        t0 = time.perf_counter()
        answers[name] = dict(run(prompts, ids))
        seconds = time.perf_counter() - t0
        tokens = sum(map(len, answers[name].values()))
        results[name] = {"tokens": tokens, "seconds": round(seconds, 1), "tok_s": round(tokens / seconds, 1)}
        print(f"{name:26s} {tokens:7d} tokens {seconds:7.1f} s {tokens / seconds:7.1f} tok/s", flush=True)
    same = sum(answers["ours"][i] == answers["ours, fixed batches"][i] for i in answers["ours"])
    split = prefill_decode_split(base, prompts[: args.batch], args.max_new_tokens)
    print(json.dumps(split))
    hf = results["hf generate"]["tok_s"]
    report = {"cpu": machine_key(), "machine": platform.machine(), "threads": torch.get_num_threads(),
              "prompts": len(prompts), "batch": args.batch, "max_new_tokens": args.max_new_tokens,
              "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1), "results": results,
              "same_as_fixed": f"{same}/{len(prompts)}",
              "speedup_vs_hf": {k: round(v["tok_s"] / hf, 2) for k, v in results.items()}, "split": split,
              "command": f"OMP_NUM_THREADS={torch.get_num_threads()} .venv/bin/python experiments/bench_distill.py "
                         f"--prompts {args.prompts} --batch {args.batch} --max-new-tokens {args.max_new_tokens}"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["speedup_vs_hf"]), "->", args.out)


def fixed_batches(base, sampler: SamplerConfig, eos: list[int], seed: int, batch_size: int, engine: EngineConfig):
    """The engine distill ran before continuous batching: `generate` on consecutive batches of the sorted prompts
    (finished rows leave their batch, none joins it). Greedy here, so no per-row generators."""
    cfg, fast = replace(sampler, eos_token_id=eos), build(engine, base.device)

    def run(prompt_ids: list[list[int]], ids: list[str]):
        for lo in range(0, len(ids), batch_size):
            r = generate(base, prompt_ids[lo : lo + batch_size], None, cfg, engine=fast)
            yield from ((lo + b, r.tokens[b, :n].tolist()) for b, n in enumerate(r.num_generated))

    return run


def prefill_decode_split(base, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """One batch of our greedy decoding: where its time goes, and at what FLOP rate. Distillation is compute-bound
    (a batch multiplies every weight by tens of rows), so FLOPs, not bytes, bound it: per response token the base
    runs its decoder layers once for the token and once per prompt token (amortised), the lm_head once."""
    cfg = SamplerConfig(max_new_tokens=max_new_tokens, eos_token_id=_eos(base, SamplerConfig()))
    r = generate(base, prompts, None, cfg, engine=build(device=base.device))
    layers = 2 * sum(p.numel() for layer in base.layers for p in layer.parameters())  # FLOPs per token
    head = 2 * base.lm_head.weight.numel()
    padded, generated = len(prompts) * max(map(len, prompts)), sum(r.num_generated)
    prefill_flops = padded * layers + len(prompts) * head
    decode_flops = (generated - len(prompts)) * (layers + head)  # the first token's logits came with the prefill
    prefill_rate = prefill_flops / r.ttft_s
    per_response_token = (sum(map(len, prompts)) * layers + generated * (layers + head)) / generated
    steps = sorted(r.step_verify_s)
    return {"rows": len(prompts), "prompt_tokens": sum(map(len, prompts)), "padded_prompt_tokens": padded,
            "generated": generated, "seconds": round(r.total_s, 2), "tok_s": round(generated / r.total_s, 1),
            "prefill_s": round(r.ttft_s, 2), "prefill_share": round(r.ttft_s / r.total_s, 3),
            "prefill_gflop_s": round(prefill_rate / 1e9, 1),
            "decode_gflop_s": round(decode_flops / (r.total_s - r.ttft_s) / 1e9, 1),
            "decode_step_ms": {"first": round(1e3 * r.step_verify_s[0], 1),
                               "median": round(1e3 * steps[len(steps) // 2], 1), "last": round(1e3 * r.step_verify_s[-1], 1)},
            "ceiling_tok_s_at_prefill_rate": round(prefill_rate / per_response_token, 1)}


if __name__ == "__main__":
    main()
