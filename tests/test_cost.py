"""The verify-cost curve and the walltime model built on it (specdec/sampling/cost.py, SPEC.md §8)."""

import pytest

from specdec.sampling.cost import forward_costs, predicted_speedup, verify_curve


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
