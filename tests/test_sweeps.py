"""Hydra multiruns of the real train.py on the tiny base: a failed job does not stop the others and shows in the
sweep summary; the Optuna sweeper runs trials on a metric the module logs and refuses one it never logs; wandb
groups a sweep's runs."""

import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from conftest import CONFIGS, ROOT
from specdec.sweeps import sweep_rows

TINY = ["base=tiny", "data=text", "data.block_size=32", "data.batch_size=2", "data.val_fraction=0.2",
        "drafter=medusa", "drafter.num_heads=2", "trainer.max_steps=2", "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1", "logger=csv", "callbacks.progress_bar.refresh_rate=0"]


def _multirun(corpus: Path, tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY, f"data.source.path={corpus}/*.txt",
           f"paths.cache_dir={tmp_path}/cache", f"hydra.sweep.dir={tmp_path}/sweep", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)


def test_failed_job_does_not_stop_the_sweep(corpus, tmp_path):
    # job 0 has an invalid learning rate (AdamW raises), job 1 trains; the sweep then exits non-zero
    proc = _multirun(corpus, tmp_path, "module.optimizer.lr=-1,1e-3")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "1 of 2 jobs completed; failed: 0" in proc.stdout
    rows = {r["overrides"].split()[0]: r for r in sweep_rows(tmp_path / "sweep", "val/expected_tau")}
    assert rows["module.optimizer.lr=-1"]["status"] == "failed"
    assert "Invalid learning rate" in rows["module.optimizer.lr=-1"]["value"]
    assert rows["module.optimizer.lr=0.001"]["status"] == "completed"
    assert rows["module.optimizer.lr=0.001"]["value"] > 1.0
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "1 of 2 jobs completed; failed: 0" in summary and (tmp_path / "sweep" / "summary.csv").exists()


def test_optuna_sweep_optimises_a_logged_metric(corpus, tmp_path):
    proc = _multirun(corpus, tmp_path, "hparams_search=medusa_optuna", "hydra.sweeper.n_trials=2",
                     "hydra.sweeper.sampler.n_startup_trials=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = (tmp_path / "sweep" / "optimization_results.yaml").read_text()
    assert "best_value" in results and "module.optimizer.lr" in results
    assert sum(r["status"] == "completed" for r in sweep_rows(tmp_path / "sweep", "val/expected_tau")) == 2


def test_sweep_refuses_a_metric_nobody_logs(corpus, tmp_path):
    proc = _multirun(corpus, tmp_path, "optimized_metric=val/bleu", "module.optimizer.lr=1e-3,3e-3")
    assert proc.returncode != 0
    assert "optimized_metric 'val/bleu' is never logged by Medusa; pick one of val/loss, val/expected_tau" in proc.stderr
    assert not list((tmp_path / "sweep").glob("*/checkpoints"))  # refused before any training


def test_wandb_groups_runs_by_sweep(tmp_path):
    from specdec.training import _sweep_grouping

    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=["hydra.mode=MULTIRUN", "drafter=hydra", "seed=3",
                                          f"hydra.sweep.dir={tmp_path}/my_sweep"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        kw = _sweep_grouping(cfg.logger.wandb)
    finally:
        HydraConfig.instance().cfg = None
    assert kw["group"] == "train/my_sweep"
    assert {"drafter=hydra", "seed=3"} <= set(kw["tags"])
    assert _sweep_grouping(cfg.logger.csv) == {}
