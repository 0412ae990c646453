"""The training step is correct under DDP: two CPU processes (gloo) with batch b each train the drafter to the same
weights as one process with batch 2b (Lightning deals the sampler's order out to the ranks: together their first
batches are the single run's first batch, and DDP averages the two ranks' gradients)."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT

STEPS = 3


# two training processes on two cores
pytestmark = pytest.mark.long


def _train(corpus, tmp_path, run, *overrides):
    cmd = [sys.executable, str(ROOT / "train.py"), "base=tiny", "data=text", f"data.source.path={corpus}/*.txt",
           "data.block_size=32", "data.val_fraction=0.2", "drafter=medusa", "drafter.num_heads=2",
           f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}", "trainer.limit_val_batches=1",
           "trainer.accelerator=cpu", "logger=csv", "callbacks.progress_bar.refresh_rate=0",
           f"paths.cache_dir={tmp_path}/cache", f"hydra.run.dir={tmp_path}/{run}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(tmp_path / run / "drafter" / "drafter.safetensors")


def test_two_process_ddp_matches_one_process_with_the_global_batch(corpus, tmp_path):
    single = _train(corpus, tmp_path, "single", "data.batch_size=4")
    ddp = _train(corpus, tmp_path, "ddp", "trainer=ddp", "trainer.devices=2", "data.batch_size=2")
    for k in single:
        torch.testing.assert_close(ddp[k], single[k], rtol=1e-4, atol=1e-5)
    # what one rank would have done alone (no gradient averaging) ends elsewhere: the comparison has teeth
    alone = _train(corpus, tmp_path, "alone", "data.batch_size=2")
    assert any(not torch.allclose(alone[k], single[k], rtol=1e-4, atol=1e-5) for k in single)
