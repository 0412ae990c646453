"""Table `eagle3_vs_prophet`: EAGLE-3 exactly (three fused base layers, training-time test, no feature loss) against
the prophet (EAGLE-1-shaped: the last layer fused with one inner layer, a feature loss), each by its recipe
(configs/experiment/recipe/{eagle3,prophet}.yaml) from ONE feature cache for the same steps, batch, lr and schedule,
then measured in one evaluation as a chain of 4 and as an 11-node tree against one AR loop each.

    make features-completions      # the recipes' cache, once (resumable): layers -1, 2, 8, 15, 29
    python experiments/eagle3_vs_prophet.py [--smoke] [--render] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tables import (ROOT, SMOKE_EVAL, SMOKE_FROM_RAW_CODE, SMOKE_TRAIN, Table, _measured, _run, eval_reports,
                            method_row, train_runs, val_curve, write)

NAME = "eagle3_vs_prophet"
RECIPES = ("eagle3", "prophet")  # each is evaluate's method name, its recipe and its training run's dir
# what both trainings share, over their recipes: the cache, the budget and the optimiser
SHARED = ["data.path=${paths.cache_dir}/features/stdlib_complete_all", "data.batch_size=8", "trainer.max_steps=600",
          "trainer.max_time=00:01:30:00", "trainer.val_check_interval=150", "trainer.limit_val_batches=8",
          "trainer.log_every_n_steps=10", "module.optimizer.lr=2e-3", "module.scheduler.num_warmup_steps=30",
          "drafter.draft_vocab_size=8192", "logger=csv"]


def paired(report: dict) -> str:
    """The per-prompt τ difference eagle3 − prophet of one evaluation (the same prompts, so paired): its mean ± standard
    error and on how many prompts eagle3 drafted more; the spread a difference of the means is to be read against."""
    rows = [method_row(report, m, None) for m in RECIPES]
    if None in rows:  # a recipe whose evaluation did not run
        return ""
    e, p = ([q["tau"] for q in r["per_prompt"]] for r in rows)
    d = [a - b for a, b in zip(e, p)]
    if len(d) < 2:
        return ""
    se = statistics.stdev(d) / len(d) ** 0.5
    return (f" Per prompt, τ eagle3 − prophet: {statistics.mean(d):+.3f} ± {se:.3f} (standard error, paired); eagle3 "
            f"ahead on {sum(x > 0 for x in d)} of {len(d)} prompts, behind on {sum(x < 0 for x in d)}.")


def build(root: Path) -> Table:
    trained, reports = train_runs(root), eval_reports(root)
    rows = []
    for method in RECIPES:
        t = trained.get(method, {})
        row = {"drafter": method, "params": t.get("trainable_params"), "steps": t.get("global_step"),
               "val_tau": t.get("metrics", {}).get("val/expected_tau")}
        for job, label in (("chain", "chain"), ("static_tree", "tree")):
            if job in reports:
                r = method_row(reports[job], method)
                row |= {f"{label}_tau": r["tau"], f"{label}_speedup": r["speedup_vs_ar"]}
        rows.append(row)

    def plot(fig):
        ax1, ax2 = fig.subplots(1, 2)
        for method in RECIPES:
            ax1.plot(*val_curve(root, method, "train/loss_step"), label=method)
            ax2.plot(*val_curve(root, method, "val/expected_tau"), "o-", label=method)
        ax1.set(xlabel="step", ylabel="train loss", title="Training loss")
        ax2.set(xlabel="step", ylabel="val/expected_tau", title="Predicted τ on validation")
        for ax in (ax1, ax2):
            ax.legend()
            ax.grid(alpha=0.3)

    notes = [f"{job}: {r['header']['draft']}, {r['header']['prompts']} prompts, {r['header']['max_new_tokens']} new "
             "tokens." + paired(r) for job, r in reports.items()]
    return Table("EAGLE-3 vs the prophet, each by its recipe (same cache, steps, batch, lr and schedule)", rows,
                 {"drafter": "drafter", "params": "trainable params", "steps": "steps", "val_tau": "val τ (predicted)",
                  "chain_tau": "τ chain of 4", "chain_speedup": "chain × AR (ours)",
                  "tree_tau": "τ 11-node tree", "tree_speedup": "tree × AR (ours)"}, plot, notes)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the tiny base, seconds (what make test runs)")
    ap.add_argument("--render", action="store_true", help="only rebuild the table from finished runs")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    both = [o for o in args.overrides if not o.startswith(("train:", "eval:"))]
    train = [*SHARED, *(o.removeprefix("train:") for o in args.overrides if o.startswith("train:"))]
    evals = [o.removeprefix("eval:") for o in args.overrides if o.startswith("eval:")]
    if args.smoke:
        train, evals = [*train, *SMOKE_TRAIN, *SMOKE_FROM_RAW_CODE], [*SMOKE_EVAL, *evals]
    log_dir = next((o.split("=", 1)[1] for o in reversed(both) if o.startswith("paths.log_dir=")), str(ROOT / "logs"))
    root = Path(log_dir) / "experiments" / NAME
    failed = []
    if not args.render:
        for recipe in RECIPES:  # one run each, the recipe's own settings under the shared ones
            # (the tiny base has no layer 29: the family's default layers there)
            own = ["drafter.aux_layers=null"] if args.smoke and recipe == "eagle3" else []
            failed += _run("train.py", f"experiment=recipe/{recipe}",
                           [*both, *train, *own, f"hydra.run.dir={root}/train/{recipe}", f"task_name={NAME}"])
        failed += _run("evaluate.py", f"experiment={NAME}/eval", [*both, *evals])
    out = root / "table" if args.smoke else ROOT / "experiments" / "results" / NAME
    # the command that ran the table's trainings and evaluations (a --render only redraws them)
    command = " ".join(["python", f"experiments/{NAME}.py", *(["--smoke"] if args.smoke else []), *args.overrides])
    write(out, NAME, build(root), command, *_measured(root))
    if failed:
        raise SystemExit(f"[specdec] table {NAME}: {' and '.join(failed)} failed; the table holds the finished runs only")
    return out


if __name__ == "__main__":
    main()
