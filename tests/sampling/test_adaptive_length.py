"""Adaptive draft length in the sampler (chains): each row's chain ends after its first unconfident draft token,
the threshold follows the acceptance rate when given a target, the output is unchanged at T = 0 and the base's
distribution at T > 0 (Monte-Carlo), and the metrics report the mean draft length."""

import pytest
import torch

from specdec.base import tiny_base
from specdec.sampling.adaptive import DraftLength
from specdec.sampling.decode import SamplerConfig, generate

from conftest import auto_engine
from sampling_stubs import Oracle, Table, micro_base
from test_sampling_mc import PROMPT, TOKENS, chi_square_pvalue, exact_joint

PROMPTS = [[5, 17, 42, 8, 99, 23, 7], [61, 3, 12]]
NEW = 13


class Confident(Oracle):
    """The oracle's drafts with a set top-1 probability: conf[b][d] for row b's child at depth d + 1 (the last
    entry repeats), the rest of the mass spread evenly."""

    def __init__(self, base, right_for, conf: list[list[float]]):
        super().__init__(base, right_for)
        self.conf = conf

    def expand(self, state, ctx, tokens, parents, depth, nodes):
        want = super().expand(state, ctx, tokens, parents, depth, nodes).argmax(-1)  # [B, F]
        c = torch.tensor([row[min(depth, len(row) - 1)] for row in self.conf])[:, None, None]  # [B, 1, 1]
        v = self.base.vocab_size
        probs = ((1 - c) / (v - 1)).expand(*want.shape, v).clone()  # [B, F, V]
        return probs.scatter_(-1, want[..., None], c.expand(*want.shape, 1)).log()


@pytest.fixture(scope="module")
def base():
    return tiny_base()


@pytest.fixture(scope="module")
def plain(base):
    return generate(base, PROMPTS, None, SamplerConfig(max_new_tokens=NEW, eos_token_id=[]),
                    engine=auto_engine()).tokens


def cfg(**kw):
    return SamplerConfig(max_new_tokens=NEW, eos_token_id=[], **kw)


def test_each_row_stops_after_its_first_unconfident_draft(base, plain):
    # row 0 is confident for two drafts, then not: it proposes 3 per round; row 1 is never confident: 1 per round
    drafter = Confident(base, right_for=100, conf=[[0.9, 0.9, 0.2, 0.9], [0.3]])
    r = generate(base, PROMPTS, drafter, cfg(gamma=6, adaptive_threshold=0.5), engine=auto_engine())
    assert torch.equal(r.tokens, plain)
    assert r.drafted[0] == [3] * len(r.drafted[0]) and r.accepted[0] == r.drafted[0]
    assert r.drafted[1] == [1] * len(r.drafted[1]) and r.accepted[1] == r.drafted[1]
    fixed = generate(base, PROMPTS, drafter, cfg(gamma=6), engine=auto_engine())  # off: always gamma
    assert torch.equal(fixed.tokens, plain) and all(g == 6 for row in fixed.drafted for g in row)


@pytest.mark.parametrize("right_for", [0, 1, 100])
@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_greedy_identity(base, plain, right_for, gamma):
    drafter = Confident(base, right_for, conf=[[0.9, 0.4, 0.9], [0.9, 0.9, 0.9, 0.1]])
    r = generate(base, PROMPTS, drafter, cfg(gamma=gamma, adaptive_threshold=0.5, adaptive_target=0.7),
                 engine=auto_engine())
    assert torch.equal(r.tokens, plain)
    assert all(1 <= g <= gamma for row in r.drafted for g in row)


def test_threshold_rises_while_acceptance_is_below_target(base, plain):
    # Every draft is 0.62-confident and only the first of each chain is right: with a target of 0.9 the threshold
    # climbs 0.5 -> 0.55 -> 0.6 -> 0.65 over three full rounds, after which every chain stops at its first token.
    drafter = Confident(base, right_for=1, conf=[[0.62], [0.62]])
    r = generate(base, PROMPTS, drafter,
                 cfg(gamma=4, adaptive_threshold=0.5, adaptive_target=0.9, adaptive_step=0.05), engine=auto_engine())
    assert torch.equal(r.tokens, plain)
    for row in r.drafted:
        assert row[:3] == [4, 4, 4] and set(row[3:]) == {1}


def test_draft_length_update_rule():
    length = DraftLength(SamplerConfig(adaptive_threshold=0.5, adaptive_target=0.8, adaptive_step=0.1,
                                       adaptive_decay=0.5))
    length.update(accepted=1, drafted=4)  # rate 0.5·0.8 + 0.5·0.25 = 0.525 < 0.8: stop earlier
    assert length.rate == pytest.approx(0.525) and length.threshold == pytest.approx(0.6)
    length.update(accepted=4, drafted=4)
    length.update(accepted=4, drafted=4)  # rate 0.88 > 0.8: draft longer again
    assert length.threshold == pytest.approx(0.6)
    length.active = torch.tensor([True, False, True])
    assert length.keep_going(torch.tensor([0.7, 0.9, 0.5])).tolist() == [True, False, False]
    fixed = DraftLength(SamplerConfig(adaptive_threshold=0.3))
    fixed.update(accepted=0, drafted=4)
    assert fixed.threshold == 0.3  # no target: the threshold stays


@pytest.mark.parametrize("bad", [dict(adaptive_threshold=1.5), dict(adaptive_target=1.0),
                                 dict(adaptive_threshold=0.5, tree="static", paths=[[0]]),
                                 dict(adaptive_target=0.8, adaptive_decay=1.0)])
def test_bad_settings_fail_in_one_line(bad):
    with pytest.raises(ValueError, match="^sampler: "):
        SamplerConfig(**bad)


def test_monte_carlo_lossless():
    # docs/sampler.md §6.3 with the real sampler loop: the table drafter's top-1 probability depends on the token it
    # drafts from, so rows stop at different depths; the first three tokens still follow the base's exact joint.
    micro = micro_base()
    config = SamplerConfig(max_new_tokens=TOKENS, temperature=1.0, eos_token_id=[], gamma=3, adaptive_threshold=0.5)
    r = generate(micro, [PROMPT] * 100_000, Table(micro), config, torch.Generator().manual_seed(0),
                 engine=auto_engine())
    first = torch.tensor([row[0] for row in r.drafted])
    assert (first == 1).any() and (first > 1).any()  # the stopping rule was exercised both ways
    assert chi_square_pvalue(r.tokens, exact_joint(micro)) > 1e-3

