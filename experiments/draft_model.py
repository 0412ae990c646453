"""Table `draft_model` (Leviathan et al.; llama.cpp's speculative example): the standalone draft model's depth
against its acceptance, its draft cost c and the speedup, with our sampler, with HF
`generate(assistant_model=<the same model>)` and with llama.cpp's server drafting with the same model as GGUF
(`--model-draft`, γ a round). One draft model per depth is trained by the draft model recipe (full vocab, so that
every engine runs the same model); each depth is evaluated in its own job against its own AR run and llama.cpp's
plain decode. The llama.cpp columns need `make peers`. A last row: the shallowest model with staged drafting
(sampler.stage_lookup: n-gram lookup proposes its next tokens, one pass of it checks them), its c against the same
model drafting alone, in one run that takes turns prompt by prompt (`staged`); `--staged` runs that comparison alone
(the trained checkpoint, or `--drafter copy`: the recipe's layers copied from the base, untrained) and adds its row
to the committed table.

    python experiments/draft_model.py [--smoke] [train:KEY=VALUE ...] [eval:KEY=VALUE ...]
    python experiments/draft_model.py --staged [--drafter copy] [--passes 5] [KEY=VALUE ...]"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import shlex
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from specdec.checkpoint import write_json, write_text
from tables import (ROOT, SMOKE_FROM_RAW_CODE, Table, _cell, _run, eval_reports, main, method_row,
                            tau_and_speedup, train_runs, write)

STAGED_LAYERS = 2  # the depth the staged comparison drafts with: the shallowest, the fastest in every engine
STAGE_LOOKUP = 3  # lookup tokens a staged pass may check (sampler.stage_lookup): γ − 1, all a chain of 4 can use
STAGED_PASSES = 5  # rotations over the prompts: c is reported as its mean ± sd over them
SETTINGS = ("ar (ours)", "draft model alone", "draft model, staged")


def build(root):
    trained = train_runs(root)
    rows = []
    for job, report in eval_reports(root).items():
        layers = report["config"]["layers"]
        run = trained.get(f"L{layers}", {})
        metrics = run.get("metrics", {})
        tokens = metrics.get("val/train_tokens")
        r = method_row(report, "draftmodel")
        lev = r.get("leviathan", {})
        hf, lc, lc_draft = (method_row(report, p, {}) for p in ("hf_assisted", "llama_cpp", "llama_cpp_draft"))
        rows.append({"layers": layers, "params": run.get("trainable_params"),
                     "tokens": None if tokens is None else int(tokens), "val_top1": metrics.get("val/draft_top1"),
                     "val_tau": metrics.get("val/expected_tau"), "alpha": r["alpha"],
                     "alpha_token": lev.get("alpha_token"), "tau": r["tau"], "c": lev.get("c"),
                     "v": lev.get("verify_cost"), "tok_s": r["tok_per_s"], "speedup": r["speedup_vs_ar"],
                     "speedup_model": lev.get("predicted_speedup"), "hf_speedup": hf.get("speedup_vs_ar"),
                     "ours_vs_hf": r["tok_per_s"] / hf["tok_per_s"] if hf.get("tok_per_s") else None,
                     "hf_tau": hf.get("tau"), "lc_alpha": lc_draft.get("alpha"),
                     "lc_speedup": lc_draft.get("speedup_vs_ar"),
                     "lc_vs_lc": lc_draft["tok_per_s"] / lc["tok_per_s"] if lc.get("tok_per_s") and lc_draft else None})
    rows.sort(key=lambda r: r["layers"])
    trained_rows = list(rows)  # what the plot draws: the staged row is one setting of one depth

    def plot(fig):
        x = [r["layers"] for r in trained_rows]
        col = lambda key: [r[key] for r in trained_rows]  # noqa: E731
        tau_and_speedup(fig, "draft model layers",
                        [("measured", x, col("tau"), "o-"), ("predicted (validation)", x, col("val_tau"), "s--")],
                        [("our sampler", x, col("speedup"), "o-"), ("τ/(v + γc)", x, col("speedup_model"), "s:"),
                         ("HF assisted, same model", x, col("hf_speedup"), "^-"),
                         ("llama.cpp --model-draft, same model", x, col("lc_speedup"), "v-")])

    header = next(iter(eval_reports(root).values()), {}).get("header", {})
    notes = []
    staged_file = root / "staged" / f"L{STAGED_LAYERS}.json"
    if staged_file.exists():
        result = json.loads(staged_file.read_text())
        rows.append(staged_row(result))
        notes.append(staged_note(result))
    return Table("Standalone draft model: depth vs α, c and speedup; our sampler, HF assisted generation and "
                 "llama.cpp's speculation with the same model", rows,
                 {"layers": "layers", "params": "trainable params", "tokens": "train tokens",
                  "val_top1": "val top-1", "val_tau": "val τ (predicted)", "alpha": "α",
                  "alpha_token": "α per token",
                  "tau": "τ", "c": "c", "v": "v(γ+1)", "tok_s": "tok/s", "speedup": "× AR (ours)",
                  "speedup_model": "τ/(v + γc)", "hf_speedup": "HF assisted × AR (ours)",
                  "ours_vs_hf": "ours / HF assisted", "hf_tau": "HF τ", "lc_alpha": "llama.cpp α",
                  "lc_speedup": "llama.cpp + draft × AR (ours)", "lc_vs_lc": "llama.cpp + draft × llama.cpp"}, plot,
                 [(f"{header['draft']}; base {header['base']}. " if header else "")
                  + "Each depth is its own evaluation job with its own AR baseline (same prompts); HF assisted "
                  "and llama.cpp draft the same number of tokens a round. c: draft time per depth / T_1; τ/(v + γc): "
                  "the speedup predicted from α per token and the costs measured in that job. HF τ: its tokens per "
                  "base forward (its first forward verifies a draft, ours only prefills). llama.cpp α: its accepted "
                  "/ drafted tokens, its own 8-bit-activation arithmetic on both models (docs/sampler.md §7). "
                  "llama.cpp reports 1.8× for a 30B base with a 7B draft.", *notes])


# -- staged drafting: the same draft model with and without sampler.stage_lookup ----------------------------------
def staged(root: Path, overrides: list[str], drafter: str = "trained", passes: int = STAGED_PASSES) -> dict:
    """Our AR loop, the L<STAGED_LAYERS> draft model alone and with staged drafting, on the table's evaluation
    settings (its prompts, γ, T = 0, engine), taking turns prompt by prompt for `passes` passes, the order rotating
    from prompt to prompt; T_1 (one base forward over one token) timed before the runs and after every pass, pooled,
    as evaluate.py does. c of a pass: its drafting seconds (expand + observe) per drafted token / T_1, the report's c.
    drafter: "trained" (the table's checkpoint train/L<layers>) or "copy" (the recipe's layers copied from the base,
    untrained). -> the result, also saved as root/staged/L<layers>.json."""
    import hydra
    import torch
    from hydra import compose, initialize_config_dir

    from specdec.data.prompts import render_chat
    from specdec.drafters.draft_model import DraftModel
    from specdec.engines import build as build_engine
    from specdec.evaluation.report import _device_name
    from specdec.export import load as load_drafter_dir
    from specdec.sampling.cost import forward_times
    from specdec.sampling.decode import generate

    os.environ.setdefault("PROJECT_ROOT", str(ROOT))  # paths.root_dir, as the table's subprocesses get it
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("evaluate", overrides=["experiment=draft_model/eval", f"layers={STAGED_LAYERS}", *overrides])
    torch.manual_seed(cfg.seed)
    base = hydra.utils.instantiate(cfg.base)
    train: dict = {}  # the trained run's own columns of the table
    if drafter == "copy":
        model = DraftModel(base, num_layers=STAGED_LAYERS, init="copy", gamma=cfg.sampler.gamma)
        source = f"{STAGED_LAYERS} layers copied from the base, untrained"
    else:
        model = load_drafter_dir(cfg.drafters[0], base)
        run = train_runs(root).get(f"L{STAGED_LAYERS}", {})
        train = {"params": run.get("trainable_params"), "tokens": run.get("metrics", {}).get("val/train_tokens"),
                 "val_top1": run.get("metrics", {}).get("val/draft_top1"),
                 "val_tau": run.get("metrics", {}).get("val/expected_tau")}
        data = Path(str(run.get("config", {}).get("data", {}).get("path", "?"))).name
        source = f"train/L{STAGED_LAYERS}: {run.get('global_step', '?')} steps on the feature cache {data}"
    sampler = hydra.utils.instantiate(cfg.sampler)
    engine = build_engine(hydra.utils.instantiate(cfg.engine), base.device)
    prompts = [render_chat(base.tokenizer, [{"role": "user", "content": it["turns"][0]}])
               for it in hydra.utils.instantiate(cfg.prompts)]
    settings = {SETTINGS[0]: (None, replace(sampler, lookup_tokens=0)), SETTINGS[1]: (model, sampler),
                SETTINGS[2]: (model, replace(sampler, stage_lookup=STAGE_LOOKUP))}
    for name, (d, s) in settings.items():  # warm-up, untimed
        generate(base, prompts[:1], d, s, engine=engine)
    t1: list[float] = []

    def time_t1(reps: int) -> None:
        t1.extend(forward_times(base, [1], prompt_len=len(prompts[0]), reps=reps, engine=engine, greedy=True)[1])

    time_t1(5)
    runs = {name: [[] for _ in range(passes)] for name in settings}  # setting -> pass -> one dict per prompt
    for p in range(passes):
        for i, prompt in enumerate(prompts):
            k = (p * len(prompts) + i) % len(settings)
            for name in [*settings][k:] + [*settings][:k]:
                d, s = settings[name]
                r = generate(base, [prompt], d, s, engine=engine)
                runs[name][p].append({"tokens": r.tokens[0, : r.num_generated[0]].tolist(), "seconds": r.total_s,
                                      "draft_s": sum(r.step_draft_s), "accepted": sum(r.accepted[0]),
                                      "drafted": sum(r.drafted[0]), "rounds": len(r.accepted[0]),
                                      "passes": sum(r.draft_passes)})
        time_t1(2)
        print(f"[specdec] staged comparison: pass {p + 1} of {passes} done", flush=True)
    t1_s = statistics.median(t1)

    def per_pass(name: str, f) -> list[float]:
        return [f(runs[name][p]) for p in range(passes)]

    def tok_s(rs: list[dict]) -> float:
        return sum(len(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs)

    ar = per_pass(SETTINGS[0], tok_s)
    out = {"layers": STAGED_LAYERS, "drafter": source, "train": train, "stage_lookup": STAGE_LOOKUP, "passes": passes,
           "prompts": len(prompts), "gamma": sampler.gamma, "max_new_tokens": sampler.max_new_tokens, "t1_s": t1_s,
           "date": datetime.date.today().isoformat(),
           "machine": f"{_device_name(base.device)}, {torch.get_num_threads()} threads", "settings": {}}
    ar_flat = [r for rs in runs[SETTINGS[0]] for r in rs]
    for name in settings:
        flat = [r for rs in runs[name] for r in rs]
        rounds = sum(r["rounds"] for r in flat)
        row = {"tok_s": per_pass(name, tok_s), "speedup": [t / a for t, a in zip(per_pass(name, tok_s), ar)],
               "identical": all(r["tokens"] == a["tokens"] for r, a in zip(flat, ar_flat))}
        if name != SETTINGS[0]:
            c = per_pass(name, lambda rs: sum(r["draft_s"] for r in rs) / sum(r["drafted"] for r in rs) / t1_s)
            row |= {"c": c,
                    "alpha": sum(r["accepted"] for r in flat) / sum(r["drafted"] for r in flat),
                    "tau": (sum(r["accepted"] for r in flat) + rounds) / rounds,
                    "passes_per_round": sum(r["passes"] for r in flat) / rounds}
        out["settings"][name] = row
    (root / "staged").mkdir(parents=True, exist_ok=True)
    write_json(root / "staged" / f"L{STAGED_LAYERS}.json", out)
    return out


def _spread(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.2f}" + (f" ± {statistics.stdev(xs):.2f}" if len(xs) > 1 else "")


def staged_row(result: dict) -> dict:
    """The table's row of the staged comparison: the staged setting, with the model alone in parentheses."""
    alone, st = result["settings"][SETTINGS[1]], result["settings"][SETTINGS[2]]
    tokens = result["train"].get("tokens")
    return {"layers": f"{result['layers']}, staged (lookup ≤ {result['stage_lookup']} a pass)",
            **result["train"], "tokens": None if tokens is None else int(tokens),
            "alpha": st["alpha"], "tau": st["tau"], "c": f"{_spread(st['c'])} (alone {_spread(alone['c'])})",
            "tok_s": statistics.mean(st["tok_s"]),
            "speedup": f"{_spread(st['speedup'])} (alone {_spread(alone['speedup'])})"}


