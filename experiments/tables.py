"""The runner behind every paper table's script (experiments/<table>.py, one command each): run the table's training
sweep (configs/experiment/<table>/train.yaml, `train.py -m`) and its evaluation (eval.yaml, `evaluate.py`), then write
the table as markdown + CSV + PNG. Finished runs are read back, not rerun, so a killed table continues where it
stopped and `--render` rebuilds the table from the runs alone.

    python experiments/<table>.py [--smoke] [--render] [train:KEY=VALUE ...] [eval:KEY=VALUE ...] [KEY=VALUE ...]

Unprefixed overrides go to both sides (paths.log_dir=..., base=...); `train:`/`eval:` ones to one side only
(train:trainer.max_steps=2000 train:trainer=gpu, eval:prompts.limit=80). --smoke runs the same sweep on the tiny
base in seconds (make test runs it for every table)."""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from specdec.checkpoint import write_text
from specdec.engines.measure import cpu_fields
from specdec.sweeps import REPORT, RESULT

ROOT = Path(__file__).resolve().parents[1]

# The smoke variant: the same sweeps on a tiny random base (deep enough for every exit layer of exit_layer) and a
# few stdlib files, two steps, two prompts of eight tokens.
SMOKE_BASE = ["base=tiny", "base.num_layers=18"]
SMOKE_TRAIN = [*SMOKE_BASE, "data.source.max_files=6", "data.block_size=32", "data.batch_size=2",
               "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "logger=csv",
               "callbacks.progress_bar.refresh_rate=0"]
SMOKE_EVAL = [*SMOKE_BASE, "prompts.limit=2", "sampler.max_new_tokens=8", "peers=[]", "warmup=false",
              "wandb.enabled=false"]
# The smoke of a table whose drafters train from the SmolLM2 feature cache: the tiny base (a 259-token vocab) trains
# on raw stdlib code instead, with a draft vocab that fits its vocabulary.
SMOKE_FROM_RAW_CODE = ("data=stdlib_code", "~data.path", "drafter.draft_vocab_size=64")


@dataclass
class Table:
    """What a table script builds from its finished runs."""

    title: str
    rows: list[dict[str, Any]]
    columns: dict[str, str]  # row key -> column header, in order
    plot: Callable[[Any], None] | None = None  # draws on a matplotlib Figure
    notes: list[str] = field(default_factory=list)
    # file name -> a run's file, copied beside the table (an evaluation's report.md, whose identity column and
    # Leviathan check the table itself leaves out)
    attach: dict[str, Path] = field(default_factory=dict)


Evaluate = Callable[[Path, list[str]], list[str]]  # (the table's log root, eval overrides) -> the scripts that failed


