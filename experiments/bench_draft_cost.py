"""Draft cost per depth c = (draft time per round / γ) / T_1, with and without a draft vocabulary, with the drafter's
weights exact (fp32), as bfloat16 copies, with Q8_0 blocks allowed too (q8, the sampler's default draft_precision),
Q4_1 blocks too (q4) and Q4_1 blocks times int8-rounded inputs too (q4a8), per family (Medusa, Hydra, the prophet).

    OMP_NUM_THREADS=2 .venv/bin/python experiments/bench_draft_cost.py [--gamma 4] [--new 48] [--precisions q8 q4]
                                                                       [--reps 5]

Untrained drafters (the cost does not depend on the weights), SmolLM2, one HumanEval prompt, chain γ, T = 0, in
our sampler with the measured kernels; the draft time a round is the median over `reps` decodes of each decode's mean
(one decode's read ±15 % on a 2-core Zen 5 from run to run); T_1 is one base forward over one token
(specdec/sampling/cost.py, a median of its own), same run.

Beside each c, the ratio of bytes: a draft depth reads each of the drafter's decode weights once and a base step each
of the base's, so the drafter's weight bytes (each in the narrowest form the precision allows: its exact compact form,
or Q4_1 / Q8_0 / bfloat16 / float32) over the base's as its step reads them (bench_ar.streamed_bytes) is what a depth would
cost if both streamed at one rate. Not a floor: weights a round has just read can come faster from the caches (the
full-vocab Medusa heads share the base's lm_head). Where c sits well above it, the depth pays for more than its
weights: dispatch, small ops, the tree's bookkeeping."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.base import load_base  # noqa: E402
from specdec.data.prompts import humaneval, render_chat  # noqa: E402
from specdec.drafters.hydra import Hydra  # noqa: E402
from specdec.drafters.medusa import Medusa  # noqa: E402
from specdec.drafters.prophet import Prophet  # noqa: E402
from specdec.engines import EngineConfig, build  # noqa: E402
from specdec.engines.cpu import compact  # noqa: E402
from specdec.engines.eager.lean import decode_linears  # noqa: E402
from specdec.engines.measure import machine_key  # noqa: E402
from specdec.sampling.cost import forward_costs  # noqa: E402
from specdec.sampling.decode import SamplerConfig, generate  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ar import streamed_bytes  # noqa: E402


def held_bytes(w: torch.Tensor, precision: str) -> float:
    """A drafter weight's bytes in the narrowest form `precision` lets the sampler multiply from (kernels.py): its exact
    compact form where it has one (a draft vocab's rows of the base's Q8_0 embedding), else Q4_1 or Q8_0 blocks (q4a8,
    q4, q8: where its rows are whole groups of 32), bfloat16, or float32."""
    exact = compact.form(w)
    blocks = w.shape[1] % 32 == 0
    rounded = {"fp32": 4.0, "bf16": 2.0, "q8": 1.0625 if blocks else 2.0,
               "q4": 0.625 if blocks else 2.0, "q4a8": 0.625 if blocks else 2.0}[precision] * w.numel()
    return min(exact.nbytes, rounded) if exact is not None else rounded


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "q8", "q4", "q4a8"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="experiments/results/bench/draft_cost.json")
    args = ap.parse_args()
    base = load_base(device="cpu")
    prompt = render_chat(base.tokenizer, [{"role": "user", "content": humaneval(1)[0]["turns"][0]}])
    cfg = SamplerConfig(max_new_tokens=args.new, gamma=args.gamma, eos_token_id=[])
    t1 = forward_costs(base, [1], prompt_len=len(prompt), engine=build(device="cpu"))[1]
    step_bytes = streamed_bytes(base)
    rows, ratios = {}, {}
    for family, make in {"medusa": lambda v: Medusa(base, num_heads=args.gamma, draft_vocab_size=v),
                         "hydra": lambda v: Hydra(base, num_heads=args.gamma, draft_vocab_size=v),
                         "prophet": lambda v: Prophet(base, draft_vocab_size=v)}.items():
        for vocab in (None, 8192):
            drafter = make(vocab).eval()
            for precision in args.precisions:
                fast = build(EngineConfig(draft_precision=precision), "cpu")
                generate(base, [prompt], drafter, cfg, engine=fast)  # warm-up (and kernel measurement for new shapes)
                per_round = [sum(r.step_draft_s) / len(r.step_draft_s)
                             for r in (generate(base, [prompt], drafter, cfg, engine=fast) for _ in range(args.reps))]
                c = statistics.median(per_round) / args.gamma / t1
                name = f"{family}, vocab {vocab or base.vocab_size}, {precision}"
                rows[name] = round(c, 4)
                # a depth's products: the prophet's block, fc and projection; a Medusa or Hydra head (its γ heads
                # draft one depth each: their mean, Hydra's in_proj widening with the depth) and the projection
                bodies = [drafter] if family == "prophet" else list(drafter.heads)
                head = drafter.draft_vocab.head if vocab else base.lm_head
                depth_bytes = held_bytes(head.weight, precision) + sum(
                    held_bytes(m.weight, precision) for body in bodies for m in decode_linears(body)
                    if m is not head) / len(bodies)
                ratios[name] = round(depth_bytes / step_bytes, 4)
                print(f"{family:8s} draft vocab {vocab or base.vocab_size:6d} {precision}: c = {c:.3f} "
                      f"(T_1 {t1 * 1e3:.1f} ms; bytes {ratios[name]:.3f} of a step's: {depth_bytes / 1e6:.1f} MB a depth, "
                      f"{step_bytes / 1e6:.1f} MB a step)", flush=True)
    report = {"cpu": machine_key(), "gamma": args.gamma, "t1_ms": round(t1 * 1e3, 2), "c_per_depth": rows,
              "bytes_per_depth_over_step": ratios, "base_step_bytes": step_bytes,
              "reps": args.reps,
              "command": f"OMP_NUM_THREADS={torch.get_num_threads()} .venv/bin/python experiments/bench_draft_cost.py "
                         f"--gamma {args.gamma} --new {args.new} --precisions {' '.join(args.precisions)} "
                         f"--reps {args.reps}"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
