"""Which drafter `make demo` trains, and how it drafts: chosen on HumanEval's tuning split (problems 82-163), never on
the reporting split the demo prints.

    python experiments/demo_choice.py [--prompts 10] [--gammas 1 2 3] [--cpu zen5]

1. the demo's feature cache (600 blocks of the shipped completion-format answers, as `make demo` builds it) with every
   layer a candidate reads (the last; the inputs of base layers 2, 15 and 29);
2. each candidate trained from it at the demo's scale: four Hydra heads (recipe/hydra, lr 3e-3, 600 steps);
   copy-aware Hydra heads (drafters/copy_hydra.py, three, the same recipe); DFlash (recipe/dflash) and P-EAGLE
   (recipe/peagle), 900 steps of batch 4;
3. one evaluation per chain length γ on the tuning split, every candidate that drafts that deep beside our AR loop
   and n-gram lookup, alone and with lookup rounds (sampler=demo, engine=demo), the methods taking turns;
4. the choice: the candidate and γ whose drafter ALONE runs fastest against our AR loop (the demo's question is
   whether a trained drafter beats lookup, which needs no training).

Resumable: a finished training or evaluation is kept. The choice lands in
experiments/results/demo_choice/<cpu>/choice.json (every candidate's rows at every γ, and the winner) beside each
evaluation's report; configs/experiment/demo.yaml and configs/sampler/demo.yaml state the winner, and
tests/test_demo_choice.py checks that they do.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))
DEMO_CACHE = CACHE / "features" / "demo_dflash"  # (dflash_vs_lookup.py builds and reads the same one)
BACKSTOP = "00:00:30:00"  # every candidate trains its recipe's steps here; only a far slower machine stops earlier
HEADS = ["experiment=recipe/hydra", "module.optimizer.lr=3e-3", "trainer.max_steps=600",
         "trainer.val_check_interval=150", "trainer.limit_val_batches=8"]  # the Hydra heads at the demo's scale
# name -> (train.py overrides, the deepest chain it drafts); stated apart from configs/experiment/demo.yaml, which
# tests/test_demo_choice.py checks against the winner's
CANDIDATES: dict[str, tuple[list[str], int]] = {
    "hydra": (HEADS, 4),
    "copy_hydra": ([*HEADS, "drafter=copy_hydra", "drafter.num_heads=3"], 3),
    "dflash": (["experiment=recipe/dflash", "data.batch_size=4", "trainer.max_steps=900",
                "trainer.val_check_interval=150", "trainer.limit_val_batches=8"], 3),
    "peagle": (["experiment=recipe/peagle", "data.batch_size=4", "trainer.max_steps=900",
                "trainer.val_check_interval=150", "trainer.limit_val_batches=8"], 4),
}


def run(*args: str) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES))
    p.add_argument("--cpu", default="this_cpu", help="the results folder's name for this machine, e.g. zen5")
    a = p.parse_args()
    logs = ROOT / "logs" / "demo_choice"
    dest = ROOT / "experiments" / "results" / "demo_choice" / a.cpu
    dest.mkdir(parents=True, exist_ok=True)
    run("-m", "specdec.data.features", "max_train_blocks=600", "data.source.kinds=[complete]", "layers=[-1,2,15,29]",
        f"out_dir={DEMO_CACHE}", f"hydra.run.dir={logs / 'features'}")
    drafters = {}
    for name in a.candidates:
        overrides, _ = CANDIDATES[name]
        train = logs / f"train_{name}"
        if not (train / "drafter").exists():
            run("train.py", *overrides, f"data.path={DEMO_CACHE}", f"trainer.max_time={BACKSTOP}",
                f"hydra.run.dir={train}")
        drafters[name] = train / "drafter"
        shutil.copy(train / "result.json", dest / f"train_{name}.json")
    rows: dict[str, dict[str, dict]] = {}
    for gamma in a.gammas:
        names = [n for n in a.candidates if CANDIDATES[n][1] >= gamma]
        out = logs / f"tune_g{gamma}"
        if not (out / "results.json").exists():
            run("evaluate.py", f"drafters=[{','.join(str(drafters[n]) for n in names)}]", "prompts.split=tune",
                f"prompts.limit={a.prompts}", "sampler=demo", f"sampler.gamma={gamma}", "engine=demo",
                "sampler.max_new_tokens=128", "peers=[]", "passes=2", "identity_reference=false",
                "wandb.enabled=false", f"hydra.run.dir={out}")
        results = json.loads((out / "results.json").read_text())
        shutil.copy(out / "report.md", dest / f"report_g{gamma}.md")
        shutil.copy(out / "results.json", dest / f"results_g{gamma}.json")
        labels = list(results["header"]["drafters"])  # the report's names, in the order the drafters were given
        by_method = {r["method"]: r for r in results["rows"]}
        for name, label in zip(names, labels):
            rows.setdefault(name, {})[str(gamma)] = {
                "alone": by_method[label]["speedup_vs_ar"], "tau": by_method[label]["tau"],
                "with_lookup": by_method[f"{label}+lookup"]["speedup_vs_ar"],
                "lookup_alone": by_method["lookup (ours)"]["speedup_vs_ar"]}
    name, gamma = max(((n, g) for n, by_gamma in rows.items() for g in by_gamma),
                      key=lambda ng: rows[ng[0]][ng[1]]["alone"])
    choice = {"family": name, "gamma": int(gamma), "train_overrides": CANDIDATES[name][0], "rows": rows,
              "command": f"python experiments/demo_choice.py --prompts {a.prompts} --gammas "
                         f"{' '.join(map(str, a.gammas))} --candidates {' '.join(a.candidates)} --cpu {a.cpu}",
              "device": results["header"]["device"]}
    (dest / "choice.json").write_text(json.dumps(choice, indent=1) + "\n")
    lines = ["# The demo's drafter, chosen on HumanEval's tuning split\n",
             f"`{choice['command']}` · {results['header'].get('date')} · {choice['device']}\n",
             "| candidate | γ | τ | alone × AR (ours) | with lookup × AR | lookup alone × AR | alone × lookup |",
             "|---|---|---|---|---|---|---|"]
    for n, by_gamma in rows.items():
        for g, r in by_gamma.items():
            mark = " (chosen)" if (n, g) == (name, gamma) else ""
            lines.append(f"| {n}{mark} | {g} | {r['tau']:.2f} | {r['alone']:.2f} | {r['with_lookup']:.2f} | "
                         f"{r['lookup_alone']:.2f} | {r['alone'] / r['lookup_alone']:.2f} |")
    lines.append(f"\n{a.prompts} prompts of problems 82-163, 128 new tokens, T = 0, 2 passes, one evaluation per γ "
                 "(report_g<γ>.md beside this file: spreads, c, o, v); × AR: mean over prompts of the ratio to our AR "
                 "loop in the same run.")
    (dest / "choice.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"chosen: {name} at γ = {gamma}")


if __name__ == "__main__":
    main()
