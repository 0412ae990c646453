"""experiments/ab_drafter.py: a drafter's class as another git revision defined it, swapped in under the same weights."""

import torch

from conftest import experiment_script
from specdec.base import tiny_base
from specdec.drafters.prophet import Prophet
from specdec.sampling.decode import SamplerConfig, generate


def test_class_at_a_revision_runs_the_same_weights():
    base = tiny_base()
    old = experiment_script("ab_drafter").class_at(Prophet, "HEAD")
    assert old is not Prophet and old.__name__ == "Prophet" and old.__module__ != Prophet.__module__
    drafter = Prophet(base, unroll_steps=2)
    with torch.no_grad():  # random blocks: drafts differ from the base's tokens, so rounds reject and roll back
        for p in drafter.blocks.parameters():
            p.normal_(0, 0.2)
    prompts, cfg = [[5, 6, 7, 8], [9, 10]], SamplerConfig(max_new_tokens=12, gamma=3, eos_token_id=[])
    ar = generate(base, prompts, None, cfg).tokens
    now = generate(base, prompts, drafter, cfg)
    drafter.__class__ = old
    then = generate(base, prompts, drafter, cfg)
    assert torch.equal(now.tokens, ar) and torch.equal(then.tokens, ar)
    assert now.accepted == then.accepted  # HEAD's code is this code: the very same rounds
