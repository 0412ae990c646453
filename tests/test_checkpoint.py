import os

import pytest
import torch

from specdec.base import tiny_base
from specdec.checkpoint import BaseMismatchError, load_drafter, save_drafter, write_text
from specdec.drafters.medusa import Medusa


def test_round_trip(tiny, tmp_path):
    m = Medusa(tiny, num_heads=2, num_layers=2)
    for p in m.parameters():
        torch.nn.init.normal_(p)
    save_drafter(m, tmp_path / "d", train_config={"lr": 1e-3}, metrics={"val/expected_tau": 1.5})
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["drafter.json", "drafter.safetensors"]
    loaded = load_drafter(tmp_path / "d", tiny)
    assert type(loaded) is Medusa and loaded.hparams == m.hparams
    for (k, a), (_, b) in zip(m.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    # nothing of the base was written: the file is only the heads
    assert (tmp_path / "d" / "drafter.safetensors").stat().st_size < 4 * sum(p.numel() for p in m.parameters()) + 4096


def test_refuses_another_base(tiny, tmp_path):
    save_drafter(Medusa(tiny, num_heads=1), tmp_path / "d")
    other = tiny_base(seed=1)
    with pytest.raises(BaseMismatchError, match="trained on base"):
        load_drafter(tmp_path / "d", other)


def test_missing_checkpoint_is_a_clear_error(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="no drafter checkpoint"):
        load_drafter(tmp_path / "nothing", tiny)


def test_atomic_write_keeps_plain_file_permissions(tmp_path):
    write_text(tmp_path / "a.txt", "x")
    (tmp_path / "b.txt").write_text("x")  # what a plain write gives under the current umask
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == (tmp_path / "b.txt").stat().st_mode & 0o777
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp file left behind


def test_paths_recorded_before_the_engines_moved_out_of_the_sampler_still_resolve():
    """What saved checkpoints and run configs record: a drafter class under specdec.drafters (unchanged) and the
    sampler's `_target_`, specdec.sampling.decode.SamplerConfig, which still names the sampler's config."""
    import importlib

    from specdec.sampling.config import SamplerConfig

    for target in ("specdec.drafters.hydra.Hydra", "specdec.drafters.medusa.Medusa", "specdec.drafters.prophet.Prophet",
                   "specdec.drafters.early_exit.EarlyExit", "specdec.drafters.layer_skip.LayerSkip",
                   "specdec.drafters.draft_model.DraftModel"):
        module, _, name = target.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), name), type)
    assert importlib.import_module("specdec.sampling.decode").SamplerConfig is SamplerConfig
