"""speculators' offline format (specdec/data/speculators_offline.py), both ways: a feature cache exported and imported
back is the same cache; a run dir laid out as their generator writes it imports as the base's own features, trains
through train.py and exports back to the states vLLM wrote; what does not fit the base is refused in one line.
speculators is not installed here: their layout is tests/fixtures/speculators_offline_format.json, transcribed from the
speculators and vLLM files it names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file, save_file

from specdec.base import LAST, Base, tiny_base
from specdec.data.features import cache_features
from specdec.data.speculators_offline import export_cache, import_run, main
from specdec.training import train

from conftest import compose_train
from test_features import chat_blocks

FORMAT = json.loads((Path(__file__).parents[1] / "fixtures" / "speculators_offline_format.json").read_text())
HS = FORMAT["run_dir"]["hidden_states"]


@pytest.fixture(scope="module")
def cache(tiny, tmp_path_factory) -> Path:
    """A float16 cache of chat blocks (with the answer mask): the last layer and the inputs of blocks 0 and 1."""
    root = tmp_path_factory.mktemp("cache")
    cache_features(chat_blocks(root, tiny), tiny, str(root / "feat"), layers=(LAST, 1, 0), topk=16)
    return root / "feat"


def their_rows(run: Path) -> list[dict]:
    """What their trainer reads of each row, per the fixture's `reader` (train/data.py ArrowDataset._get_raw_data):
    hidden_states [T, A*H], verifier_last_hidden_states [T, H], input_ids [T], loss_mask [T]."""
    rows = load_from_disk(str(run))
    out = []
    for i in range(len(rows)):
        hs = load_file(run / HS["dir"] / HS["file"].format(i=i))
        assert torch.equal(hs["token_ids"], rows[i]["input_ids"])  # else their reader skips the sample
        out.append({"hidden_states": hs["hidden_states"][:, :-1].flatten(1), "input_ids": hs["token_ids"],
                    "verifier_last_hidden_states": hs["hidden_states"][:, -1], "loss_mask": rows[i]["loss_mask"]})
    return out


def check_layout(run: Path, n_layers: int, base: Base, dtype: torch.dtype) -> None:
    """The files, columns, tensor names, dtypes and shapes of the fixture's run_dir."""
    ds = FORMAT["run_dir"]["dataset"]
    assert all((run / f).exists() for f in ds["files"]) and list(run.glob(ds["arrow_glob"]))
    rows = load_from_disk(str(run))
    assert rows.format["type"] == ds["format"]
    for c, v in ds["columns"].items():
        stored = rows.features[c].feature.dtype if hasattr(rows.features[c], "feature") else rows.features[c].dtype
        assert stored == v.get("arrow_dtype", v["dtype"]) and rows[0][c].dtype == getattr(torch, v["dtype"]), c
    files = sorted(p.name for p in (run / HS["dir"]).iterdir())
    assert files == sorted(HS["file"].format(i=i) for i in range(len(rows)))
    for i in (0, len(rows) - 1):
        hs = load_file(run / HS["dir"] / HS["file"].format(i=i))
        assert set(hs) == set(HS["tensors"]) and hs["token_ids"].dtype == torch.int64
        T = int(rows[i]["seq_len"])
        assert hs["token_ids"].shape == (T,) and hs["hidden_states"].shape == (T, n_layers, base.hidden_size)
        assert hs["hidden_states"].dtype == dtype
    freq = torch.load(run / FORMAT["run_dir"]["token_freq"]["path"], weights_only=True)
    masked = torch.cat([r["input_ids"][r["loss_mask"] == 1] for r in rows])
    assert freq == dict(zip(*(t.tolist() for t in masked.unique(return_counts=True))))


def arrays(cache: Path) -> dict[str, np.ndarray]:
    return {str(p.relative_to(cache)): np.load(p) for p in sorted(cache.glob("*/[0-9]*/*.npy"))}


