"""Callbacks the subprocess tests add to a real `train.py` run (+callbacks.stall._target_=train_hooks.StallAt)."""

import os
import time
from pathlib import Path

import lightning as L


class StallAt(L.Callback):
    """If $STALL_AT=<step>:<marker file>, wait once that many optimizer steps are done, having touched the marker:
    the test then kills the process at a known step. A SIGTERM ends the wait (Lightning then stops after this
    step, as it would after any step). Without the variable it does nothing, so the killed run and its resumed
    rerun are the same command."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        spec = os.environ.get("STALL_AT")
        if spec and trainer.global_step == int(spec.split(":")[0]):
            Path(spec.split(":", 1)[1]).touch()
            deadline = time.time() + 600
            while not trainer.received_sigterm and time.time() < deadline:
                time.sleep(0.05)
