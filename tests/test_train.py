"""train.py in-process: fast_dev_run per drafter family on the tiny base, and a short real run that writes
CSV metrics and a drafter checkpoint."""

import json
from pathlib import Path

import pytest

from conftest import CONFIGS, compose_train
from specdec.checkpoint import load_drafter, read_meta
from specdec.training import train

DRAFTERS = sorted(p.stem for p in (CONFIGS / "drafter").glob("*.yaml"))
# Drafter settings that must fit a 2-layer tiny base.
TINY_DRAFTER = {"early_exit": ["drafter.exit_layers=[1]"], "draft_model": ["drafter.num_layers=1"],
                "layer_skip": ["drafter.search.prompts=2", "drafter.search.prompt_len=8",
                               "drafter.search.max_new_tokens=8", "drafter.search.cost_reps=1"]}
CALIBRATED = {"layer_skip"}  # no trainable weights: train.py runs their calibration (a search) instead
TINY_DATA = ["base=tiny", "data=text", "data.block_size=32", "data.batch_size=2", "data.val_fraction=0.2"]
# Their copy inits start at (early exit: the whole 2-layer base) or near the tiny base, with nothing left to learn
FROM_SCRATCH = {"early_exit": ["drafter.extra_init=fresh"], "draft_model": ["drafter.init=fresh"]}
# 16 steps at a constant lr (the default schedule warms up from lr = 0), validated once at the end
LEARN = ["module.scheduler=null", "trainer.max_steps=16", "trainer.val_check_interval=16", "logger=csv",
         "callbacks.progress_bar.refresh_rate=0"]


def trained_and_untrained(overrides: list[str], tmp_path: Path, lr: float = 3e-3) -> tuple[dict, dict]:
    """The val metrics of `overrides` trained for 16 steps at `lr`, and of the same run at lr = 0: the same drafter
    untrained (same seed, init, data order and validation blocks)."""
    return tuple(train(compose_train([*overrides, *LEARN, f"module.optimizer.lr={rate}"], tmp_path / name))
                 for name, rate in (("trained", lr), ("untrained", 0.0)))


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_fast_dev_run(drafter, corpus, tmp_path):
    cfg = compose_train([*TINY_DATA, f"data.source.path={corpus}/*.txt", f"drafter={drafter}", "debug=fdr",
                         *TINY_DRAFTER.get(drafter, [])], tmp_path)
    metrics = train(cfg)
    assert "val/expected_tau" in metrics
    assert "train/loss" in metrics or drafter in CALIBRATED
    assert all(v == pytest.approx(v) for v in metrics.values())  # finite, not NaN
    if drafter in CALIBRATED:  # the search measured every skip set of the 2-layer base through the sampler
        record = json.loads((tmp_path / "run" / "calibration.json").read_text())
        trials = {tuple(t["skip_layers"]): t for t in record["trials"]}
        assert trials[()]["alpha"] == 1.0 and trials[()]["measured_tau"] == 5.0  # skipping none is the base itself
        assert trials[(0, 1)]["alpha"] < 0.5  # skipping both (embeddings -> norm -> head) is not


@pytest.mark.parametrize("drafter", sorted(set(DRAFTERS) - CALIBRATED))
def test_training_raises_expected_tau(drafter, corpus, tmp_path):
    """A drafter whose training does not reach its drafts (no gradient, a loss of the wrong sign) keeps or lowers the
    untrained drafter's predicted τ on the same validation blocks."""
    overrides = [*TINY_DATA, f"data.source.path={corpus}/*.txt", f"drafter={drafter}", *TINY_DRAFTER.get(drafter, []),
                 *FROM_SCRATCH.get(drafter, [])]
    trained, untrained = trained_and_untrained(overrides, tmp_path)
    assert trained["val/expected_tau"] > untrained["val/expected_tau"] + 0.005


def test_short_run_logs_and_saves_drafter(corpus, tmp_path, tiny):
    cfg = compose_train([*TINY_DATA, f"data.source.path={corpus}/*.txt", "drafter=medusa", "drafter.num_heads=2",
                         "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.log_every_n_steps=1", "logger=csv",
                         "callbacks.progress_bar.refresh_rate=0"], tmp_path)
    metrics = train(cfg)
    for key in ["val/head1_top1", "val/head2_top1", "val/head1_accept", "val/head2_accept", "val/expected_tau"]:
        assert key in metrics
    assert 0.0 <= metrics["val/head1_accept"] <= 1.0
    out = Path(cfg.paths.output_dir)
    csv = next(out.glob("csv/**/metrics.csv")).read_text()
    assert "val/expected_tau" in csv and "train/loss_step" in csv
    meta = read_meta(out / "drafter")
    assert meta["hparams"]["num_heads"] == 2 and meta["base"] == tiny.fingerprint()
    drafter = load_drafter(out / "drafter", tiny)
    assert len(drafter.heads) == 2
    assert (out / "checkpoints" / "last.ckpt").exists()
    # a rerun into the same run dir reads the finished run back instead of training again ...
    assert train(cfg) == json.loads((out / "result.json").read_text())["metrics"]
    cfg.paths.root_dir = str(tmp_path / "elsewhere")  # (a table's run sets PROJECT_ROOT; a hand run does not)
    assert train(cfg) == json.loads((out / "result.json").read_text())["metrics"]
    # ... and the same dir with another config is refused in one line, before any work
    cfg.module.optimizer.lr = 3e-3
    with pytest.raises(ValueError, match="holds a finished run with another config .differs in module"):
        train(cfg)


def test_a_run_whose_loop_never_ran_still_writes_its_drafter(corpus, tmp_path, tiny, monkeypatch):
    # a run resumed from a checkpoint whose time budget is spent can stop before the training loop, so SaveDrafter's
    # on_train_end never runs (as here: fit leaves no drafter behind): train() then writes the checkpoint's drafter
    import shutil

    import lightning as L

    fit = L.Trainer.fit

    def fit_without_the_save(trainer, *args, **kwargs):
        fit(trainer, *args, **kwargs)
        shutil.rmtree(Path(trainer.default_root_dir) / "drafter", ignore_errors=True)

    monkeypatch.setattr(L.Trainer, "fit", fit_without_the_save)
    cfg = compose_train([*TINY_DATA, f"data.source.path={corpus}/*.txt", "drafter=medusa", "trainer.max_steps=2",
                         "trainer.val_check_interval=2", "logger=csv", "callbacks.progress_bar.refresh_rate=0"],
                        tmp_path)
    metrics = train(cfg)
    out = Path(cfg.paths.output_dir)
    assert read_meta(out / "drafter")["metrics"]["val/expected_tau"] == metrics["val/expected_tau"]
    assert len(load_drafter(out / "drafter", tiny).heads) == read_meta(out / "drafter")["hparams"]["num_heads"]
