"""Interrupted training resumes exactly: a real `train.py` run on the tiny base is killed (SIGKILL from outside, or
SIGTERM) mid-epoch, rerun with the same command, and ends with the same drafter weights and validation metrics as
an uninterrupted run of the same seed: data order, optimizer and scheduler state included."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, write_corpus
from specdec.data.sampler import ResumableSampler

STEPS, STALL = 10, 5  # checkpoints every 2 steps: SIGKILL resumes from step 4, SIGTERM from step 5


def _command(corpus: Path, tmp_path: Path, run: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "base=tiny", "data=text", f"data.source.path={corpus}/*.txt",
            "data.block_size=32", "data.batch_size=2", "data.val_fraction=0.2", "drafter=medusa",
            "drafter.num_heads=2", f"trainer.max_steps={STEPS}", "trainer.val_check_interval=5",
            "trainer.limit_val_batches=2", "callbacks.model_checkpoint.every_n_train_steps=2", "logger=csv",
            "callbacks.progress_bar.refresh_rate=0", "+callbacks.stall._target_=train_hooks.StallAt",
            f"paths.cache_dir={tmp_path}/cache", f"hydra.run.dir={tmp_path}/{run}"]


def _env(stall: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    env.pop("STALL_AT", None)
    return {**env, "STALL_AT": stall} if stall else env


def _killed_at_step(cmd: list[str], tmp_path: Path, sig: int) -> int:
    """Start the run, wait until it stalls after step STALL, send `sig`."""
    marker = tmp_path / f"stalled-{sig}"
    proc = subprocess.Popen(cmd, env=_env(f"{STALL}:{marker}"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline, "the run never reached the stall step"
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    return proc.returncode


def _final(run_dir: Path) -> tuple[dict, dict]:
    result = json.loads((run_dir / "result.json").read_text())
    val = {k: v for k, v in result["metrics"].items() if k.startswith("val/")}
    return val, load_file(run_dir / "drafter" / "drafter.safetensors")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """The uninterrupted run (shared by both signals): (corpus dir, its run dir)."""
    tmp = tmp_path_factory.mktemp("resume")
    corpus = write_corpus(tmp / "corpus")
    ref = subprocess.run(_command(corpus, tmp, "ref"), env=_env(), capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return corpus, tmp / "ref"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_killed_run_resumes_to_the_same_result(sig, reference, tmp_path):
    corpus, ref_dir = reference
    cmd = _command(corpus, tmp_path, "killed")
    rc = _killed_at_step(cmd, tmp_path, sig)
    assert rc != 0 and not (tmp_path / "killed" / "result.json").exists()  # it really died mid-run
    assert (tmp_path / "killed" / "checkpoints" / "last.ckpt").exists()
    again = subprocess.run(cmd, env=_env(), capture_output=True, text=True)  # the same command
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout

    (val_ref, w_ref), (val, w) = _final(ref_dir), _final(tmp_path / "killed")
    assert json.loads((tmp_path / "killed" / "result.json").read_text())["global_step"] == STEPS
    assert val.keys() == val_ref.keys() and val
    for k in val:
        assert val[k] == pytest.approx(val_ref[k], rel=1e-5, abs=1e-6), k
    for k in w_ref:
        torch.testing.assert_close(w[k], w_ref[k], rtol=1e-5, atol=1e-6)


def test_resumable_sampler_continues_the_same_order():
    full = ResumableSampler(20, seed=3)
    full.set_epoch(2)
    order = list(full)
    resumed = ResumableSampler(20, seed=3)
    resumed.set_epoch(2)
    resumed.resume(8)
    assert list(resumed) == order[8:]
    assert list(resumed) == order  # the skip applies to the interrupted pass only
    other = ResumableSampler(20, seed=3)
    other.set_epoch(3)
    assert list(other) != order  # a new epoch, a new order
