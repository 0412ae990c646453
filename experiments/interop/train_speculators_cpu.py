"""speculators' own trainer (`speculators train`, speculators.train.cli.main) on a CPU, in one process. Runs in the
speculators venv (.interop/speculators-venv, experiments/interop/setup_speculators.sh), never in ours:

    .interop/speculators-venv/bin/python experiments/interop/train_speculators_cpu.py METRICS_JSONL \\
        --verifier-name-or-path BASE_DIR --data-path RUN_DIR --draft-attn-impl sdpa --loss-implementation eager \\
        --num-workers 0 ... (any flag of `speculators train`)

Their code runs unchanged except for what assumes an accelerator; each patch below replaces one name in their
modules and says why. The attention backend (sdpa: flex attention compiles only where CUDA is), the eager loss (their
fused loss is a Triton kernel) and no dataloader workers are their own flags, passed by the caller. Without a
LOCAL_RANK their code does not start torch.distributed, so one process needs no torchrun.

Every metric record their trainer logs (a dict on the `speculators.metrics` logger: train steps, validation epochs)
is appended to METRICS_JSONL as one json line."""

from __future__ import annotations

import json
import logging
import sys
import time

import speculators.train.checkpointer as checkpointer
import speculators.train.cli as cli
import speculators.train.trainer as trainer
from speculators.train.config import TrainConfig

CPU = "cpu"


class CPUTrainer(trainer.Trainer):
    """Their Trainer on the CPU: it moves the model and each batch to `get_local_rank()` (0, i.e. cuda:0) and
    autocasts on `torch.accelerator`'s device type, "cuda" when there is none (CUDA autocast is then disabled with a
    warning, so --hidden-states-dtype would be silently ignored). Here the rank's device is the CPU and the autocast
    runs on it in --hidden-states-dtype, as their trainer computes on a GPU."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.device_type = CPU


class CPUStepTimer(trainer._StepTimer):
    """Their step timer calls torch.accelerator.synchronize() on every logged step, which raises where there is no
    accelerator; CPU work is synchronous, so the marks are plain timestamps."""

    def mark(self, name: str) -> None:
        if self.enabled:
            self._marks[name] = time.perf_counter()

    def now(self) -> float | None:
        return time.perf_counter() if self.enabled else None


class JsonlMetrics(logging.Handler):
    """Their metric records (dicts; `step` in the record's extra) -> one json line each."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if record.name != "speculators.metrics" or not isinstance(record.msg, dict):
            return
        if getattr(record, "hparams", False):  # the run's config, which train_command.txt holds
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": getattr(record, "step", None), **record.msg}, default=float) + "\n")


class Console(logging.Handler):
    """Their console lines without the rich handler's redraws (it is set up only where the root logger has none)."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "speculators.metrics" and isinstance(record.msg, dict):
            if "val" in record.msg or record.msg.get("global_step", 1) % 25 == 0:
                print(f"[speculators] {json.dumps(record.msg, default=float)[:400]}", flush=True)
            return
        print(f"[speculators] {record.getMessage()}", flush=True)


def main(argv: list[str]) -> None:
    metrics, flags = argv[0], argv[1:]
    trainer.get_local_rank = lambda: CPU  # model.to(...) and batch.to(...) in Trainer take this device
    checkpointer.get_current_device = lambda: CPU  # a resumed run maps its checkpoint here, not onto cuda:0
    trainer._StepTimer = CPUStepTimer
    cli.Trainer = CPUTrainer
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(Console())
    root.addHandler(JsonlMetrics(metrics))
    cli.main(TrainConfig.resolve(flags))


if __name__ == "__main__":
    main(sys.argv[1:])
