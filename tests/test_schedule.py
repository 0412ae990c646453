"""The recipes' learning-rate schedule: HF's cosine with warmup while the steps lead, and annealed by the end of a
wall-clock budget when the budget does."""

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from specdec.schedule import cosine_with_budget, seconds


def lrs(scheduler, optimizer, steps):
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def test_without_a_budget_it_is_hfs_cosine_with_warmup():
    a, b = optimizer(), optimizer()
    ours = lrs(cosine_with_budget(a, 3, 20, max_time=None), a, 20)
    hf = lrs(get_cosine_schedule_with_warmup(b, 3, 20), b, 20)
    assert ours == pytest.approx(hf)


def test_a_spent_budget_anneals_before_the_steps_do():
    now = [0.0]
    opt = optimizer()
    sched = cosine_with_budget(opt, 0, 1000, max_time="00:00:01:40", clock=lambda: now[0])  # 100 s
    now[0] = 50.0  # half the budget spent at step 1 of 1000: the budget leads
    opt.step(), sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    now[0] = 150.0  # past it: annealed, not rising again
    opt.step(), sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0)


def test_lightning_time_strings():
    assert seconds("01:02:03:04") == ((24 + 2) * 60 + 3) * 60 + 4 and seconds(None) is None