def test_a_cache_exported_and_imported_back_is_the_same_cache(cache, tiny, tmp_path):
    run, back = tmp_path / "run", tmp_path / "back"
    info = export_cache(cache, run, base=tiny)
    meta = json.loads((cache / "meta.json").read_text())
    n_train, n = meta["blocks"]["train"], sum(meta["blocks"].values())
    assert info["target_layer_ids"] == [0, 1] and info["hidden_states_layer_ids"] == [0, 1, 2]  # L = 2 last
    assert int(n * info["train_data_ratio"]) == n_train  # their split is ours: training blocks first
    check_layout(run, 3, tiny, torch.float32)

    # what their trainer reads: our blocks; the aux layers in id order; the last entry normed by the verifier's
    # norm (theirs: the base's model.norm) is our LAST
    rows, ours = their_rows(run), arrays(cache)
    ids = np.concatenate([ours["train/00000/input_ids.npy"], ours["val/00000/input_ids.npy"]])
    hidden = {l: np.concatenate([ours[f"train/00000/hidden_{l}.npy"], ours[f"val/00000/hidden_{l}.npy"]])
              for l in (0, 1, LAST)}
    mask = np.concatenate([ours["train/00000/loss_mask.npy"], ours["val/00000/loss_mask.npy"]])
    for i in (0, n_train, n - 1):
        assert np.array_equal(rows[i]["input_ids"].numpy(), ids[i]) and np.array_equal(rows[i]["loss_mask"], mask[i])
        aux = rows[i]["hidden_states"].view(-1, 2, tiny.hidden_size)  # [T, A, H]
        assert np.array_equal(aux[:, 0].numpy(), hidden[0][i]) and np.array_equal(aux[:, 1].numpy(), hidden[1][i])
        with torch.no_grad():
            normed = tiny.norm(rows[i]["verifier_last_hidden_states"])
        torch.testing.assert_close(normed, torch.from_numpy(hidden[LAST][i]).float(), rtol=1e-5, atol=1e-6)

    # and back: the same blocks, masks and states bit for bit; the targets recomputed from LAST
    imported = import_run(run, back, base=tiny)
    assert imported["layers"] == [LAST, 0, 1] and imported["answer_mask"]
    for key in ("blocks", "block_size", "fingerprint", "tokens_sha256", "dtype", "topk"):
        assert imported[key] == meta[key], key
    theirs = arrays(back)
    assert theirs.keys() == ours.keys()
    for key, arr in ours.items():
        if "top_" not in key:
            assert arr.dtype == theirs[key].dtype and np.array_equal(arr, theirs[key]), key
    for split in ("train", "val"):
        np.testing.assert_allclose(theirs[f"{split}/00000/top_logp.npy"], ours[f"{split}/00000/top_logp.npy"],
                                   rtol=1e-3, atol=1e-3)
        same = theirs[f"{split}/00000/top_idx.npy"][..., 0] == ours[f"{split}/00000/top_idx.npy"][..., 0]
        assert same.mean() > 0.99  # (a near tie can swap under the f16-rounded LAST)