def main(name: str, build: Callable[[Path], Table], argv: list[str] | None = None,
         smoke_train: tuple[str, ...] = (), smoke_eval: tuple[str, ...] = (),
         evaluate: Evaluate | None = None) -> Path:
    """Run the table's two sides and write it. smoke_train / smoke_eval: what the table's smoke variant needs beyond
    the shared one (e.g. a data set the tiny base can read, fewer search trials). evaluate: a table whose evaluation
    runs in stages (a setting chosen on the tuning split, then the report with it); default: one evaluate.py run of
    experiment=<table>/eval."""
    ap = argparse.ArgumentParser(description=f"Reproduce the `{name}` table", epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny base, seconds (what make test runs)")
    ap.add_argument("--render", action="store_true", help="only rebuild the table from finished runs")
    ap.add_argument("--out", help="where the table goes (default experiments/results/<table>; smoke: the log dir)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    both = [o for o in args.overrides if not o.startswith(("train:", "eval:"))]
    train = [o.removeprefix("train:") for o in args.overrides if o.startswith("train:")]
    evals = [o.removeprefix("eval:") for o in args.overrides if o.startswith("eval:")]
    log_dir = next((o.split("=", 1)[1] for o in reversed(both) if o.startswith("paths.log_dir=")), str(ROOT / "logs"))
    root = Path(log_dir) / "experiments" / name
    if args.smoke:
        train, evals = [*SMOKE_TRAIN, *smoke_train, *train], [*SMOKE_EVAL, *smoke_eval, *evals]

    failed = []
    if not args.render:
        # A failed training job still leaves the others' drafters: evaluation and the table go on with them, and
        # the command exits non-zero at the end (evaluate.py itself refuses a drafter whose run left none).
        failed += _run("train.py", f"experiment={name}/train", [*both, *train])
        if evaluate is None:
            failed += _run("evaluate.py", f"experiment={name}/eval", [*both, *evals])
        else:
            failed += evaluate(root, [*both, *evals])
    table = build(root)
    out = Path(args.out) if args.out else (root / "table" if args.smoke else ROOT / "experiments" / "results" / name)
    # the command that ran the table's trainings and evaluations (a --render only redraws their runs), shell-quoted
    # so that it runs as printed (an override's ${...} stays Hydra's)
    command = shlex.join(["python", f"experiments/{name}.py", *(["--smoke"] if args.smoke else []), *args.overrides])
    write(out, name, table, command, *_measured(root))
    if failed:
        print(f"[specdec] table {name}: {' and '.join(failed)} failed (see its summary above); "
              f"the table holds the finished runs only", file=sys.stderr)
        raise SystemExit(1)
    return out


def _run(script: str, experiment: str, overrides: list[str]) -> list[str]:
    """Run one side of the table; [script] if it exited non-zero (a job of its sweep failed), else []."""
    cmd = [sys.executable, str(ROOT / script), experiment, *overrides]
    print("[specdec] $", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PROJECT_ROOT": str(ROOT)})
    return [script] if proc.returncode else []


# -- reading finished runs -------------------------------------------------------------------------
def train_runs(root: Path) -> dict[str, dict]:
    """Finished training jobs of the table: run dir name -> result.json (metrics, config, trainable_params)."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted((root / "train").glob(f"*/{RESULT}"))}


def eval_reports(root: Path, stage: str = "eval") -> dict[str, dict]:
    """Finished evaluations of the table: job dir name ('' for a single run) -> results.json. stage: the folder
    under the table's log root (a staged evaluation's tuning sweep writes to its own)."""
    return {job: json.loads(p.read_text()) for job, p in _report_paths(root, stage).items()}


def eval_report_files(root: Path, stage: str = "eval") -> dict[str, Path]:
    """Table.attach for a table with one evaluation job per prompt set: eval_<job>.md -> that job's report.md."""
    return {f"eval_{job}.md": p.with_name("report.md") for job, p in _report_paths(root, stage).items()}


def _report_paths(root: Path, stage: str) -> dict[str, Path]:
    """job dir name ('' for a single run) -> its results.json, for the finished evaluations under root/stage."""
    paths = {}
    for p in sorted((root / stage).glob(f"**/{REPORT}")):
        job = p.parent.relative_to(root / stage)
        paths["" if job == Path(".") else str(job)] = p
    return paths


def drafter_runs(report: dict) -> dict[str, dict]:
    """The training run of each drafter an evaluation report names, whichever sweep or recipe trained it: method
    name (as evaluate.py gives it) -> the result.json beside that drafter dir ({} where its run left none)."""
    from specdec.evaluation import drafter_names  # (loads torch and transformers: only when a table needs it)

    runs = {}
    for method, path in drafter_names(report["config"].get("drafters") or []).items():
        result = Path(path).parent / RESULT
        runs[method] = json.loads(result.read_text()) if result.exists() else {}
    return runs


def spread(row: dict | None) -> str | None:
    """A method's speedup vs our AR as 'mean ± sd' over the evaluation's passes (the mean alone for one pass)."""
    if row is None:
        return None
    sd = row.get("speedup_vs_ar_sd")
    return f"{row['speedup_vs_ar']:.2f}" + ("" if sd is None or math.isnan(sd) else f" ± {sd:.2f}")


_REQUIRED = object()


def method_row(report: dict, method: str, default: dict | object = _REQUIRED) -> dict:
    """The report's row of `method`; `default` where it did not run (a peer left out), else StopIteration."""
    rows = (r for r in report["rows"] if r["method"] == method)
    return next(rows) if default is _REQUIRED else next(rows, default)


def val_curve(root: Path, run: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one logged metric of a training run, from its CSV log."""
    steps, values = [], []
    for path in sorted((root / "train" / run).glob("csv/version_*/metrics.csv")):
        for row in csv.DictReader(path.open()):
            if row.get(key):
                steps.append(int(row["step"]))
                values.append(float(row[key]))
    return steps, values


Line = tuple[str, list, list, str]  # (label, x, y, matplotlib style)


def tau_and_speedup(fig, xlabel: str, tau: list[Line], speedup: list[Line]) -> None:
    """The two panels most tables draw: τ (tokens per base forward) and wall-clock speedup vs our AR loop."""
    ax1, ax2 = fig.subplots(1, 2)
    for ax, lines in ((ax1, tau), (ax2, speedup)):
        for label, x, y, style in lines:
            ax.plot(x, y, style, label=label)
        ax.legend()
        ax.grid(alpha=0.3)
    ax1.set(xlabel=xlabel, ylabel="τ", title="Tokens per base forward")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set(xlabel=xlabel, ylabel="speedup vs AR (ours)", title="Wall-clock speedup")


# -- writing ---------------------------------------------------------------------------------------
def write(out: Path, name: str, table: Table, command: str, date: str, machine: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cols = list(table.columns)
    md = [f"# {table.title}", "",
          f"`{command}` · {date} · {machine}", "",
          "| " + " | ".join(table.columns.values()) + " |", "|---" * len(cols) + "|"]
    md += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in table.rows]
    md += [""] + [f"{n}" for n in table.notes] + ["", f"![{name}]({name}.png)"]
    write_text(out / f"{name}.md", "\n".join(md) + "\n")
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(table.rows)
    write_text(out / f"{name}.csv", buf.getvalue())
    if table.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(9, 3.6))
        table.plot(fig)
        fig.tight_layout()
        tmp = out / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        os.replace(tmp, out / f"{name}.png")
    for file, src in table.attach.items():
        write_text(out / file, src.read_text())
    print("\n".join(md))
    print(f"[specdec] table written to {out}")


def _cell(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "—" if v != v else (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.2f}")
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _measured(root: Path) -> tuple[str, str]:
    """When and where the table's numbers were measured, not when and where it is rendered (a table read back a day
    later keeps its day): the newest evaluation's date (a report from before evaluate.py recorded one: the day its
    file was written) and the machine its evaluation reports name."""
    paths = list(_report_paths(root, "eval").values())
    if not paths:
        return datetime.date.today().isoformat(), f"{platform.machine()}, {os.cpu_count()} cores"
    headers = [json.loads(p.read_text())["header"] for p in paths]
    dates = [h.get("date") or datetime.date.fromtimestamp(p.stat().st_mtime).isoformat()
             for h, p in zip(headers, paths)]
    return max(dates), f"{headers[0]['device']}, {headers[0]['threads']} threads"


def cpu_label() -> str:
    """A short folder name for this CPU, as committed results are filed (zen4, zen5, xeon): AMD family 25 model 17
    is Zen 4 and family 26 Zen 5; any other CPU its vendor's word."""
    fields = cpu_fields()
    family, model = fields.get("cpu family"), fields.get("model")
    if "AMD" in fields.get("model name", ""):
        return {"25": "zen4" if model in ("17", "97") else "zen3", "26": "zen5"}.get(family, "amd")
    if "Intel" in fields.get("model name", ""):
        return "xeon" if "Xeon" in fields["model name"] else "intel"
    return platform.machine() or "cpu"
