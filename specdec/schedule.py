"""The learning-rate schedule of every recipe: a linear warmup, then a cosine to zero by the end of the run. A run
ends at `max_steps` or when its wall-clock budget (`trainer.max_time`) is spent, whichever comes first, and the
cosine follows whichever is further along, so a run that its budget stops on a slower machine still ends annealed
instead of at a high learning rate."""

from __future__ import annotations

import math
import time
from typing import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def seconds(max_time: str | None) -> float | None:
    """Lightning's "DD:HH:MM:SS" as seconds; None stays None."""
    if max_time is None:
        return None
    days, hours, minutes, secs = (int(x) for x in str(max_time).split(":"))
    return float(((days * 24 + hours) * 60 + minutes) * 60 + secs)


def cosine_with_budget(optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int,
                       max_time: str | None = None, clock: Callable[[], float] = time.monotonic) -> LambdaLR:
    """Warmup over num_warmup_steps, then 0.5·(1 + cos(π·p)) with p the larger of the steps' progress and the budget's
    (seconds since this scheduler was made over max_time). On a resumed run the budget counts from the resume, as
    Lightning's own max_time does not: the steps' progress, which the checkpoint keeps, then leads."""
    budget = seconds(max_time)
    start = clock()

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        p = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        if budget:
            p = max(p, (clock() - start) / budget)
        return 0.5 * (1.0 + math.cos(math.pi * min(p, 1.0)))

    return LambdaLR(optimizer, factor)