def write_run(run: Path, base: Base, lengths: list[int], ids: list[int], seed: int = 0,
              dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """A run dir as their pipeline writes it (the fixture's run_dir, from scripts/prepare_data.py,
    scripts/data_generation_offline.py and vLLM's example_hidden_states_connector.py): rows of random tokens with the
    second half loss-masked, and per row the base's states at vLLM's ids `ids` + [L] in `dtype`, the last taken
    before the final norm as vLLM takes it. Returns the rows with those states [T, A+1, H]."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    captured = []
    hook = base.norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    samples = []
    try:
        for T in lengths:
            tokens = torch.randint(0, base.vocab_size, (T,), generator=gen)
            with torch.no_grad():
                hs = base.model(tokens[None], output_hidden_states=True).hidden_states  # L+1 x [1, T, H]
            states = torch.stack([*(hs[k][0] for k in ids), captured.pop()[0]], dim=1).to(dtype)  # [T, A+1, H]
            samples.append({"input_ids": tokens, "loss_mask": (torch.arange(T) >= T // 2).long(), "states": states})
    finally:
        hook.remove()
    rows = Dataset.from_dict({"input_ids": [s["input_ids"] for s in samples],
                              "loss_mask": [s["loss_mask"] for s in samples], "seq_len": lengths})
    rows.set_format("torch")
    rows.save_to_disk(str(run))
    masked = torch.cat([s["input_ids"][s["loss_mask"] == 1] for s in samples])
    torch.save(dict(zip(*(t.tolist() for t in masked.unique(return_counts=True)))),
               run / FORMAT["run_dir"]["token_freq"]["path"])
    (run / HS["dir"]).mkdir()
    for i, s in enumerate(samples):
        save_file({"token_ids": s["input_ids"], "hidden_states": s["states"]},
                  str(run / HS["dir"] / HS["file"].format(i=i)))
    return samples


def packed(samples: list[dict], key: str, T: int) -> torch.Tensor:
    """The samples' `key` concatenated and cut into blocks of T (the tail dropped): [n, T, ...]."""
    flat = torch.cat([s[key] for s in samples])
    return flat[: len(flat) // T * T].reshape(-1, T, *flat.shape[1:])


def test_a_run_as_their_generator_writes_it_imports_trains_and_exports_back(tiny, tmp_path):
    run, feat, again = tmp_path / "spec_run", tmp_path / "feat", tmp_path / "again"  # (train.py writes to run/)
    lengths = [40, 23, 57, 31, 44, 18, 62, 35]
    samples = write_run(run, tiny, lengths, ids=[1, 0])  # vLLM's ids: an unsorted order is kept in the files
    check_layout(run, 3, tiny, torch.bfloat16)
    meta = import_run(run, feat, base=tiny, layer_ids=[1, 0], train_ratio=0.75, block_size=32, topk=16,
                      dtype="float32")
    train_rows, val_rows = samples[:6], samples[6:]  # int(8 * 0.75): their split, by row
    assert meta["layers"] == [LAST, 1, 0] and meta["blocks"] == {"train": sum(lengths[:6]) // 32, "val": 97 // 32}
    for split, rows in (("train", train_rows), ("val", val_rows)):
        d = feat / split / "00000"
        states = packed(rows, "states", 32).float()  # [n, 32, 3, H]: ids 1, 0, then L
        assert np.array_equal(np.load(d / "input_ids.npy"), packed(rows, "input_ids", 32).int().numpy())
        assert np.array_equal(np.load(d / "loss_mask.npy"), packed(rows, "loss_mask", 32).numpy().astype(np.uint8))
        assert np.array_equal(np.load(d / "hidden_1.npy"), states[:, :, 0].numpy())  # their id k = our key k
        assert np.array_equal(np.load(d / "hidden_0.npy"), states[:, :, 1].numpy())
        with torch.no_grad():  # their id L (pre-norm) -> our LAST, the state the lm_head reads
            last = tiny.norm(states[:, :, 2])
            top = torch.log_softmax(tiny.lm_head(last), -1).topk(16, dim=-1)
        torch.testing.assert_close(torch.from_numpy(np.load(d / f"hidden_{LAST}.npy")), last, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.load(d / "top_logp.npy"), top.values.numpy(), rtol=1e-5, atol=1e-5)
    # and it is the base's own LAST (HF's normed last entry), but for vLLM's bf16
    with torch.no_grad():
        own = tiny.features(train_rows[0]["input_ids"][None], layers=(LAST,)).hidden[LAST][0]  # [40, H]
    torch.testing.assert_close(torch.from_numpy(np.load(feat / "train/00000" / f"hidden_{LAST}.npy")[0]), own[:32],
                               rtol=0.02, atol=0.02)

    # train.py data=cached trains from it (early exit at the input of block 1, on the answers alone)
    cfg = compose_train(["base=tiny", "data=cached", f"data.path={feat}", "data.batch_size=2", "drafter=early_exit",
                         "drafter.exit_layers=[1]", "module.loss_on=answers", "trainer.max_steps=2",
                         "trainer.val_check_interval=2", "callbacks.progress_bar.refresh_rate=0"], tmp_path)
    metrics = train(cfg)
    assert np.isfinite(metrics["train/loss"])
    assert (Path(cfg.paths.output_dir) / "drafter" / "drafter.safetensors").exists()

    # and out again: the aux states as vLLM wrote them, and the last entry the very pre-norm state it wrote
    info = export_cache(feat, again, layers=[1, 0], base=tiny)
    assert info["hidden_states_layer_ids"] == [1, 0, 2]
    rows = their_rows(again)
    states = packed(train_rows, "states", 32).float()
    for i in range(3):
        hs = rows[i]["hidden_states"].view(32, 2, -1)
        assert torch.equal(hs, states[i, :, :2])
        torch.testing.assert_close(rows[i]["verifier_last_hidden_states"], states[i, :, 2], rtol=2e-3, atol=1e-5)


def one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def test_what_does_not_fit_is_refused_in_one_line(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, tiny, [20, 30, 25, 40], ids=[0, 1])
    out = tmp_path / "out"

    def refused(match, run=run, **kw):
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            import_run(run, out, **{"base": tiny, "layer_ids": [0, 1], "block_size": 16, **kw})
        assert match in one_line(e), str(e.value)
        assert not out.exists()

    refused("not a speculators run dir", run=tmp_path)
    refused("layer ids [0, 2, 1] must be distinct aux layers 0..1", layer_ids=[0, 2, 1])  # L = 2 is only accepted last
    refused("3 layers, but layer ids [0] name 1 aux layers", layer_ids=[0])
    refused("entry 0 (layer id 1) is the base's layer 0", layer_ids=[1, 0])  # the ids vLLM did not capture
    with pytest.raises(ValueError) as e:
        import_run(run, out, base=tiny_base(hidden_size=16), layer_ids=[0, 1])
    assert "hidden size 32, the base tiny-h16-l2-s0 has 16" in one_line(e)
    other = tiny_base(seed=1)
    refused(f"entry 0 (layer id 0) is none of {other.name}'s states", base=other)

    path = run / HS["dir"] / "hs_2.safetensors"
    good = load_file(path)
    bad = good["token_ids"].clone()
    bad[3] = tiny.vocab_size
    save_file({"token_ids": bad, "hidden_states": good["hidden_states"]}, str(path))
    refused(f"token id {tiny.vocab_size} is outside the vocab")
    save_file({"token_ids": good["token_ids"][:-1], "hidden_states": good["hidden_states"][:-1]}, str(path))
    refused("token_ids differ from the dataset's row 2")
    path.unlink()
    refused("hs_2.safetensors and 0 more of 4 rows' hidden states are missing")

    # the command line: the same lines, before any base loads
    capsys.readouterr()
    assert main(["import", str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hs_2.safetensors" in err
    assert main(["import", str(tmp_path / "nothing"), str(out)]) == 2
    assert "not a speculators run dir" in capsys.readouterr().err


def test_export_refuses_what_their_trainer_cannot_read(cache, tiny, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(ValueError) as e:
        export_cache(cache, out, base=tiny_base(seed=1))
    assert "was built on another base" in one_line(e)
    with pytest.raises(ValueError) as e:
        export_cache(cache, out, layers=[1, 2], base=tiny)  # 2 = L: only LAST is written as the last entry
    assert "export writes distinct aux layers 0..1 the cache holds ([0, 1])" in one_line(e)
    no_last = tmp_path / "no_last"
    no_last.mkdir()
    meta = json.loads((cache / "meta.json").read_text())
    (no_last / "meta.json").write_text(json.dumps(meta | {"layers": [1, 0]}))
    with pytest.raises(ValueError) as e:
        export_cache(no_last, out, base=tiny)
    assert "without the last (-1)" in one_line(e)
    out.mkdir()
    (out / "x").write_text("")
    capsys.readouterr()
    assert main(["export", str(cache), str(out), "--layers", "1", "5"]) == 2  # refused before any base loads
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists and is not an empty directory" in err
