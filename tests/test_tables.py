"""Every experiments/<table>.py runs its smoke variant end to end (the same sweeps and evaluation configs on the tiny
base) and writes its table as markdown + CSV + PNG. (Reruns reading finished runs back are tested on each side in
test_train.py and test_evaluate.py.)"""

import csv
import os
import subprocess
import sys

import pytest

from conftest import ROOT

# table -> rows its smoke variant must produce
TABLES = {"drafters": 20, "leviathan": 6, "medusa_heads": 10, "exit_layer": 5, "prophet_vs_early_exit": 2,
          "self_speculative": 6, "draft_model": 3}


@pytest.mark.parametrize("table", TABLES)
def test_table_smoke(table, tmp_path):
    cmd = [sys.executable, str(ROOT / "experiments" / f"{table}.py"), "--smoke", f"paths.log_dir={tmp_path}",
           f"paths.cache_dir={tmp_path}/cache"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "experiments" / table / "table"
    rows = list(csv.DictReader((out / f"{table}.csv").open()))
    assert len(rows) == TABLES[table]
    md = (out / f"{table}.md").read_text()
    assert md.count("\n|") == TABLES[table] + 2 and f"experiments/{table}.py --smoke" in md
    assert (out / f"{table}.png").stat().st_size > 10_000
    if table == "drafters":  # its four evaluation runs are the W1 protocol: w1.py collects them
        w1 = subprocess.run([sys.executable, str(ROOT / "experiments" / "w1.py"), "--from",
                             str(tmp_path / "experiments" / "drafters" / "eval"), "--out", str(tmp_path / "w1")],
                            capture_output=True, text=True)
        assert w1.returncode == 0, w1.stderr[-3000:]
        rows = list(csv.DictReader((tmp_path / "w1" / "w1.csv").open()))
        assert {(r["prompts"], r["tree"]) for r in rows} == {(p, t) for p in ("humaneval", "question")
                                                            for t in ("chain", "dynamic_tree")}
        assert {r["method"] for r in rows} == {"ar (ours)", "medusa", "hydra", "earlyexit", "prophet"}


def test_table_with_a_failed_job_exits_nonzero(tmp_path):
    # every training job fails (AdamW refuses lr < 0), so evaluation has no drafter: the table is still written
    # from what finished (nothing), and the command exits 1 for a script or CI to notice
    cmd = [sys.executable, str(ROOT / "experiments" / "leviathan.py"), "--smoke", f"paths.log_dir={tmp_path}",
           f"paths.cache_dir={tmp_path}/cache", "train:module.optimizer.lr=-1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "table leviathan: train.py and evaluate.py failed" in proc.stderr
    assert (tmp_path / "experiments" / "leviathan" / "table" / "leviathan.md").exists()
