"""W1: every drafter on HumanEval and on a non-code question.jsonl, chain γ=4 and dynamic tree, with the peers, into
experiments/results/w1/w1.{csv,md}. Either runs the evaluations for the given drafters (each resumable: a killed run
runs only the prompts its methods had not answered), or collects the runs of the `drafters` table, whose evaluation is this
protocol for its four trained families:

    OMP_NUM_THREADS=2 .venv/bin/python experiments/w1.py --from logs/experiments/drafters/eval
    OMP_NUM_THREADS=2 .venv/bin/python experiments/w1.py logs/recipe/prophet/drafter [more drafter dirs] \\
        [--prompts 10] [--max-new-tokens 128]"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETS = ("humaneval", "question")  # configs/prompts/<set>.yaml
# The dynamic tree as the `drafters` table draws it (configs/experiment/drafters/eval.yaml): within 11 draft nodes
TREES = {"chain": ["sampler=chain", "sampler.gamma=4"],
         "dynamic_tree": ["sampler=dynamic_tree", "sampler.dynamic_topk=3", "sampler.dynamic_budget=11",
                          "sampler.dynamic_by_cost=false"]}
COLUMNS = ["method", "prompts", "tree", "tau", "alpha", "tok_s", "speedup_vs_ar", "speedup_vs_hf", "greedy_identical",
           "break_even_tau", "predicted_speedup", "predicted_from_measured_tau"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafters", nargs="*")
    ap.add_argument("--from", dest="runs", type=Path, help="collect finished runs <set>_<tree> of this dir, run nothing")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--logs", default="logs/w1")
    ap.add_argument("--out", type=Path, default=ROOT / "experiments/results/w1")
    args = ap.parse_args()
    if not args.drafters and args.runs is None:
        ap.error("give drafter dirs to evaluate, or --from a dir of finished runs")
    logs = args.runs or Path(args.logs)
    if args.runs is None:
        for prompts in SETS:
            for tree, t_over in TREES.items():
                peers = "[hf_generate,hf_prompt_lookup]" if tree == "chain" else "[]"  # peers have no trees
                cmd = [sys.executable, str(ROOT / "evaluate.py"), f"drafters=[{','.join(args.drafters)}]",
                       f"prompts={prompts}", f"prompts.limit={args.prompts}",
                       f"sampler.max_new_tokens={args.max_new_tokens}", f"peers={peers}",
                       f"hydra.run.dir={logs / f'{prompts}_{tree}'}", *t_over]
                print("+", " ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, check=True, cwd=ROOT)
        command = (f"OMP_NUM_THREADS=2 .venv/bin/python experiments/w1.py {' '.join(args.drafters)} "
                   f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens}")
    else:
        command = f"OMP_NUM_THREADS=2 .venv/bin/python experiments/w1.py --from {args.runs}"
    rows, header = [], None
    for prompts in SETS:
        for tree in TREES:
            report = json.loads((logs / f"{prompts}_{tree}" / "results.json").read_text())
            header = header or report["header"]
            for r in report["rows"]:
                lev = r.get("leviathan", {})
                rows.append({"method": r["method"], "prompts": prompts, "tree": tree, "tau": r["tau"],
                             "alpha": r["alpha"], "tok_s": r["tok_per_s"], "speedup_vs_ar": r["speedup_vs_ar"],
                             "speedup_vs_hf": r["speedup_vs_hf"], "greedy_identical": r["greedy_identical"],
                             "break_even_tau": lev.get("break_even_tau"), "predicted_speedup": lev.get("predicted_speedup"),
                             # τ / (v(γ+1) + γc): the cost model with the measured τ
                             "predicted_from_measured_tau": r["tau"] / lev["break_even_tau"] if lev else None})
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "w1.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    md = [f"# W1: drafters on HumanEval and question.jsonl", "", f"`{command}`", "",
          f"{header['device']}, {header['dtype']}, {header['threads']} threads, T = {header['temperature']}, "
          f"{header['prompts'].split(' ')[0]} prompts per set, {header['max_new_tokens']} new tokens, batch 1, "
          f"torch {header['torch']}.", "",
          "| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    md += ["| " + " | ".join("—" if r[c] is None else f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c])
                             for c in COLUMNS) + " |" for r in rows]
    (args.out / "w1.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
