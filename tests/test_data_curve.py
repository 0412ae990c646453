"""experiments/data_curve.py: each run's validation rows read back, and the data size where the log-linear trend of
α reaches a target."""

import math

from conftest import experiment_script


def test_readings_and_the_trend_crossing(tmp_path):
    curve = experiment_script("data_curve")
    run = tmp_path / "run" / "csv" / "version_0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text(
        "step,train/loss_step,val/train_tokens,val/pos1_top1,val/expected_tau_greedy\n"
        "10,3.0,,,\n"  # a training row: no validation
        "50,,204800,0.30,1.40\n"
        "100,,409600,0.35,1.50\n")
    rows = curve.readings(tmp_path / "run")
    assert rows == [{"tokens": 204800.0, "alpha1": 0.30, "tau": 1.40}, {"tokens": 409600.0, "alpha1": 0.35, "tau": 1.50}]
    # α = 0.30 at 1e5 tokens, 0.40 at 1e6: +0.1 a decade, so 0.50 at 1e7
    assert math.isclose(curve.crossing([(1e5, 0.30), (1e6, 0.40)], 0.50), 1e7, rel_tol=1e-9)
    assert curve.crossing([(1e5, 0.40), (1e6, 0.40)], 0.50) is None  # a flat curve reaches nothing
