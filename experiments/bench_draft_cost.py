"""Draft cost per depth c = (draft time per round / γ) / T_1, with and without a draft vocabulary, with the drafter's
weights exact (fp32), as bfloat16 copies (the sampler's default draft_precision) and with Q8_0 blocks allowed too (q8),
per family.

    OMP_NUM_THREADS=2 .venv/bin/python experiments/bench_draft_cost.py [--gamma 4] [--new 48]

Untrained drafters (the cost does not depend on the weights), SmolLM2, one HumanEval prompt, chain γ, T = 0, in
our sampler with the measured kernels; T_1 is one base forward over one token (specdec/sampling/cost.py), same run."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.base import load_base  # noqa: E402
from specdec.data.prompts import humaneval, render_chat  # noqa: E402
from specdec.drafters.medusa import Medusa  # noqa: E402
from specdec.drafters.prophet import Prophet  # noqa: E402
from specdec.sampling.cost import forward_costs  # noqa: E402
from specdec.sampling.decode import SamplerConfig, generate  # noqa: E402
from specdec.sampling.kernels import machine_key  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--out", default="experiments/results/bench/draft_cost.json")
    args = ap.parse_args()
    base = load_base(device="cpu")
    prompt = render_chat(base.tokenizer, [{"role": "user", "content": humaneval(1)[0]["turns"][0]}])
    cfg = SamplerConfig(max_new_tokens=args.new, gamma=args.gamma, eos_token_id=[])
    t1 = forward_costs(base, [1], prompt_len=len(prompt))[1]
    rows = {}
    for family, make in {"medusa": lambda v: Medusa(base, num_heads=args.gamma, draft_vocab_size=v),
                         "prophet": lambda v: Prophet(base, draft_vocab_size=v)}.items():
        for vocab in (None, 8192):
            drafter = make(vocab).eval()
            for precision in ("fp32", "bf16", "q8"):
                pcfg = replace(cfg, draft_precision=precision)
                generate(base, [prompt], drafter, pcfg)  # warm-up (and kernel measurement for new shapes)
                r = generate(base, [prompt], drafter, pcfg)
                c = sum(r.step_draft_s) / len(r.step_draft_s) / args.gamma / t1
                rows[f"{family}, vocab {vocab or base.vocab_size}, {precision}"] = round(c, 4)
                print(f"{family:8s} draft vocab {vocab or base.vocab_size:6d} {precision}: c = {c:.3f} "
                      f"(T_1 {t1 * 1e3:.1f} ms)", flush=True)
    report = {"cpu": machine_key(), "gamma": args.gamma, "t1_ms": round(t1 * 1e3, 2), "c_per_depth": rows,
              "command": f"OMP_NUM_THREADS={torch.get_num_threads()} .venv/bin/python experiments/bench_draft_cost.py "
                         f"--gamma {args.gamma} --new {args.new}"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
