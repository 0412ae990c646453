"""Monte-Carlo losslessness of the real decode loop (docs/sampler.md §6.3-4): 10^5 rows of one batch on a micro base,
chi-square of the first three emitted tokens (the 2nd and 3rd come from the first speculative round) against
the base's exact autoregressive joint; the two classic bugs must fail the same test."""

from __future__ import annotations

import pytest
import torch

from specdec.sampling import trees, verify
from specdec.sampling.decode import SamplerConfig, generate

from conftest import auto_engine
from sampling_stubs import Table, micro_base

N, PROMPT, TOKENS = 100_000, [1, 4], 3
N_BROKEN = 20_000  # the broken samplers miss by far more than 10^5 samples could hide


@pytest.fixture(scope="module")
def base():
    return micro_base()


def exact_joint(base, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """P(x1, x2, x3 | prompt) [V, V, V] (at T = 1, or from each step's distribution after temperature, top-k and
    top-p, as the sampler processes p), from one no-cache forward over every continuation."""
    v = base.vocab_size
    seqs = torch.cartesian_prod(torch.arange(v), torch.arange(v))  # [V², 2]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
    logits = base(ids)[:, len(PROMPT) - 1 :]  # [V², 3, V]
    if (temperature, top_k, top_p) == (1.0, 0, 1.0):
        logp = logits.double().log_softmax(-1)
    else:
        logp = verify.process_logits(logits, temperature, top_k, top_p).double().log()
    x1, x2 = seqs[:, 0], seqs[:, 1]
    joint = logp[:, 0].gather(1, x1[:, None]) + logp[:, 1].gather(1, x2[:, None]) + logp[:, 2]  # [V², V]
    return joint.exp().view(v, v, v)


def chi_square_pvalue(tokens: torch.Tensor, joint: torch.Tensor) -> float:
    v = joint.shape[0]
    cell = (tokens[:, 0] * v + tokens[:, 1]) * v + tokens[:, 2]
    observed = torch.bincount(cell, minlength=v**3).double()
    expected = joint.flatten() * len(tokens)
    small = expected < 5  # pool sparse cells so the chi-square approximation holds
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def sample_tokens(base, n: int = N, **kw) -> torch.Tensor:
    cfg = SamplerConfig(max_new_tokens=TOKENS, eos_token_id=[], **{"temperature": 1.0} | kw)
    r = generate(base, [PROMPT] * n, Table(base), cfg, torch.Generator().manual_seed(0), engine=auto_engine())
    return r.tokens


SETUPS = {"chain": dict(gamma=2), "tree": dict(tree="static", paths=[[0, 0], [1, 0], [2]])}


@pytest.mark.parametrize("setup", SETUPS)
def test_sampler_matches_target(base, setup):
    assert chi_square_pvalue(sample_tokens(base, **SETUPS[setup]), exact_joint(base)) > 1e-3


# a temperature below 1, top-k and top-p together: each cuts the distribution the sampler must reproduce (of the
# micro base's 6 tokens, top-k keeps 4 and top-p the head of those), applied to p and q alike
PROCESSED = dict(temperature=0.7, top_k=4, top_p=0.9)


@pytest.mark.parametrize("setup", SETUPS)
def test_sampler_matches_target_under_top_k_and_top_p(base, setup):
    joint = exact_joint(base, **PROCESSED)
    assert (joint == 0).any()  # the processing really removes tokens the plain T = 1 joint gives mass to
    assert chi_square_pvalue(sample_tokens(base, **SETUPS[setup], **PROCESSED), joint) > 1e-3


@pytest.mark.parametrize("setup", SETUPS)
def test_accept_all_fails(base, setup, monkeypatch):
    monkeypatch.setattr(verify, "accept_probability", lambda p, q, x: torch.ones(len(x)))
    assert chi_square_pvalue(sample_tokens(base, N_BROKEN, **SETUPS[setup]), exact_joint(base)) < 1e-6


def test_greedy_draft_reporting_full_q_fails(base, monkeypatch):
    monkeypatch.setattr(trees, "sample", lambda probs, u: probs.argmax(-1))  # drafting side only
    assert chi_square_pvalue(sample_tokens(base, N_BROKEN, **SETUPS["chain"]), exact_joint(base)) < 1e-6