def staged_note(result: dict) -> str:
    alone, st = result["settings"][SETTINGS[1]], result["settings"][SETTINGS[2]]
    return (f"Staged row: the draft model ({result['drafter']}) with sampler.stage_lookup={result['stage_lookup']} "
            f"(n-gram lookup proposes its next tokens, one pass of it checks them) against itself alone, one run of "
            f"{result['prompts']} prompts × {result['passes']} passes taking turns prompt by prompt; c and × AR as "
            f"mean ± sd over the passes; drafter passes a round {st['passes_per_round']:.2f} against "
            f"{alone['passes_per_round']:.2f}; greedy-identical to the AR loop: "
            f"{'yes' if st['identical'] and alone['identical'] else 'no'}; {result['date']}, {result['machine']}.")


def staged_only(argv: list[str]) -> None:
    """--staged: the staged comparison alone (`staged`), written as results/draft_model/draft_model_staged.md (its own
    command, date and machine), and its row put in the committed table (draft_model.md and .csv), replacing an
    earlier staged row."""
    ap = argparse.ArgumentParser(description="the staged-drafting comparison of the `draft_model` table alone")
    ap.add_argument("--staged", action="store_true", required=True)
    ap.add_argument("--drafter", choices=("trained", "copy"), default="trained")
    ap.add_argument("--passes", type=int, default=STAGED_PASSES)
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "draft_model"))
    ap.add_argument("overrides", nargs="*", help="evaluate.py overrides (paths.log_dir=..., prompts.limit=...)")
    args = ap.parse_args(argv)
    log_dir = next((o.split("=", 1)[1] for o in reversed(args.overrides) if o.startswith("paths.log_dir=")),
                   str(ROOT / "logs"))
    result = staged(Path(log_dir) / "experiments" / "draft_model", args.overrides, args.drafter, args.passes)
    command = shlex.join(["python", "experiments/draft_model.py", *argv])
    out = Path(args.out)
    rows = [{"setting": name, **{k: (_spread(v) if isinstance(v, list) else v) for k, v in row.items()}}
            for name, row in result["settings"].items()]
    write(out, "draft_model_staged", Table(
        f"Staged drafting: the {result['layers']}-layer draft model ({result['drafter']}) with and without n-gram "
        f"lookup proposing its next tokens", rows,
        {"setting": "setting", "passes_per_round": "drafter passes / round", "c": "c", "alpha": "α", "tau": "τ",
         "tok_s": "tok/s", "speedup": "× AR (ours)", "identical": "greedy-identical"}, _staged_plot(result),
        [f"chain γ={result['gamma']}, T = 0, {result['prompts']} HumanEval prompts, {result['max_new_tokens']} new "
         f"tokens; staged: sampler.stage_lookup={result['stage_lookup']}. One run, the settings taking turns prompt by "
         f"prompt (the order rotating), {result['passes']} passes; c (drafting seconds per drafted token / T_1, T_1 "
         f"timed between the passes, pooled), tok/s and × AR as mean ± sd over the passes."]),
        command, result["date"], result["machine"])
    _put_row(out, staged_row(result), staged_note(result))


