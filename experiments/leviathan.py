"""Table `leviathan`: α and τ versus the chain length γ for one chain drafter (an early-exit head), measured next to
Leviathan et al.'s τ = (1 − α^{γ+1})/(1 − α) and walltime model speedup = τ/(γc + 1), with the cost ratio c
(one draft step / one base step) measured in the same run.

    python experiments/leviathan.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

from specdec.tables import Table, eval_reports, main, method_row


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
        ax1, ax2 = fig.subplots(1, 2)
        g = [r["gamma"] for r in rows]
        ax1.plot(g, [r["tau"] for r in rows], "o-", label="measured")
        ax1.plot(g, [r["tau_model"] for r in rows], "s--", label="(1 − α^(γ+1))/(1 − α)")
        ax1.set(xlabel="γ", ylabel="τ", title="Tokens per base forward")
        ax2.plot(g, [r["speedup"] for r in rows], "o-", label="measured")
        ax2.plot(g, [r["speedup_model"] for r in rows], "s--", label="τ/(γc + 1)")
        ax2.axhline(1.0, color="k", lw=0.8)
        ax2.set(xlabel="γ", ylabel="speedup vs AR (ours)", title="Wall-clock speedup")
        for ax in (ax1, ax2):
            ax.legend()
            ax.grid(alpha=0.3)

    return Table("Leviathan et al.: τ and speedup vs γ (early-exit chain drafter)", rows,
                 {"gamma": "γ", "alpha": "α", "alpha1": "α₁", "alpha2": "α₂", "tau": "τ measured", "tau_model": "τ model", "c": "c",
                  "speedup": "speedup measured", "speedup_model": "speedup model"}, plot,
                 ["α: accepted / drafted over the run at that γ; the model uses that α (i.i.d. across positions). "
                  "α₁, α₂: acceptance at draft positions 1 and 2 given the earlier ones were accepted. c: measured draft "
                  "time per token × AR tokens/s (same run)."])


if __name__ == "__main__":
    main("leviathan", build)
