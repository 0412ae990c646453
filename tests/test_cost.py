"""The verify-cost curve and the walltime model built on it (specdec/sampling/cost.py, SPEC.md §8)."""

import pytest

import random

from specdec.sampling.cost import chain_tau, forward_costs, predicted_speedup, verify_curve
from specdec.sampling.metrics import token_acceptance


def test_forward_costs_on_the_tiny_base(tiny):
    costs = forward_costs(tiny, [1, 3, 9], prompt_len=12, reps=2)
    assert set(costs) == {1, 3, 9} and all(t > 0 for t in costs.values())
    assert verify_curve(costs)[1] == 1.0


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
