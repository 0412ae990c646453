"""Table `exit_layer` (LayerSkip / self-speculative decoding): an early-exit head at layer L of the base, trained
for each L on the same budget; τ and speedup versus L, all against one AR run.

    python experiments/exit_layer.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

from pathlib import Path

from specdec.tables import Table, eval_reports, main, method_row, train_runs


def build(root):
    trained, report = train_runs(root), eval_reports(root)[""]
    # evaluate names repeated drafter classes earlyexit, earlyexit#1, ... in the order of its drafters list
    methods = [r["method"] for r in report["rows"] if r["method"].startswith("earlyexit")]
    rows = []
    for method, path in zip(methods, report["config"]["drafters"]):
        run = trained[Path(path).parent.name]
        r = method_row(report, method)
        rows.append({"L": run["config"]["drafter"]["exit_layers"][0], "params": run["trainable_params"],
                     "val_tau": run["metrics"].get("val/expected_tau"), "tau": r["tau"], "alpha": r["alpha"],
                     "tok_s": r["tok_per_s"], "speedup": r["speedup_vs_ar"]})
    rows.sort(key=lambda r: r["L"])

    def plot(fig):
        ax1, ax2 = fig.subplots(1, 2)
        L = [r["L"] for r in rows]
        ax1.plot(L, [r["tau"] for r in rows], "o-", label="measured")
        ax1.plot(L, [r["val_tau"] for r in rows], "s--", label="predicted (validation)")
        ax1.set(xlabel="exit layer L", ylabel="τ", title="Tokens per base forward")
        ax1.legend()
        ax2.plot(L, [r["speedup"] for r in rows], "o-")
        ax2.axhline(1.0, color="k", lw=0.8)
        ax2.set(xlabel="exit layer L", ylabel="speedup vs AR (ours)", title="Wall-clock speedup")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3)

    n = report["config"]["base"]
    return Table("Early-exit layer sweep", rows,
                 {"L": "exit layer L", "params": "trainable params", "val_tau": "val τ (predicted)", "tau": "τ",
                  "alpha": "α", "tok_s": "tok/s", "speedup": "× AR (ours)"}, plot,
                 [f"{report['header']['draft']}; base {report['header']['base']} "
                  f"({n.get('num_layers', 30)} layers); each head adds one decoder block after layer L."])


if __name__ == "__main__":
    main("exit_layer", build)
