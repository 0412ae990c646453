"""Table `exit_layer` (LayerSkip / self-speculative decoding): an early-exit head at layer L of the base, trained
for each L on the same budget; τ and speedup versus L, all against one AR run.

    python experiments/exit_layer.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

from pathlib import Path

from specdec.tables import Table, eval_reports, main, method_row, tau_and_speedup, train_runs


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
        L = [r["L"] for r in rows]
        col = lambda key: [r[key] for r in rows]  # noqa: E731
        tau_and_speedup(fig, "exit layer L",
                        [("measured", L, col("tau"), "o-"), ("predicted (validation)", L, col("val_tau"), "s--")],
                        [("measured", L, col("speedup"), "o-")])

    n = report["config"]["base"]
    return Table("Early-exit layer sweep", rows,
                 {"L": "exit layer L", "params": "trainable params", "val_tau": "val τ (predicted)", "tau": "τ",
                  "alpha": "α", "tok_s": "tok/s", "speedup": "× AR (ours)"}, plot,
                 [f"{report['header']['draft']}; base {report['header']['base']} "
                  f"({n.get('num_layers', 30)} layers); each head adds one decoder block after layer L."])


if __name__ == "__main__":
    main("exit_layer", build)
