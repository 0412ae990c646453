"""DFlash at the demo's scale beside n-gram lookup and our AR loop on HumanEval, T = 0.

1. a feature cache of the shipped completion-format answers (DEMO-sized: 600 blocks of 256) with the layers DFlash
   fuses (inputs of base layers 2, 15, 29);
2. the DFlash recipe (configs/experiment/recipe/dflash.yaml: one layer, blocks of 4) trained from it;
3. the chain length γ chosen on HumanEval's tuning split (problems 82-163) by DFlash's own speed against our AR loop;
4. the chosen γ evaluated on the reporting split (problems 0-81): our AR loop, DFlash alone and with lookup rounds,
   lookup alone, the methods taking turns prompt by prompt over `--passes` rotations.

Every step is resumable (a finished cache is only checked, a finished training is kept). The reports land in
experiments/results/dflash_vs_lookup/<cpu>/ with choice.json (the tuning split's rows and the γ chosen) and
train_result.json and train_metrics.csv (the drafter's validation metrics, at the end and along training):

    python experiments/dflash_vs_lookup.py [--steps 900] [--passes 2] [--prompts 10]
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
GAMMAS = (1, 2, 3)


def run(*args: str) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True)


def evaluate(drafter: Path, out: Path, split: str, gamma: int, prompts: int, passes: int, peers: str) -> dict:
    """One evaluation run -> its results.json (kept beside its report.md in `out`)."""
    if not (out / "results.json").exists():
        run("evaluate.py", f"drafters=[{drafter}]", f"prompts.split={split}", f"prompts.limit={prompts}",
            "sampler=chain", f"sampler.gamma={gamma}", "sampler.lookup_tokens=8", "sampler.max_new_tokens=128",
            "engine=demo", f"peers=[{peers}]", f"passes={passes}", "wandb.enabled=false", f"hydra.run.dir={out}")
    return json.loads((out / "results.json").read_text())


def speed(results: dict, method: str) -> float:
    return next(r["speedup_vs_ar"] for r in results["rows"] if r["method"] == method)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--peers", default="", help="comma-separated peers for the reporting run, e.g. llama_cpp")
    p.add_argument("--cpu", default="this_cpu", help="the results folder's name for this machine, e.g. zen5")
    a = p.parse_args()
    logs = ROOT / "logs" / "dflash_vs_lookup"
    cache = CACHE / "features" / "demo_dflash"
    run("-m", "specdec.data.features", "max_train_blocks=600", "data.source.kinds=[complete]", "layers=[-1,2,15,29]",
        f"out_dir={cache}", f"hydra.run.dir={logs / 'features'}")
    train = logs / f"train_{a.steps}"
    if not (train / "drafter").exists():
        run("train.py", "experiment=recipe/dflash", f"data.path={cache}", "data.batch_size=4",
            f"trainer.max_steps={a.steps}", "trainer.val_check_interval=150", "trainer.limit_val_batches=8",
            f"hydra.run.dir={train}")
    drafter = train / "drafter"
    tuning = {g: evaluate(drafter, logs / f"tune_g{g}", "tune", g, a.prompts, 1, "") for g in GAMMAS}
    name = next(iter(tuning[GAMMAS[0]]["header"]["drafters"]))
    chosen = max(GAMMAS, key=lambda g: speed(tuning[g], name))
    report = evaluate(drafter, logs / f"report_g{chosen}", "report", chosen, a.prompts, a.passes, a.peers)
    dest = ROOT / "experiments" / "results" / "dflash_vs_lookup" / a.cpu
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("report.md", "results.json"):
        shutil.copy(logs / f"report_g{chosen}" / f, dest / f)
    shutil.copy(train / "result.json", dest / "train_result.json")  # the validation metrics at the end of training
    curve = next((train / "csv").rglob("metrics.csv"))  # every logged metric, validation every 150 steps
    shutil.copy(curve, dest / "train_metrics.csv")
    rows = {g: {r["method"]: {k: r[k] for k in ("tau", "tok_per_s", "speedup_vs_ar")} for r in t["rows"]}
            for g, t in tuning.items()}
    (dest / "choice.json").write_text(json.dumps({"steps": a.steps, "chosen_gamma": chosen, "tuning": rows,
                                                  "device": report["header"]["device"]}, indent=1) + "\n")
    for r in report["rows"]:
        print(f"{r['method']:<22} tau {r['tau']:.2f}  {r['tok_per_s']:.1f} tok/s  "
              f"{r['speedup_vs_ar']:.2f}x +- {r['speedup_vs_ar_sd']:.2f} our AR loop")


if __name__ == "__main__":
    main()
