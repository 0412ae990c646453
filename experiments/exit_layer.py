"""Table `exit_layer` (LayerSkip / Kangaroo): an early-exit head at layer L of the base, trained by the early-exit
recipe for each L on the same budget; α, c, τ and speedup versus L, all against one AR run, and the L that
maximises the speedup named.

    python experiments/exit_layer.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

from pathlib import Path

from tables import SMOKE_FROM_RAW_CODE, Table, eval_reports, main, method_row, tau_and_speedup, train_runs


def build(root):
    trained, report = train_runs(root), eval_reports(root)[""]
    # evaluate names repeated drafter classes earlyexit, earlyexit#1, ... in the order of its drafters list
    methods = [r["method"] for r in report["rows"] if r["method"].startswith("earlyexit")]
    rows = []
    for method, path in zip(methods, report["config"]["drafters"]):
        run = trained[Path(path).parent.name]
        r = method_row(report, method)
        lev = r.get("leviathan", {})
        rows.append({"L": run["config"]["drafter"]["exit_layers"][0], "params": run["trainable_params"],
                     "val_top1": next((v for k, v in run["metrics"].items() if k.endswith("_top1")), None),
                     "val_tau": run["metrics"].get("val/expected_tau"), "tau": r["tau"], "alpha": r["alpha"],
                     "alpha_token": lev.get("alpha_token"), "c": lev.get("c"), "tok_s": r["tok_per_s"],
                     "speedup": r["speedup_vs_ar"], "speedup_model": lev.get("predicted_speedup")})
    rows.sort(key=lambda r: r["L"])
    best = max(rows, key=lambda r: r["speedup"], default=None)

    def plot(fig):
        L = [r["L"] for r in rows]
        col = lambda key: [r[key] for r in rows]  # noqa: E731
        tau_and_speedup(fig, "exit layer L",
                        [("measured", L, col("tau"), "o-"), ("predicted (validation)", L, col("val_tau"), "s--")],
                        [("measured", L, col("speedup"), "o-"), ("τ/(v + γc)", L, col("speedup_model"), "s:")])

    n = report["config"]["base"]
    notes = [f"{report['header']['draft']}; base {report['header']['base']} ({n.get('num_layers', 30)} layers); each "
             "head adds one decoder block after layer L. c: draft time per token / T_1; τ/(v + γc): the speedup "
             "predicted from α per token and the costs measured in the same run."]
    if best is not None:
        notes.append(f"The exit that maximises the measured speedup: L = {best['L']} ({best['speedup']:.2f}× our AR).")
    return Table("Early-exit layer sweep", rows,
                 {"L": "exit layer L", "params": "trainable params", "val_top1": "val top-1",
                  "val_tau": "val τ (predicted)", "tau": "τ", "alpha": "α", "alpha_token": "α per token", "c": "c",
                  "tok_s": "tok/s", "speedup": "× AR (ours)", "speedup_model": "τ/(v + γc)"}, plot, notes)


if __name__ == "__main__":
    main("exit_layer", build, smoke_train=SMOKE_FROM_RAW_CODE)
