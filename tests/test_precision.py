"""trainer.precision=auto: bf16 autocast only where it is measured faster, fp32 otherwise and when bf16 fails."""

import json

import pytest
import torch

from specdec import precision
from specdec.precision import choose_precision
from test_train import trained_and_untrained


def _timings(monkeypatch, fp32: float, bf16: float | Exception, probe_bf16: float | None = None) -> list:
    """Fake product timings (the probe's bf16 its own where given); returns the (dtype, rows, out) timed."""
    timed = []

    def fake(dtype, hidden, out, repeats, rows=precision.ROWS):
        timed.append((dtype, rows, out))
        value = fp32 if dtype == torch.float32 else probe_bf16 if rows == precision.PROBE_ROWS and probe_bf16 else bf16
        if isinstance(value, Exception):
            raise value
        return value

    monkeypatch.setattr(precision, "_time_product", fake)
    return timed


@pytest.mark.parametrize("fp32, bf16, want", [(2.2, 1.0, "bf16-mixed"), (1.0, 1.0, "32-true"), (1.0, 3.0, "32-true"),
                                              (1.2, 1.0, "32-true")])
def test_cpu_picks_the_faster(monkeypatch, fp32, bf16, want):
    _timings(monkeypatch, fp32, bf16)
    chosen, why = choose_precision("cpu", 64, 128)
    assert chosen == want and f"{fp32 / bf16:.2f}x" in why


def test_a_slow_probe_decides_fp32_without_the_full_product(monkeypatch):
    # Zen 2: bf16 ~40x slower than fp32; the lm_head-sized product would take minutes a repeat
    timed = _timings(monkeypatch, 1.0, 0.5, probe_bf16=40.0)
    chosen, why = choose_precision("cpu", 576, 49152)
    assert chosen == "32-true" and "probe" in why and "0.03x" in why
    assert {(rows, out) for _, rows, out in timed} == {(precision.PROBE_ROWS, precision.PROBE_OUT)}


def test_a_probe_that_is_not_slow_leaves_the_verdict_to_the_full_product(monkeypatch):
    # a native bf16 CPU may lose on a small product and still win on the real one
    timed = _timings(monkeypatch, 2.2, 1.0, probe_bf16=1.5)
    assert choose_precision("cpu", 576, 49152)[0] == "bf16-mixed"
    assert (torch.bfloat16, precision.ROWS, 49152) in timed


def test_falls_back_to_fp32_without_bf16_kernels(monkeypatch):
    _timings(monkeypatch, 1.0, RuntimeError("no bf16 kernel for this CPU"))
    chosen, why = choose_precision("cpu", 64, 128)
    assert chosen == "32-true" and "no bf16 kernel" in why


def test_cuda_by_capability(monkeypatch):
    for supported, want in [(True, "bf16-mixed"), (False, "32-true")]:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: supported)
        assert choose_precision("cuda", 64, 128)[0] == want


@pytest.mark.parametrize("min_gain, want", [(0.0, "bf16-mixed"), (float("inf"), "32-true")])
def test_real_timing_decides_by_the_measured_gain(monkeypatch, min_gain, want):
    # the real products, timed; the thresholds make the verdict known whatever this CPU measures
    monkeypatch.setattr(precision, "PROBE_LOSS", float("inf"))  # the probe never decides alone
    monkeypatch.setattr(precision, "MIN_GAIN", min_gain)
    chosen, why = choose_precision("cpu", 32, 64, repeats=1)
    assert chosen == want and f"([{precision.ROWS}, 32] x [32, 64])" in why


@pytest.mark.parametrize("bf16", [0.5, 2.0])
def test_train_resolves_auto(monkeypatch, corpus, tmp_path, bf16):
    _timings(monkeypatch, 1.0, bf16)
    overrides = ["base=tiny", "data=text", "data.block_size=32", "data.batch_size=2", "data.val_fraction=0.2",
                 f"data.source.path={corpus}/*.txt", "drafter=medusa", "drafter.num_heads=2", "trainer.precision=auto"]
    trained, untrained = trained_and_untrained(overrides, tmp_path, lr=1e-2)
    assert trained["val/expected_tau"] > untrained["val/expected_tau"] + 0.005  # it learns in the precision chosen
    result = json.loads((tmp_path / "trained" / "run" / "result.json").read_text())
    assert result["precision"] == ("bf16-mixed" if bf16 == 0.5 else "32-true")
    assert result["config"]["trainer"]["precision"] == "auto"  # the config as given: a rerun compares equal
