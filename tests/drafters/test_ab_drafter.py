"""experiments/ab_drafter.py: a drafter's class as another source defined it, swapped in under the same weights."""

import inspect

import torch

from conftest import auto_engine, experiment_script
from specdec.base import tiny_base
from specdec.drafters import draft_model
from specdec.drafters.draft_model import DraftModel
from specdec.sampling.decode import SamplerConfig, generate

# draft_model.py with its drafts made the least likely tokens: another revision whose code really differs
WORSE = "\n_expand = DraftModel.expand\nDraftModel.expand = lambda self, *a, **k: -_expand(self, *a, **k)\n"


def test_a_class_from_other_source_runs_that_source_on_the_same_weights():
    base = tiny_base()
    ab = experiment_script("ab_drafter")
    old = ab.class_from(DraftModel, inspect.getsource(draft_model) + WORSE, "worse")
    assert old is not DraftModel and old.__name__ == "DraftModel" and old.__module__ != DraftModel.__module__
    # a copy of every base layer is the base: its drafts are the base's tokens (one product for every row count:
    # the eager engine)
    drafter = DraftModel(base, num_layers=base.num_layers)
    prompts, cfg = [[5, 6, 7, 8], [9, 10]], SamplerConfig(max_new_tokens=12, gamma=3, eos_token_id=[])
    eager = auto_engine(name="eager")
    ar = generate(base, prompts, None, cfg, engine=eager).tokens
    now = generate(base, prompts, drafter, cfg, engine=eager)
    drafter.__class__ = old
    then = generate(base, prompts, drafter, cfg, engine=eager)
    assert torch.equal(now.tokens, ar) and torch.equal(then.tokens, ar)  # lossless whatever the code drafts
    # the swapped-in code is what ran: its drafts are rejected where the current code's are accepted
    assert sum(map(sum, now.accepted)) > 0 and sum(map(sum, then.accepted)) == 0


def test_class_at_reads_a_revision_through_git():
    old = experiment_script("ab_drafter").class_at(DraftModel, "HEAD")
    assert old.__name__ == "DraftModel" and old.__module__.endswith("_at_HEAD")
