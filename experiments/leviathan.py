"""Table `leviathan`: α and τ versus the chain length γ for one chain drafter (an early-exit head), measured next to
Leviathan et al.'s τ = (1 − α^{γ+1})/(1 − α) and walltime model speedup = τ/(γc + 1), with the cost ratio c
(one draft step / one base step) measured in the same run.

    python experiments/leviathan.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

from specdec.tables import Table, eval_reports, main, method_row, tau_and_speedup


def build(root):
    rows = []
    for report in eval_reports(root).values():
        r = method_row(report, "earlyexit")
        lev = r["leviathan"]
        alpha_i = r["alpha_i"] + [float("nan")] * 2  # conditional acceptance at draft positions 1, 2, ...
        rows.append({"gamma": lev["gamma"], "alpha": r["alpha"], "alpha1": alpha_i[0], "alpha2": alpha_i[1],
                     "tau": lev["measured_tau"],
                     "tau_model": lev["predicted_tau"], "c": lev["c"], "speedup": lev["measured_speedup"],
                     "speedup_model": lev["predicted_speedup"]})
    rows.sort(key=lambda r: r["gamma"])

    def plot(fig):
        g = [r["gamma"] for r in rows]
        col = lambda key: [r[key] for r in rows]  # noqa: E731
        tau_and_speedup(fig, "γ",
                        [("measured", g, col("tau"), "o-"), ("(1 − α^(γ+1))/(1 − α)", g, col("tau_model"), "s--")],
                        [("measured", g, col("speedup"), "o-"), ("τ/(γc + 1)", g, col("speedup_model"), "s--")])

    return Table("Leviathan et al.: τ and speedup vs γ (early-exit chain drafter)", rows,
                 {"gamma": "γ", "alpha": "α", "alpha1": "α₁", "alpha2": "α₂", "tau": "τ measured", "tau_model": "τ model", "c": "c",
                  "speedup": "speedup measured", "speedup_model": "speedup model"}, plot,
                 ["α: accepted / drafted over the run at that γ; the model uses that α (i.i.d. across positions). "
                  "α₁, α₂: acceptance at draft positions 1 and 2 given the earlier ones were accepted. c: measured draft "
                  "time per token × AR tokens/s (same run)."])


if __name__ == "__main__":
    main("leviathan", build)
