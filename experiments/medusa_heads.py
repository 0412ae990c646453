"""Table `medusa_heads` (Medusa paper ablation): the number of Medusa heads k = 1..5 drafting a chain (γ = k) or a
dynamic tree of depth k, τ and speedup. One 5-head drafter is trained; its first k heads are the k-head drafter
(heads share no trainable weights).

    python experiments/medusa_heads.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

from specdec.tables import Table, eval_reports, main, method_row, tau_and_speedup


def build(root):
    rows = []
    for job, report in eval_reports(root).items():
        r = method_row(report, "medusa")
        rows.append({"heads": report["config"]["heads"], "draft": report["header"]["draft"], "tau": r["tau"],
                     "alpha": r["alpha"], "tok_s": r["tok_per_s"], "speedup": r["speedup_vs_ar"],
                     "tree": report["config"]["sampler"]["tree"]})
    rows.sort(key=lambda r: (r["tree"], r["heads"]))

    def plot(fig):
        trees = {t: [r for r in rows if r["tree"] == t] for t in sorted({r["tree"] for r in rows})}
        line = lambda key: [(t, [r["heads"] for r in sel], [r[key] for r in sel], "o-")  # noqa: E731
                            for t, sel in trees.items()]
        tau_and_speedup(fig, "Medusa heads k", line("tau"), line("speedup"))

    return Table("Medusa heads × chain vs tree", rows,
                 {"heads": "heads k", "draft": "draft", "tau": "τ", "alpha": "α", "tok_s": "tok/s",
                  "speedup": "× AR (ours)"}, plot,
                 ["Each row is its own evaluation run with its own AR baseline (same prompts)."])


if __name__ == "__main__":
    main("medusa_heads", build)
