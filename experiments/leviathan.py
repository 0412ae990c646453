"""Table `leviathan`: α and τ versus the chain length γ for one chain drafter (an early-exit head), measured next to
Leviathan et al.'s τ = (1 − α^{γ+1})/(1 − α) and the walltime model with the real verify cost,
speedup = τ/(v(γ+1) + γc) (SPEC.md §8); v(γ+1) = T_{γ+1}/T_1 and c = draft time per depth / T_1 are measured in
the same run. The paper's τ/(γc + 1) (a verify costs one base step) is shown next to it.

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
                     "v": lev["verify_cost"], "speedup_model": lev["predicted_speedup"],
                     "speedup_unit": lev["predicted_speedup_unit_verify"]})
    rows.sort(key=lambda r: r["gamma"])

    def plot(fig):
        g = [r["gamma"] for r in rows]
        col = lambda key: [r[key] for r in rows]  # noqa: E731
        tau_and_speedup(fig, "γ",
                        [("measured", g, col("tau"), "o-"), ("(1 − α^(γ+1))/(1 − α)", g, col("tau_model"), "s--")],
                        [("measured", g, col("speedup"), "o-"), ("τ/(v(γ+1) + γc)", g, col("speedup_model"), "s--"),
                         ("τ/(γc + 1)", g, col("speedup_unit"), "^:")])

    return Table("Leviathan et al.: τ and speedup vs γ (early-exit chain drafter)", rows,
                 {"gamma": "γ", "alpha": "α", "alpha1": "α₁", "alpha2": "α₂", "tau": "τ measured", "tau_model": "τ model", "c": "c",
                  "v": "v(γ+1)", "speedup": "speedup measured", "speedup_model": "speedup model",
                  "speedup_unit": "τ/(γc + 1)"}, plot,
                 ["α: accepted / drafted over the run at that γ; the model uses that α (i.i.d. across positions). "
                  "α₁, α₂: acceptance at draft positions 1 and 2 given the earlier ones were accepted. c: measured draft "
                  "time per depth / T_1; v(γ+1): one base forward over γ+1 tokens / over 1 token (same run). The model "
                  "column uses v; τ/(γc + 1) is the paper's, which charges a verify as one base step."])


if __name__ == "__main__":
    main("leviathan", build)
