"""Table `general_domain`: does the general-domain text the base writes itself (make distill-general) make a trained
drafter useful off code? The demo's heads (configs/experiment/demo.yaml) trained twice for the same steps: on the
completion-format code answers alone, and on those with the general-domain answers mixed in (data.mix); both drafting
as make demo drafts, beside n-gram lookup alone and our AR loop, on HumanEval's reporting split and on the non-code
experiments/prompts/question.jsonl, in one evaluation per prompt set.

    make features-general          # the general-domain text's feature cache, once (resumable)
    python -m specdec.data.features 'data.source.kinds=[complete]' out_dir='${paths.cache_dir}/features/stdlib_complete'
    python experiments/general_domain.py [--smoke] [--render] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]"""

from __future__ import annotations

from pathlib import Path

from tables import SMOKE_FROM_RAW_CODE, Table, eval_report_files, eval_reports, main, method_row, spread, train_runs

NAME = "general_domain"
# training run (train.yaml's train_on) -> its method name: evaluate names the drafters hydra, hydra#1 in the order
# eval.yaml lists them
METHODS = {"code": "hydra", "code_general": "hydra#1"}
LOOKUP = "lookup (ours)"


def build(root: Path) -> Table:
    trained, reports = train_runs(root), eval_reports(root)
    rows = []
    for run, method in METHODS.items():
        t = trained.get(run, {})
        for prompts, report in reports.items():
            heads, lookup = method_row(report, method, None), method_row(report, LOOKUP, None)
            both = method_row(report, f"{method}+lookup", None)
            if heads is None:
                continue
            rows.append({
                "train": run.replace("_", " + "), "steps": t.get("global_step"),
                "val_tau": t.get("metrics", {}).get("val/expected_tau"), "prompts": prompts,
                "tau": heads["tau"], "alpha": heads.get("alpha"), "speedup": spread(heads),
                "vs_lookup": heads["speedup_vs_ar"] / lookup["speedup_vs_ar"] if lookup else None,
                "lookup": spread(lookup), "with_lookup": spread(both)})

    def plot(fig):
        ax1, ax2 = fig.subplots(1, 2)
        sets = list(reports)
        for run in METHODS:
            mine = {r["prompts"]: r for r in rows if r["train"] == run.replace("_", " + ")}
            label = run.replace("_", " + ")
            ax1.plot(sets, [mine.get(s, {}).get("tau") for s in sets], "o-", label=label)
            ax2.plot(sets, [method_row(reports[s], METHODS[run], {}).get("speedup_vs_ar") for s in sets], "o-",
                     label=label)
        ax2.plot(sets, [method_row(reports[s], LOOKUP, {}).get("speedup_vs_ar") for s in sets], "k--", label="lookup")
        ax1.set(xlabel="prompts", ylabel="τ", title="Heads alone: tokens per base forward")
        ax2.axhline(1.0, color="k", lw=0.8)
        ax2.set(xlabel="prompts", ylabel="speedup vs AR (ours)", title="Wall-clock speedup")
        for ax in (ax1, ax2):
            ax.legend()
            ax.grid(alpha=0.3)

    notes = [f"{job}: {r['header']['draft']}; prompts {r['header']['prompts']}, {r['header']['max_new_tokens']} new "
             "tokens; speedups: mean ± standard deviation over the passes; heads × lookup: the ratio of their means."
             for job, r in reports.items()]
    return Table("The demo's heads trained on code alone and with the base's own general-domain answers", rows,
                 {"train": "trained on", "steps": "steps", "val_tau": "val τ (predicted)",
                  "prompts": "prompts", "tau": "τ", "alpha": "α", "speedup": "heads × AR (ours)",
                  "vs_lookup": "heads × lookup", "lookup": "lookup × AR", "with_lookup": "heads + lookup × AR"},
                 plot, notes, attach=eval_report_files(root))


if __name__ == "__main__":
    # the tiny base trains on raw code both times: it has no feature caches to mix
    main(NAME, build, smoke_train=(*SMOKE_FROM_RAW_CODE, "~data.mix"), smoke_eval=("passes=1",))
