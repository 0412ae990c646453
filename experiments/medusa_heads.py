"""Table `medusa_heads` (Medusa paper ablation): the number of Medusa heads k = 1..5 drafting a chain (γ = k) or a
dynamic tree of depth k, τ and speedup. One 5-head drafter is trained; its first k heads are the k-head drafter
(heads share no trainable weights).

    python experiments/medusa_heads.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

from specdec.tables import Table, eval_reports, main, method_row


def build(root):
    rows = []
    for job, report in eval_reports(root).items():
        r = method_row(report, "medusa")
        rows.append({"heads": report["config"]["heads"], "draft": report["header"]["draft"], "tau": r["tau"],
                     "alpha": r["alpha"], "tok_s": r["tok_per_s"], "speedup": r["speedup_vs_ar"],
                     "tree": report["config"]["sampler"]["tree"]})
    rows.sort(key=lambda r: (r["tree"], r["heads"]))

    def plot(fig):
        ax1, ax2 = fig.subplots(1, 2)
        for tree in sorted({r["tree"] for r in rows}):
            sel = [r for r in rows if r["tree"] == tree]
            ax1.plot([r["heads"] for r in sel], [r["tau"] for r in sel], "o-", label=tree)
            ax2.plot([r["heads"] for r in sel], [r["speedup"] for r in sel], "o-", label=tree)
        ax1.set(xlabel="Medusa heads k", ylabel="τ", title="Tokens per base forward")
        ax2.axhline(1.0, color="k", lw=0.8)
        ax2.set(xlabel="Medusa heads k", ylabel="speedup vs AR (ours)", title="Wall-clock speedup")
        for ax in (ax1, ax2):
            ax.legend()
            ax.grid(alpha=0.3)

    return Table("Medusa heads × chain vs tree", rows,
                 {"heads": "heads k", "draft": "draft", "tau": "τ", "alpha": "α", "tok_s": "tok/s",
                  "speedup": "× AR (ours)"}, plot,
                 ["Each row is its own evaluation run with its own AR baseline (same prompts)."])


if __name__ == "__main__":
    main("medusa_heads", build)
