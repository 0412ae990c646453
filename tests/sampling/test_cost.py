"""The verify-cost curve and the walltime model built on it (specdec/sampling/cost.py, docs/sampler.md §8)."""

import random
import weakref

import pytest
import torch

from specdec.sampling.cost import chain_tau, forward_costs, predicted_speedup
from specdec.sampling.metrics import token_acceptance

from conftest import auto_engine


def test_forward_costs_on_the_tiny_base(tiny):
    costs = forward_costs(tiny, [1, 3, 9], prompt_len=12, reps=2, engine=auto_engine())
    assert set(costs) == {1, 3, 9} and all(t > 0 for t in costs.values())


def test_predicted_speedup_is_leviathans_with_the_real_verify_cost():
    # v = 1 is the paper's model τ/(γc + 1); a verify costing more than a step lowers the prediction by exactly that
    assert predicted_speedup(3.0, 4, 0.05, 1.0) == pytest.approx(3.0 / 1.2)
    assert predicted_speedup(3.0, 4, 0.05, 1.5) == pytest.approx(3.0 / 1.7)
    # break-even: τ = v(γ+1) + γc
    assert predicted_speedup(1.5 + 4 * 0.05, 4, 0.05, 1.5) == pytest.approx(1.0)


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_token_acceptance_recovers_leviathans_alpha(gamma):
    # Chains whose tokens are each accepted with probability 0.6 until the first rejection (Leviathan's i.i.d.
    # model): accepted / decided tokens recovers 0.6 at every γ, and its τ model the measured τ; Σa/Σγ does not.
    rng, alpha = random.Random(0), 0.6
    accepted = []
    for _ in range(20000):
        a = 0
        while a < gamma and rng.random() < alpha:
            a += 1
        accepted.append(a)
    drafted = [gamma] * len(accepted)
    est = token_acceptance(accepted, drafted)
    assert est == pytest.approx(alpha, abs=0.01)
    tau = sum(a + 1 for a in accepted) / len(accepted)
    assert chain_tau(est, gamma) == pytest.approx(tau, rel=0.01)
    if gamma > 1:  # the rate counts the untried tokens after a rejection as failures
        assert sum(accepted) / sum(drafted) < alpha - 0.05
    assert token_acceptance([gamma] * 5, [gamma] * 5) == 1.0  # nothing rejected


def test_cost_budget_keeps_the_nodes_that_pay_for_their_verify():
    from specdec.sampling.trees import cost_budget

    p = torch.tensor([0.9, 0.8, 0.5, 0.1, 0.05])  # path probabilities, best first
    flat = [0.0] + [1.0] * 10  # v(n) for n = 0..10: a GPU-like curve, every node is free
    assert cost_budget(p, flat, 16) == 5 and cost_budget(p, flat, 3) == 3  # all of them, up to the budget
    step = [0.0, 1.0, 1.0, 1.0, 1.0, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5]  # a new pass over the weights from 5 tokens on
    # (1 + 0.9 + 0.8 + 0.5) / 1 = 3.2 with 3 nodes; a 4th would make it 3.3 / 1.5
    assert cost_budget(p, step, 16) == 3
    assert cost_budget(torch.tensor([0.99] * 8), step, 16) == 8  # confident nodes pay for the step: 8.92/1.5 > 3.97


def test_verify_costs_measures_once_per_base_and_charges_the_next_measured_size(tiny, monkeypatch):
    import specdec.sampling.cost as cost

    asked = []

    def linear(base, ns, **kw):  # T_n = n
        asked.append(list(ns))
        return {n: float(n) for n in ns}

    monkeypatch.setattr(cost, "forward_costs", linear)
    monkeypatch.setattr(cost, "_CURVES", weakref.WeakKeyDictionary())  # no curve another test measured
    v = cost.verify_costs(tiny, 30, auto_engine())
    assert asked == [[*range(1, 17), 20, 24, 28, 30]]  # every size up to 16, every 4th beyond
    assert v[:3] == [0.0, 1.0, 2.0] and v[16] == 16 and v[17] == 20 and v[29] == 30 and len(v) == 31
    assert cost.verify_costs(tiny, 12, auto_engine()) == v[:13] and len(asked) == 1  # read back, not measured again
    rows = cost.verify_costs(tiny, 3000, auto_engine(), every=1000)  # a batch of 1,000 rows verifying 1-3 tokens each
    assert asked[-1] == [1, 1000, 2000, 3000] and rows[2000] == 2000 and rows[1001] == 2000