def _staged_plot(result: dict):
    """c and × AR of each setting, mean and sd over the passes."""
    def plot(fig):
        ax1, ax2 = fig.subplots(1, 2)
        drafted = SETTINGS[1:]
        for ax, key, names, label in ((ax1, "c", drafted, "c (draft time per drafted token / T_1)"),
                                      (ax2, "speedup", SETTINGS, "× AR (ours)")):
            vals = [result["settings"][n][key] for n in names]
            ax.bar(range(len(names)), [statistics.mean(v) for v in vals],
                   yerr=[statistics.stdev(v) if len(v) > 1 else 0 for v in vals], capsize=4)
            ax.set_xticks(range(len(names)), names, fontsize=8)
            ax.set(ylabel=label)
            ax.grid(alpha=0.3, axis="y")
    return plot


def _put_row(out: Path, row: dict, note: str) -> None:
    """The staged row and its note into the committed table draft_model.md and .csv, in place of earlier ones."""
    md_path, csv_path = out / "draft_model.md", out / "draft_model.csv"
    lines = md_path.read_text().splitlines()
    header = next(l for l in lines if l.startswith("| layers |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    keys = next(csv.reader(io.StringIO(csv_path.read_text())))  # the row keys, in the columns' order
    assert len(keys) == len(columns), "draft_model.csv and .md disagree"
    staged_cell = row["layers"].split(" (")[0]
    lines = [l for l in lines if not l.startswith(f"| {staged_cell}") and not l.startswith("Staged row:")]
    last = max(i for i, l in enumerate(lines) if l.startswith("|"))
    lines.insert(last + 1, "| " + " | ".join(_cell(row.get(k)) for k in keys) + " |")
    notes = max(i for i, l in enumerate(lines) if l and not l.startswith(("|", "!")))  # the table's last note
    lines.insert(notes + 1, note)
    write_text(md_path, "\n".join(lines) + "\n")
    kept = [r for r in csv.DictReader(io.StringIO(csv_path.read_text())) if not r["layers"].startswith(staged_cell)]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
    w.writeheader()
    w.writerows([*kept, row])
    write_text(csv_path, buf.getvalue())


def evaluate_then_stage(root: Path, overrides: list[str]) -> list[str]:
    """The table's evaluation sweep, then the staged comparison with the trained L<STAGED_LAYERS> model."""
    failed = _run("evaluate.py", "experiment=draft_model/eval", overrides)
    if f"L{STAGED_LAYERS}" not in train_runs(root):  # its training job failed: the table goes on without the row
        return [*failed, "the staged comparison (no trained L2 model)"]
    staged(root, overrides)
    return failed


if __name__ == "__main__":
    if "--staged" in sys.argv:
        staged_only(sys.argv[1:])
    else:
        # HF assisted runs in the smoke too; the staged comparison does not (the smoke's table keeps its three rows)
        main("draft_model", build, smoke_train=SMOKE_FROM_RAW_CODE, smoke_eval=("peers=[hf_assisted]",),
             evaluate=None if "--smoke" in sys.argv else evaluate_then_stage)
