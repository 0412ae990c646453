"""Table `best_drafter`: the best recipe against every decoder that needs no training. The prophet recipe
(configs/experiment/best_drafter/train.yaml: 1,500 of its 3,000 steps, on every completion-format code answer
shipped with the general-domain text the base writes itself mixed in) first drafts each shape of eval.yaml (chains
of 1-4, an 11-node tree), each from Q8_0 and from Q4_1 copies of its weights (engine.draft_precision), on HumanEval's
tuning split; the draft whose drafter alone ran fastest against our AR loop there is the one reported, on
HumanEval's reporting split and on the non-code question set, alone and with n-gram lookup rounds, beside lookup
alone, our AR loop and llama.cpp on the same GGUF.

    make features-completions features-general peers
    python experiments/best_drafter.py [--smoke] [--render] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]

eval: overrides go to both evaluation stages (the tuning sweep and the report)."""

from __future__ import annotations

from pathlib import Path

from tables import SMOKE_FROM_RAW_CODE, Table, _run, eval_report_files, eval_reports, main, method_row, spread

NAME = "best_drafter"
AR, LOOKUP, PEERS = "ar (ours)", "lookup (ours)", ("llama_cpp", "llama_cpp_lookup")


def drafter_method(report: dict) -> str:
    """The trained drafter's row name in a report (evaluate names a drafter by its class: prophet)."""
    from specdec.evaluation import drafter_names  # (loads torch: only when a table reads its runs)

    return next(iter(drafter_names(report["config"]["drafters"])))


def choose(tuned: dict[str, dict]) -> str | None:
    """The tuning job (shape/precision) whose drafter alone ran fastest against our AR loop on the tuning split."""
    speed = {job: method_row(r, drafter_method(r), {}).get("speedup_vs_ar") for job, r in tuned.items()}
    ranked = [s for s in speed if speed[s] is not None]  # (a job without the drafter's row)
    return max(ranked, key=speed.get, default=None)


def evaluate(root: Path, overrides: list[str]) -> list[str]:
    """The tuning sweep, then the report with the draft it chose."""
    failed = _run("evaluate.py", f"experiment={NAME}/tune", overrides)
    tuned = eval_reports(root, "tune")
    job = choose(tuned)
    if job is None:
        print(f"[specdec] table {NAME}: no tuning job finished, so no draft to report")
        return failed + ["evaluate.py"]
    chosen = draft_overrides(tuned[job])
    print(f"[specdec] table {NAME}: the tuning split chose {' '.join(chosen)}", flush=True)
    return failed + _run("evaluate.py", f"experiment={NAME}/eval", [*overrides, *chosen])


def draft_overrides(report: dict) -> list[str]:
    """What a report's draft was: its shape and its drafter's weight precision, as evaluate.py overrides."""
    cfg = report["config"]
    return [f"shape={cfg['shape']}", f"engine.draft_precision={cfg['engine']['draft_precision']}"]


def draft_name(report: dict) -> str:
    """The draft column's cell: shape, precision."""
    cfg = report["config"]
    return f"{cfg['shape']}, {cfg['engine']['draft_precision']}"


def build(root: Path) -> Table:
    tuned, reports = eval_reports(root, "tune"), eval_reports(root)
    chosen = choose(tuned)
    rows = []
    for job, r in tuned.items():
        me = method_row(r, drafter_method(r), None)
        if me is not None:
            rows.append({"prompts": "humaneval (tuning split)", "shape": draft_name(r) + " (chosen)" * (job == chosen),
                         "method": me["method"], **_cells(me, r)})
    for prompts, r in reports.items():
        me = drafter_method(r)
        for method in (AR, me, f"{me}+lookup", LOOKUP, *PEERS):
            row = method_row(r, method, None)
            if row is not None:
                rows.append({"prompts": prompts, "shape": draft_name(r) if method.startswith(me) else "—",
                             "method": method, **_cells(row, r)})

    def plot(fig):
        axes = fig.subplots(1, max(1, len(reports)))
        for ax, prompts in zip(axes if len(reports) > 1 else [axes], reports):
            mine = [r for r in rows if r["prompts"] == prompts]
            ax.bar(range(len(mine)), [r["vs_ar_mean"] for r in mine])
            ax.set_xticks(range(len(mine)), [r["method"].replace("_", " ") for r in mine], rotation=30, ha="right")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set(ylabel="speedup vs AR (ours)", title=prompts)
            ax.grid(alpha=0.3, axis="y")

    first = next(iter(tuned.values()), None)
    notes = [f"humaneval (tuning split): {first['header']['prompts']}, {first['header']['max_new_tokens']} new tokens, "
             "one pass per draft (shape, weight precision: engine.draft_precision); the chosen one is the one whose "
             "drafter alone ran fastest there against our AR loop." if first else "no tuning run finished."]
    notes += [f"{prompts}: {_run_line(r)}; speedups: mean ± standard deviation over the passes; × lookup and × "
              "llama.cpp: the ratio of the means (llama.cpp: its plain decode)." for prompts, r in reports.items()]
    notes.append("c: draft time per depth, o: a round's time beyond its verify and draft, both in T_1 (one AR step's "
                 "bare forward, measured in the same run; docs/sampler.md §8).")
    return Table("The best recipe against decoding that needs no training", rows,
                 {"prompts": "prompts", "shape": "draft (shape, precision)", "method": "method", "tau": "τ", "alpha": "α",
                  "c": "c", "o": "o", "tok_s": "tok/s", "vs_ar": "× AR (ours)", "vs_lookup": "× lookup",
                  "vs_llama": "× llama.cpp", "identical": "greedy-identical"}, plot, notes,
                 attach=eval_report_files(root))


def _cells(row: dict, report: dict) -> dict:
    from specdec.evaluation.report import identity_cell  # the report's own cell: yes, n/a, or how many answers agree

    lev = row.get("leviathan", {})
    lookup, llama = method_row(report, LOOKUP, None), method_row(report, "llama_cpp", None)
    return {"tau": row.get("tau"), "alpha": row.get("alpha"), "c": lev.get("c"), "o": lev.get("overhead"),
            "tok_s": row["tok_per_s"], "vs_ar_mean": row["speedup_vs_ar"], "vs_ar": spread(row),
            "vs_lookup": row["speedup_vs_ar"] / lookup["speedup_vs_ar"] if lookup else None,
            "vs_llama": row["tok_per_s"] / llama["tok_per_s"] if llama else None,
            "identical": identity_cell(row)}


def _run_line(report: dict) -> str:
    h = report["header"]
    return f"{h['prompts']}, {h['max_new_tokens']} new tokens, {h['draft']}"


if __name__ == "__main__":
    # the tiny base trains on raw code: it has no feature caches to mix, nor a share of them to cap
    main(NAME, build, smoke_train=(*SMOKE_FROM_RAW_CODE, "~data.mix", "~data.mix_share"), smoke_eval=("passes=1",),
         evaluate=evaluate)
