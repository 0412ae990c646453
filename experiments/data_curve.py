"""How a family's acceptance grows with training data: its recipe (configs/experiment/recipe/<family>.yaml) trained
on a share of the shipped completion-format answers (¼, ½, all of features-completions' training blocks, a seeded
sample each), the same number of steps and batch for every share, and its validation on the same held-out blocks.

    make features-completions        # the cache every share samples from (resumable)
    python experiments/data_curve.py [--recipe hydra] [--set drafter=copy_hydra drafter.num_heads=3]
                                     [--shares 0.25 0.5 1] [--steps 600] [--batch 8] [--need 0.54 0.73] [--cpu zen5]

Each point is the run's best validation reading (validation every `--steps / 6` steps), so a small share that
overfits is read at its best, not at its end: for α at depth 1 (val/<entry>1_top1, e.g. val/head1_top1 or
val/pos1_top1: the first drafted token's top-1 agreement with the base, what T = 0 accepts there) and the predicted τ
of the drafter's whole chain (val/expected_tau_greedy).
With the same steps, a share smaller than the steps' tokens is seen for several epochs: where the curve still rises at
the largest share, more data would help at this compute; where it is flat, the steps or the drafter limit it.
`--need` are the α per position the cost model asks for (experiments/pages/data_curve.md says whence); a line
through α against log(training tokens) of the points says where each would be reached, if the trend held.

`--set` adds train.py overrides to the recipe's (another drafter on the same recipe, its size); the results are then
filed under the drafter's name. Resumable: a finished training is kept. Results:
experiments/results/data_curve/<cpu>/<name>/: curve_<steps>.md (the table), curve_<steps>.json, and each run's
metrics along training as <share>_<steps>_metrics.csv.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from specdec.engines.measure import cpu_model

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))
TAU = "val/expected_tau_greedy"


def train(recipe: str, extra: list[str], share: float, steps: int, batch: int, run_dir: Path) -> None:
    if (run_dir / "drafter").exists():
        return
    args = ["train.py", f"experiment=recipe/{recipe}", *extra,
            f"data.path={CACHE / 'features' / 'stdlib_complete_all'}",
            f"data.train_share={share}", f"data.batch_size={batch}", f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={max(steps // 6, 1)}", "trainer.limit_val_batches=16",
            "trainer.max_time=null", f"hydra.run.dir={run_dir}"]
    print("+", " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True)


def readings(run_dir: Path) -> list[dict]:
    """Every validation row of a run: train tokens, α at depth 1, predicted τ."""
    rows = []
    for path in sorted(run_dir.glob("csv/version_*/metrics.csv")):
        with open(path) as f:
            reader = csv.DictReader(f)
            # the first drafted token's top-1 column, whatever the family calls its entries (head1, pos1, ...)
            alpha = next(k for k in reader.fieldnames if k.startswith("val/") and k.endswith("1_top1"))
            rows += [{"tokens": float(r["val/train_tokens"]), "alpha1": float(r[alpha]), "tau": float(r[TAU])}
                     for r in reader if r.get(alpha)]
    return sorted(rows, key=lambda r: r["tokens"])


def crossing(points: list[tuple[float, float]], alpha: float) -> float | None:
    """The data size (tokens) where the least-squares line α = a + b·ln(tokens) through points reaches alpha; None
    where the line does not rise."""
    xs, ys = [math.log(t) for t, _ in points], [a for _, a in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    return math.exp(mx + (alpha - my) / b) if b > 0 else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="hydra", help="configs/experiment/recipe/<name>.yaml")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more train.py overrides")
    p.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--need", type=float, nargs="*", default=[0.54, 0.73],
                   help="α per position the cost model asks for (the page says whence)")
    p.add_argument("--cpu", default="this_cpu", help="the results folder's name for this machine, e.g. zen5")
    a = p.parse_args()
    meta = json.loads((CACHE / "features" / "stdlib_complete_all" / "meta.json").read_text())
    block = meta["block_size"]
    name = next((o.split("=", 1)[1] for o in a.set if o.startswith("drafter=")), a.recipe)
    logs = ROOT / "logs" / "data_curve" / name
    dest = ROOT / "experiments" / "results" / "data_curve" / a.cpu / name
    dest.mkdir(parents=True, exist_ok=True)
    points = []
    for share in a.shares:
        run_dir = logs / f"share_{share}_steps_{a.steps}"
        train(a.recipe, a.set, share, a.steps, a.batch, run_dir)
        rows = readings(run_dir)
        best = max(rows, key=lambda r: r["tau"])
        data_tokens = round(share * meta["blocks"]["train"]) * block
        points.append({"share": share, "data_tokens": data_tokens, "epochs": rows[-1]["tokens"] / data_tokens,
                       "best_at_tokens_seen": best["tokens"], "alpha1": best["alpha1"], "tau": best["tau"],
                       "alpha1_end": rows[-1]["alpha1"], "tau_end": rows[-1]["tau"]})
        shutil.copy(next(run_dir.glob("csv/version_*/metrics.csv")), dest / f"{share}_{a.steps}_metrics.csv")
        print(f"share {share}: {data_tokens / 1e6:.2f}M tokens of data, α1 {best['alpha1']:.3f}, τ {best['tau']:.3f} "
              f"(best, at {best['tokens'] / 1e6:.2f}M seen; end: α1 {rows[-1]['alpha1']:.3f})", flush=True)
    line = [(q["data_tokens"], q["alpha1"]) for q in points]
    needs = {str(n): crossing(line, n) if len(line) > 1 else None for n in a.need}
    for n, t in needs.items():
        print(f"α1 {n}: " + (f"at about {t / 1e6:.1f}M tokens of data on the trend" if t else "not on a rising trend"))
    command = (f"python experiments/data_curve.py --recipe {a.recipe} "
               + (f"--set {' '.join(a.set)} " if a.set else "") + f"--shares {' '.join(map(str, a.shares))} "
               f"--steps {a.steps} --batch {a.batch} --need {' '.join(map(str, a.need))} --cpu {a.cpu}")
    curve = {"command": command, "recipe": a.recipe, "overrides": a.set, "cache": "features-completions",
             "block_size": block, "steps": a.steps, "batch": a.batch, "points": points,
             "tokens_needed_for_alpha1": needs}
    (dest / f"curve_{a.steps}.json").write_text(json.dumps(curve, indent=1) + "\n")
    lines = [f"# α at depth 1 against training data: {name}, {a.steps} steps of batch {a.batch}\n",
             f"`{command}` · {datetime.date.today()} · {cpu_model()}\n",
             "| share | data tokens | epochs | α1 (val, best) | τ of the chain (val, best) | at tokens seen |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {q['share']} | {q['data_tokens'] / 1e6:.2f}M | {q['epochs']:.2f} | {q['alpha1']:.3f} | "
              f"{q['tau']:.3f} | {q['best_at_tokens_seen'] / 1e6:.2f}M |" for q in points]
    lines += ["", "α1 reached on the log-linear trend of these points: " + "; ".join(
        f"{n}: " + (f"{t / 1e6:.3g}M tokens" if t else "never (the trend does not rise)") for n, t in needs.items())]
    (dest / f"curve_{a.steps}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
