"""Table `prophet_vs_early_exit` — the open question of lucidrains/speculative-decoding: does a ProphetNet-style
predictor over the base's features beat an early-exit head, at equal trainable parameters and equal budget? Both
train on the same data and steps (val curves in wandb: group prophet_vs_early_exit/train, and in the PNG here),
then draft chains against one AR run.

    python experiments/prophet_vs_early_exit.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

from tables import SMOKE_FROM_RAW_CODE, Table, eval_reports, main, method_row, train_runs, val_curve

RUNS = {"earlyexit": "early_exit", "prophet": "prophet"}  # evaluate's method name -> training run


def build(root):
    trained, report = train_runs(root), eval_reports(root)[""]
    rows = []
    for method, run in RUNS.items():
        t, r = trained[run], method_row(report, method)
        heads = [k.removeprefix("val/").removesuffix("_top1") for k in t["metrics"] if k.endswith("_top1")]
        rows.append({"drafter": run, "params": t["trainable_params"], "steps": t["global_step"],
                     "top1": t["metrics"].get(f"val/{heads[0]}_top1") if heads else None,
                     "val_tau": t["metrics"].get("val/expected_tau"), "tau": r["tau"], "alpha": r["alpha"],
                     "tok_s": r["tok_per_s"], "speedup": r["speedup_vs_ar"]})

    def plot(fig):
        ax1, ax2 = fig.subplots(1, 2)
        for run in RUNS.values():
            ax1.plot(*val_curve(root, run, "train/loss_step"), label=run)
            ax2.plot(*val_curve(root, run, "val/expected_tau"), "o-", label=run)
        ax1.set(xlabel="step", ylabel="train loss", title="Training loss")
        ax2.set(xlabel="step", ylabel="val/expected_tau", title="Predicted τ on validation")
        for ax in (ax1, ax2):
            ax.legend()
            ax.grid(alpha=0.3)

    return Table("ProphetNet-style predictor vs early-exit head (equal parameters, equal budget)", rows,
                 {"drafter": "drafter", "params": "trainable params", "steps": "steps", "top1": "val top-1 (t+1)",
                  "val_tau": "val τ (predicted)", "tau": "τ", "alpha": "α", "tok_s": "tok/s",
                  "speedup": "× AR (ours)"}, plot,
                 [f"{report['header']['draft']}, {report['header']['prompts']} prompts."])


if __name__ == "__main__":
    main("prophet_vs_early_exit", build, smoke_train=SMOKE_FROM_RAW_CODE)
