"""Table `drafters`: every drafter family trained on the same base, data and step budget, then evaluated in one run
next to our AR loop and the HF peers (Spec-Bench style; HumanEval by default, or eval:prompts=jsonl
eval:prompts.path=<Spec-Bench question.jsonl>).

    python experiments/drafters.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

from specdec.tables import Table, eval_reports, main, train_runs

RUN = {"medusa": "medusa", "hydra": "hydra", "earlyexit": "early_exit", "prophet": "prophet"}  # method -> train run


def build(root):
    trained, report = train_runs(root), eval_reports(root)[""]
    rows = []
    for r in report["rows"]:
        run = trained.get(RUN.get(r["method"], ""), {})
        rows.append({"method": r["method"], "params": run.get("trainable_params"),
                     "val_tau": run.get("metrics", {}).get("val/expected_tau"), "tau": r["tau"], "alpha": r["alpha"],
                     "tok_s": r["tok_per_s"], "vs_ar": r["speedup_vs_ar"], "vs_hf": r["speedup_vs_hf"],
                     "identical": r["greedy_identical"]})

    def plot(fig):
        names = [r["method"] for r in rows]
        ax1, ax2 = fig.subplots(1, 2)
        ax1.bar(names, [r["vs_ar"] for r in rows], color="#3a7")
        ax1.axhline(1.0, color="k", lw=0.8)
        ax1.set(ylabel="speedup vs AR (ours)", title="Wall-clock speedup")
        drafted = [r for r in rows if r["val_tau"] is not None]
        ax2.bar([r["method"] for r in drafted], [r["tau"] for r in drafted], color="#37a", label="measured τ")
        ax2.scatter([r["method"] for r in drafted], [r["val_tau"] for r in drafted], color="k", zorder=3,
                    label="predicted τ (validation)")
        ax2.set(ylabel="τ (tokens per base forward)", title="Acceptance")
        ax2.legend()
        for ax in (ax1, ax2):
            ax.tick_params(axis="x", rotation=30)

    h = report["header"]
    return Table("Drafter families on one base", rows,
                 {"method": "method", "params": "trainable params", "val_tau": "val τ (predicted)", "tau": "τ",
                  "alpha": "α", "tok_s": "tok/s", "vs_ar": "× AR (ours)", "vs_hf": "× HF generate",
                  "identical": "greedy-identical"}, plot,
                 [f"Base {h['base']}, {h['prompts']} prompts, {h['draft']}, T = {h['temperature']}, "
                  f"{h['max_new_tokens']} new tokens, {h['device']}. Training: "
                  f"{next(iter(trained.values()))['global_step']} steps each (see configs/experiment/drafters/)."])


if __name__ == "__main__":
    main("drafters", build)
