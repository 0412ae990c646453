"""Table `drafters`: every drafter family trained on the same base, data and step budget, then evaluated next to our
AR loop and the HF peers (Spec-Bench style): on HumanEval and on the non-code question.jsonl, by chain (γ = 4) and by
dynamic tree, four evaluation runs that each time all their methods in one process. Its runs are also the W1 table
(python experiments/w1.py --from logs/experiments/drafters/eval).

    python experiments/drafters.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]

The table trains every family itself at an equal, short budget (180 steps, within the hour). The families' recipes,
each trained to its plateau (configs/experiment/recipe/), take their place in the same evaluation:
    python evaluate.py experiment=drafters/eval 'drafters=[logs/recipe/medusa/drafter,...]'
    python experiments/drafters.py --render
Each row's training columns come from the run beside its drafter dir, whichever trained it."""

from tables import SMOKE_FROM_RAW_CODE, Table, drafter_runs, eval_reports, main

FAMILIES = ("medusa", "hydra", "earlyexit", "prophet")  # the plot's order (method names as evaluate.py gives them)
SETS = ("humaneval", "question")
TREES = ("chain", "dynamic_tree")


def build(root):
    reports = eval_reports(root)
    rows, trained = [], {}
    for prompts in SETS:
        for tree in TREES:
            report = reports.get(f"{prompts}_{tree}")
            runs = drafter_runs(report) if report else {}
            trained.update(runs)
            for r in report["rows"] if report else []:
                run = runs.get(r["method"], {})
                lev = r.get("leviathan", {})
                rows.append({"prompts": prompts, "tree": tree, "method": r["method"],
                             "params": run.get("trainable_params"),
                             "val_tau": run.get("metrics", {}).get("val/expected_tau"), "tau": r["tau"],
                             "alpha": r["alpha"], "c": lev.get("c"), "tok_s": r["tok_per_s"],
                             "vs_ar": r["speedup_vs_ar"], "vs_hf": r["speedup_vs_hf"],
                             "identical": r["greedy_identical"]})

    def plot(fig):
        axes = fig.subplots(1, 2)
        families = [m for m in FAMILIES if any(r["method"] == m for r in rows)]
        combos = [(p, t) for p in SETS for t in TREES]
        width = 0.8 / len(combos)
        for ax, key, label in ((axes[0], "tau", "τ (tokens per base forward)"), (axes[1], "vs_ar", "speedup vs AR (ours)")):
            for j, (prompts, tree) in enumerate(combos):
                by = {r["method"]: r[key] for r in rows if r["prompts"] == prompts and r["tree"] == tree}
                xs = [i + (j - (len(combos) - 1) / 2) * width for i in range(len(families))]
                ax.bar(xs, [by.get(m, float("nan")) for m in families], width, label=f"{prompts}, {tree}")
            ax.set_xticks(range(len(families)), families)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set(ylabel=label)
        axes[0].legend(fontsize=7)
        axes[0].set_title("Acceptance")
        axes[1].set_title("Wall-clock speedup")

    h = next(iter(reports.values()))["header"]
    drafts = sorted({r["header"]["draft"] for r in reports.values()})
    steps = {m: f"{t['global_step']} steps ({t['config']['task_name']})" for m, t in trained.items() if t}
    return Table("Drafter families on one base", rows,
                 {"prompts": "prompts", "tree": "draft", "method": "method", "params": "trainable params",
                  "val_tau": "val τ (predicted)", "tau": "τ", "alpha": "α", "c": "c (draft cost / step)",
                  "tok_s": "tok/s", "vs_ar": "× AR (ours)", "vs_hf": "× HF generate", "identical": "greedy-identical"},
                 plot,
                 [f"Base {h['base']}, {h['prompts'].split(' ')[0]} prompts per set, "
                  f"{' or '.join(drafts)}, T = {h['temperature']}, {h['max_new_tokens']} new tokens, batch 1, "
                  f"{h['device']}. The HF peers have no trees: they run in the chain runs. Training (task): "
                  + ", ".join(f"{k} {v}" for k, v in steps.items())
                  + " (drafters: configs/experiment/drafters/train.yaml; recipe_<family>: "
                  "configs/experiment/recipe/<family>.yaml). c: measured draft cost per drafted token, in AR "
                  "steps (chain runs)."])


if __name__ == "__main__":
    main("drafters", build, smoke_train=SMOKE_FROM_RAW_CODE)
