"""Table `medusa_heads` (Medusa paper ablation): the number of Medusa heads k = 1..5 drafting a chain (γ = k) or a
dynamic tree of depth k, τ and speedup. One 5-head drafter is trained; its first k heads are the k-head drafter
(heads share no trainable weights).

    python experiments/medusa_heads.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

from tables import SMOKE_FROM_RAW_CODE, Table, eval_reports, main, method_row, tau_and_speedup, train_runs


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

    notes = ["Each row is its own evaluation run with its own AR baseline (same prompts)."]
    run = train_runs(root).get("K5")
    if run:  # what the heads learned offline: head k's top-1 agreement with the base's token t+k+1
        m = run["metrics"]
        top1 = [m[f"val/head{k}_top1"] for k in range(1, 6) if f"val/head{k}_top1" in m]
        notes.append(f"The drafter: {run['global_step']} steps, {m.get('val/train_tokens', 0):,.0f} training tokens; "
                     f"validation top-1 of heads 1..{len(top1)}: {' / '.join(f'{t:.2f}' for t in top1)}, predicted "
                     f"chain τ (greedy, all heads) {m.get('val/expected_tau_greedy', float('nan')):.2f}.")
    return Table("Medusa heads × chain vs tree", rows,
                 {"heads": "heads k", "draft": "draft", "tau": "τ", "alpha": "α", "tok_s": "tok/s",
                  "speedup": "× AR (ours)"}, plot, notes)


if __name__ == "__main__":
    main("medusa_heads", build, smoke_train=SMOKE_FROM_RAW_CODE)
