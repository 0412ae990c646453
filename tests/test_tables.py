"""Every experiments/<table>.py runs its smoke variant end to end (the same sweeps and evaluation configs on the tiny
base) and writes its table as markdown + CSV + PNG. (Reruns reading finished runs back are tested on each side in
test_train.py and test_evaluate.py.)"""

import csv
import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from conftest import ROOT, experiment_script

# table -> rows its smoke variant must produce
TABLES = {"drafters": 20, "leviathan": 6, "medusa_heads": 10, "exit_layer": 5, "prophet_vs_early_exit": 2,
          "self_speculative": 6, "draft_model": 3, "eagle3_vs_prophet": 2, "general_domain": 4,
          "best_drafter": 18}
FAILED_JOB = ("leviathan", "train:module.optimizer.lr=-1")  # every training job fails: AdamW refuses lr < 0


def _smoke(table: str, log_dir, *overrides: str, threads: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "experiments" / f"{table}.py"), "--smoke", f"paths.log_dir={log_dir}",
           f"paths.cache_dir={log_dir}/cache", *overrides]
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": threads}
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory) -> dict[str, tuple[Future, object]]:
    """The smoke runs of the selected tests, started together on one worker per core (up to 4), one thread each.
    A smoke run is three processes (the table, train.py, evaluate.py) that spend most of their time importing and
    stepping tiny models on one core, so two cores finish the eight runs in about half the time one after another
    takes (make test on a 2-core Zen 3 EPYC: 8 min 14 s, against 10 min 36-57 s with the runs in turn)."""
    selected = [item.name for item in request.session.items if item.module is request.module]
    runs = [t for t in TABLES if f"test_table_smoke[{t}]" in selected]
    if "test_table_with_a_failed_job_exits_nonzero" in selected:
        runs.append("failed_job")
    workers = max(1, min(4, os.cpu_count() or 1, len(runs)))
    threads = "1" if workers > 1 else os.environ.get("OMP_NUM_THREADS", "1")
    pool = ThreadPoolExecutor(workers)
    started = {}
    for run in runs:
        log_dir = tmp_path_factory.mktemp(run)
        table, *overrides = FAILED_JOB if run == "failed_job" else (run,)
        started[run] = (pool.submit(_smoke, table, log_dir, *overrides, threads=threads), log_dir)
    yield started
    pool.shutdown(cancel_futures=True)


# the smoke runs over ~30 s on a 2-core CPU go to make test-long: 40-45 s on a Zen 5 (general_domain: two trainings and
# two evaluations; best_drafter: twelve evaluation jobs in two stages), and 50-54 s on a Zen 3, where with them make
# test took 10 min 52 s (self_speculative, exit_layer, eagle3_vs_prophet)
LONG = {"drafters", "medusa_heads", "leviathan", "general_domain", "best_drafter", "self_speculative", "exit_layer",
        "eagle3_vs_prophet"}


@pytest.mark.parametrize("table", [pytest.param(t, marks=pytest.mark.long) if t in LONG else t for t in TABLES])
def test_table_smoke(table, smoke_runs):
    future, tmp_path = smoke_runs[table]
    proc = future.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "experiments" / table / "table"
    rows = list(csv.DictReader((out / f"{table}.csv").open()))
    assert len(rows) == TABLES[table]
    md = (out / f"{table}.md").read_text()
    assert md.count("\n|") == TABLES[table] + 2 and f"experiments/{table}.py --smoke" in md
    assert (out / f"{table}.png").stat().st_size > 10_000
    if table == "drafters":  # its four evaluation runs are the W1 protocol: w1.py collects them
        # every drafter row names its own training run's size and validation τ (read beside its drafter dir)
        drafted = [r for r in rows if r["method"] in {"medusa", "hydra", "earlyexit", "prophet"}]
        assert len(drafted) == 16 and all(int(r["params"]) > 0 and float(r["val_tau"]) >= 1 for r in drafted)
        w1 = subprocess.run([sys.executable, str(ROOT / "experiments" / "w1.py"), "--from",
                             str(tmp_path / "experiments" / "drafters" / "eval"), "--out", str(tmp_path / "w1")],
                            capture_output=True, text=True)
        assert w1.returncode == 0, w1.stderr[-3000:]
        rows = list(csv.DictReader((tmp_path / "w1" / "w1.csv").open()))
        assert {(r["prompts"], r["tree"]) for r in rows} == {(p, t) for p in ("humaneval", "question")
                                                            for t in ("chain", "dynamic_tree")}
        assert {r["method"] for r in rows} == {"ar (ours)", "medusa", "hydra", "earlyexit", "prophet"}
    if table in ("general_domain", "best_drafter"):  # its evaluation reports (identity, the Leviathan check) beside it
        for prompts in ("humaneval", "question"):
            report = (out / f"eval_{prompts}.md").read_text()
            assert report == (tmp_path / "experiments" / table / "eval" / prompts / "report.md").read_text()
            assert "greedy-identical" in report
    if table == "best_drafter":  # every shape from both weight precisions; the report drafts the one chosen
        tuned = [r for r in rows if r["prompts"] == "humaneval (tuning split)"]
        drafts = [r["shape"].removesuffix(" (chosen)") for r in tuned]
        assert {d.split(", ")[1] for d in drafts} == {"q8", "q4a8"} and len(set(drafts)) == 10
        chosen = [r for r in tuned if r["shape"].endswith(" (chosen)")]
        assert len(chosen) == 1 and float(chosen[0]["vs_ar"]) == max(float(r["vs_ar"]) for r in tuned)
        reported = {r["shape"] for r in rows if r not in tuned and r["method"].startswith("prophet")}
        assert reported == {chosen[0]["shape"].removesuffix(" (chosen)")}


def test_table_with_a_failed_job_exits_nonzero(smoke_runs):
    # every training job fails, so evaluation has no drafter: the table is still written from what finished
    # (nothing), and the command exits 1 for a script or CI to notice
    future, tmp_path = smoke_runs["failed_job"]
    proc = future.result()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "table leviathan: train.py and evaluate.py failed" in proc.stderr
    assert (tmp_path / "experiments" / "leviathan" / "table" / "leviathan.md").exists()


def test_a_table_read_back_later_keeps_the_day_and_machine_it_was_measured_on(tmp_path):
    _measured = experiment_script("tables")._measured

    header = {"device": "cpu (a test CPU)", "threads": 2}
    for job, date in (("a", "2026-01-02"), ("b", None)):  # b: a report from before evaluate.py recorded its date
        (tmp_path / "eval" / job).mkdir(parents=True)
        path = tmp_path / "eval" / job / "results.json"
        path.write_text(json.dumps({"header": {**header, **({"date": date} if date else {})}}))
    os.utime(path, (0, 86_400 * 365))  # b written on 1971-01-01
    assert _measured(tmp_path) == ("2026-01-02", "cpu (a test CPU), 2 threads")
    (tmp_path / "eval" / "a" / "results.json").unlink()
    assert _measured(tmp_path) == ("1971-01-01", "cpu (a test CPU), 2 threads")
