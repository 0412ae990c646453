"""Table `self_speculative` (Draft & Verify, Zhang et al. 2023): the base drafts for itself with some of its layers
skipped. The skip ratio against α and speedup, and the skip set found by Bayesian optimisation against a uniform
(evenly spaced) set. Nothing is trained: each "training" job measures one skip set on calibration prompts (the
searched one picks the set maximising the predicted speedup); the evaluation runs them all on HumanEval against one
AR run.

    python experiments/self_speculative.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

import json
from pathlib import Path

from specdec.checkpoint import read_meta
from tables import Table, eval_reports, main, method_row, train_runs


def build(root):
    trained, report = train_runs(root), eval_reports(root).get("")
    if report is None:
        return Table("Draft & Verify: skipped layers vs α and speedup", [], {})
    # evaluate names repeated drafter classes layerskip, layerskip#1, ... in the order of its drafters list
    methods = [r["method"] for r in report["rows"] if r["method"].startswith("layerskip")]
    calibrations = {Path(p).parent.name: json.loads((Path(p).parent / "calibration.json").read_text())
                    for p in report["config"]["drafters"]}
    # the base's depth: c was timed for 0..n executed layers
    n = len(next(iter(calibrations.values()))["draft_cost_by_executed_layers"]) - 1 if calibrations else None
    # The search's trials, best per number of skipped layers: at one size c is the same, so the best set is the one
    # with the highest α. Set against the uniform set of that size on the same calibration prompts.
    search = next((c for job, c in calibrations.items() if trained[job]["config"]["drafter"]["uniform"] is None), {})
    best_of_size: dict[int, dict] = {}
    for t in search.get("trials", []):
        k = len(t["skip_layers"])
        if k not in best_of_size or t["alpha"] > best_of_size[k]["alpha"]:
            best_of_size[k] = t
    rows = []
    for method, path in zip(methods, report["config"]["drafters"]):
        run, r = trained[Path(path).parent.name], method_row(report, method)
        skip = read_meta(path)["hparams"]["skip_layers"]
        calib = calibrations[Path(path).parent.name]
        searched = run["config"]["drafter"]["uniform"] is None
        lev, same = r.get("leviathan", {}), best_of_size.get(len(skip))
        rows.append({"set": "searched (TPE)" if searched else "uniform", "skipped": len(skip),
                     "ratio": len(skip) / n if n else None, "layers": " ".join(map(str, skip)),
                     "trials": len(calib["trials"]), "calib_alpha": run["metrics"]["val/alpha"],
                     "calib_speedup": run["metrics"]["val/predicted_speedup"], "alpha": r["alpha"],
                     "alpha_token": lev.get("alpha_token"), "tau": r["tau"], "c": lev.get("c"),
                     "v": lev.get("verify_cost"), "speedup_model": lev.get("predicted_speedup"),
                     "speedup": r["speedup_vs_ar"],
                     "searched_alpha": None if searched or same is None else same["alpha"],
                     "searched_layers": None if searched or same is None else " ".join(map(str, same["skip_layers"]))})
    rows.sort(key=lambda r: (r["skipped"], r["set"] != "uniform"))

    def plot(fig):
        ax1, ax2 = fig.subplots(1, 2)
        for kind, style in (("uniform", "o-"), ("searched (TPE)", "r*")):
            sel = [r for r in rows if r["set"] == kind]
            x = [r["skipped"] for r in sel]
            ax1.plot(x, [r["alpha"] for r in sel], style, ms=10 if "*" in style else 6, label=f"{kind}, HumanEval")
            ax1.plot(x, [r["calib_alpha"] for r in sel], style.replace("-", "--"), alpha=0.5,
                     label=f"{kind}, calibration")
            ax2.plot(x, [r["speedup"] for r in sel], style, ms=10 if "*" in style else 6, label=f"{kind}, measured")
            ax2.plot(x, [r["speedup_model"] for r in sel], style.replace("-", ":"), alpha=0.5,
                     label=f"{kind}, τ/(v + γc)")
        ax1.set(xlabel="layers skipped", ylabel="α", title="Acceptance")
        ax2.axhline(1.0, color="k", lw=0.8)
        ax2.set(xlabel="layers skipped", ylabel="speedup vs AR (ours)", title="Wall-clock speedup")
        for ax in (ax1, ax2):
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)

    best = max(rows, key=lambda r: r["speedup"], default=None)
    return Table("Draft & Verify: skipped layers vs α and speedup, searched vs uniform skip sets", rows,
                 {"set": "skip set", "skipped": "skipped", "ratio": "ratio", "layers": "layers skipped",
                  "trials": "sets tried", "calib_alpha": "α calib.", "calib_speedup": "predicted × (calib.)",
                  "alpha": "α", "alpha_token": "α per token", "tau": "τ", "c": "c", "v": "v(γ+1)",
                  "speedup_model": "τ/(v + γc)", "speedup": "× AR (ours)",
                  "searched_layers": "search's best set of that size", "searched_alpha": "its α calib."}, plot,
                 [f"{report['header']['draft']}; base {report['header']['base']} ({n} layers). α calib. and "
                  "predicted × (calib.): the search's own measurement on its calibration prompts (held-out stdlib "
                  "code continued by the base), the objective it maximised. α, τ, c (draft time per depth / T_1), "
                  "v(γ+1) and × AR: HumanEval, all skip sets against one AR run; τ/(v + γc) predicts the speedup "
                  "from α per token with the costs measured in the same run. The last two columns: among the search's "
                  "trials, the set of the row's size with the highest calibration α (same size, same c: the set it "
                  "would pick at that ratio), next to the uniform set's α calib."
                  + (f" Fastest: {best['set']}, {best['skipped']} layers skipped, {best['speedup']:.2f}× our AR."
                     if best else "")])


if __name__ == "__main__":
    # a few search trials on two short calibration prompts
    main("self_speculative", build, smoke_train=("drafter.search.trials=6", "drafter.search.startup_trials=2",
                                                 "drafter.search.prompts=2", "drafter.search.max_new_tokens=8",
                                                 "drafter.search.cost_reps=1"))
