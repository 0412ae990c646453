"""Feature cache (specdec/data/features.py) and training from it (specdec/data/cached.py): the loss from the cache
equals the loss computed online, a cache resumes and refuses what it was not built for, and train.py runs on it."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.base import LAST, Base, tiny_base
from specdec.data import features as features_mod
from specdec.data.cached import CachedFeatures
from specdec.data.datamodule import TextDataModule
from specdec.data.features import cache_features
from specdec.data.sources import text
from specdec.drafters.early_exit import EarlyExit
from specdec.drafters.medusa import Medusa
from specdec.training import DraftTrainer, train

from conftest import compose_train


def text_blocks(corpus: Path, tiny, **kw) -> TextDataModule:
    source = lambda: text(f"{corpus}/*.txt")  # noqa: E731
    return TextDataModule(source, tiny.tokenizer, block_size=32, batch_size=2, val_fraction=0.2, cache_dir=None, **kw)


def module(base, drafter, **kw) -> DraftTrainer:
    m = DraftTrainer(base, drafter, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), **kw)
    m.log = lambda *a, **k: None  # no trainer attached
    return m


def trained_medusa(tiny) -> Medusa:
    """Medusa heads moved off their identity init, so the losses compared below are not trivially equal."""
    torch.manual_seed(0)
    drafter = Medusa(tiny, num_heads=3, num_layers=1)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    return drafter


def first_batches(corpus, tiny, cache: Path):
    """The same val blocks, online (token ids only) and from the cache (features included)."""
    online = text_blocks(corpus, tiny)
    online.setup()
    cached = CachedFeatures(str(cache), batch_size=2)
    cached.setup()
    a, b = next(iter(online.val_dataloader())), next(iter(cached.val_dataloader()))
    assert torch.equal(a["input_ids"], b["input_ids"])
    return a, b


@pytest.mark.parametrize("topk", [None, 16])  # None: all V tokens, the exact full KL
def test_loss_from_cache_equals_online(corpus, tiny, tmp_path, topk):
    k = topk or tiny.vocab_size
    cache_features(text_blocks(corpus, tiny), tiny, str(tmp_path / "feat"), layers=(LAST,), topk=k, dtype="float32")
    online_batch, cached_batch = first_batches(corpus, tiny, tmp_path / "feat")
    drafter = trained_medusa(tiny)
    # online: dense targets when the cache holds every token, else the same top-k computed live
    online = module(tiny, drafter, target_topk=topk)._step(online_batch, "val")
    from_cache = module(tiny, drafter)._step(cached_batch, "val")
    torch.testing.assert_close(from_cache, online, rtol=1e-5, atol=1e-5)
    assert from_cache.item() > 1e-3  # heads moved off the base: a real loss, not 0 == 0


def test_topk_loss_is_a_lower_bound_of_the_full_kl(corpus, tiny, tmp_path):
    batch = next(iter(_val_loader(corpus, tiny)))
    drafter = trained_medusa(tiny)
    full = module(tiny, drafter)._step(batch, "val")
    top = module(tiny, drafter, target_topk=8)._step(batch, "val")
    assert 0 < top.item() <= full.item() + 1e-6


def _val_loader(corpus, tiny):
    dm = text_blocks(corpus, tiny)
    dm.setup()
    return dm.val_dataloader()


def test_fp16_cache_trains_like_online(corpus, tiny, tmp_path):
    """The default storage (fp16 hidden states) changes the loss only at fp16 rounding level."""
    cache_features(text_blocks(corpus, tiny), tiny, str(tmp_path / "feat"), topk=16)
    online_batch, cached_batch = first_batches(corpus, tiny, tmp_path / "feat")
    drafter = trained_medusa(tiny)
    online = module(tiny, drafter, target_topk=16)._step(online_batch, "val")
    torch.testing.assert_close(module(tiny, drafter)._step(cached_batch, "val"), online, rtol=2e-3, atol=2e-3)


def test_cache_resumes_and_refuses_other_settings(corpus, tiny, tmp_path, monkeypatch):
    out = tmp_path / "feat"
    dm = text_blocks(corpus, tiny)
    cache_features(dm, tiny, str(out), topk=8, shard_blocks=2)
    reference = {p.relative_to(out): np.load(p) for p in out.glob("*/*/*.npy")}
    assert len({p.parent for p in reference}) >= 3  # several shards

    # interrupt a second build after its first shard, then rerun: only the missing shards are computed
    out2, real_shard, calls = tmp_path / "feat2", features_mod._shard, []

    def dies_after_one(*args, **kw):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real_shard(*args, **kw)

    monkeypatch.setattr(features_mod, "_shard", dies_after_one)
    with pytest.raises(KeyboardInterrupt):
        cache_features(dm, tiny, str(out2), topk=8, shard_blocks=2)
    with pytest.raises(ValueError, match="incomplete"):
        CachedFeatures(str(out2)).setup()
    monkeypatch.setattr(features_mod, "_shard", lambda *a, **k: calls.append(1) or real_shard(*a, **k))
    cache_features(dm, tiny, str(out2), topk=8, shard_blocks=2)
    assert len(calls) == len({p.parent for p in reference})  # every shard computed exactly once overall
    for rel, arr in reference.items():
        np.testing.assert_array_equal(np.load(out2 / rel), arr)
    assert not list(out2.glob("*/.tmp-*"))

    with pytest.raises(ValueError, match="topk"):
        cache_features(dm, tiny, str(out), topk=4, shard_blocks=2)


def test_bf16_feature_pass_is_recorded_close_and_kept_on_resume(corpus, tiny, tmp_path):
    """precision=bf16 runs the base in bf16 autocast (features near float32's; meta.json says so); auto resumes a
    cache in the precision it was begun in, a cache from before the option counts as fp32, and an explicit other
    precision is refused like any other setting."""
    dm = text_blocks(corpus, tiny)
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    cache_features(dm, tiny, str(fp32), layers=(LAST,), topk=8, dtype="float32")
    meta = cache_features(dm, tiny, str(bf16), layers=(LAST,), topk=8, dtype="float32", precision="bf16")
    assert meta["precision"] == "bf16"
    a, b = (np.load(p / "train" / "00000" / f"hidden_{LAST}.npy") for p in (fp32, bf16))
    assert not np.array_equal(a, b) and np.linalg.norm(a - b) < 0.05 * np.linalg.norm(a)
    assert cache_features(dm, tiny, str(bf16), layers=(LAST,), topk=8, dtype="float32", precision="auto")[
        "precision"] == "bf16"
    with pytest.raises(ValueError, match="precision"):
        cache_features(dm, tiny, str(bf16), layers=(LAST,), topk=8, dtype="float32", precision="fp32")
    old = json.loads((fp32 / "meta.json").read_text())
    del old["precision"]
    (fp32 / "meta.json").write_text(json.dumps(old))
    assert cache_features(dm, tiny, str(fp32), layers=(LAST,), topk=8, dtype="float32", precision="auto")[
        "precision"] == "fp32"
    with pytest.raises(ValueError, match="precision must be"):
        cache_features(dm, tiny, str(tmp_path / "x"), topk=8, precision="fp16")


def test_cache_refuses_another_base_and_missing_layers(corpus, tiny, tmp_path):
    cache_features(text_blocks(corpus, tiny), tiny, str(tmp_path / "feat"), layers=(LAST,), topk=8)
    cached = CachedFeatures(str(tmp_path / "feat"))
    cached.check(tiny, Medusa(tiny, num_heads=2))  # fine
    other = tiny_base(seed=1)
    with pytest.raises(ValueError, match="another base"):
        cached.check(other, Medusa(other, num_heads=2))
    with pytest.raises(ValueError, match=r"layers=\[-1, 1\]"):
        cached.check(tiny, EarlyExit(tiny, exit_layers=[1]))
    with pytest.raises(FileNotFoundError, match="specdec.data.features"):
        CachedFeatures(str(tmp_path / "nothing"))


def test_mixed_caches_train_on_both_and_validate_on_the_first(corpus, tiny, tmp_path):
    """data.mix: the training split is every cache's training blocks, validation only the main cache's; the batch
    carries the layers all of them store, and a cache that cannot stack with the main one is refused."""
    dm = text_blocks(corpus, tiny)
    main, extra = tmp_path / "main", tmp_path / "extra"
    cache_features(dm, tiny, str(main), layers=(LAST, 1), topk=8, max_train_blocks=2)
    cache_features(dm, tiny, str(extra), layers=(LAST,), topk=8)
    cached = CachedFeatures(str(main), batch_size=2, mix=[str(extra)])
    cached.check(tiny, Medusa(tiny, num_heads=2))
    cached.setup()
    n_extra = len(dm.blocks["train"])
    assert len(cached.splits["train"]) == 2 + n_extra and len(cached.splits["val"]) == len(dm.blocks["val"])
    assert cached.layers == [LAST]
    first_extra = cached.splits["train"][2]
    assert torch.equal(first_extra["input_ids"], torch.as_tensor(dm.blocks["train"][0]["input_ids"]))
    counts = cached.train_token_counts(tiny.vocab_size)
    assert int(counts.sum()) == (2 + n_extra) * 32  # the draft vocab is picked from every training block
    with pytest.raises(ValueError, match=r"extra has layers \[-1\]"):
        cached.check(tiny, EarlyExit(tiny, exit_layers=[1]))
    cache_features(dm, tiny, str(tmp_path / "k4"), layers=(LAST,), topk=4, max_train_blocks=2)
    with pytest.raises(ValueError, match="differ in topk"):
        CachedFeatures(str(main), mix=[str(tmp_path / "k4")])


def test_mix_share_caps_the_mixed_caches_with_their_first_blocks(corpus, tiny, tmp_path):
    """data.mix_share: every main block stays, the mix caches give at most that share of the training blocks (their
    first blocks: the ones a cache built with max_train_blocks holds), and the draft vocab counts only those."""
    dm = text_blocks(corpus, tiny)
    main, extra = tmp_path / "main", tmp_path / "extra"
    cache_features(dm, tiny, str(main), layers=(LAST,), topk=8, max_train_blocks=2)
    cache_features(dm, tiny, str(extra), layers=(LAST,), topk=8)
    n_extra = len(dm.blocks["train"])
    assert n_extra >= 3  # so a share of 0.5 (2 of them beside the main cache's 2) drops some

    def train_split(share, mix=(extra,)):
        cached = CachedFeatures(str(main), mix=[str(m) for m in mix], mix_share=share)
        cached.setup()
        return cached, [tuple(cached.splits["train"][i]["input_ids"].tolist()) for i in range(len(cached.splits["train"]))]

    everything = train_split(None)[1]
    assert len(everything) == 2 + n_extra
    cached, half = train_split(0.5)
    assert half == everything[:4]
    assert train_split(0.0)[1] == everything[:2]
    first = tmp_path / "first"  # a mix cache of only the blocks the share keeps: the same training split
    cache_features(dm, tiny, str(first), layers=(LAST,), topk=8, max_train_blocks=2)
    assert train_split(0.5, mix=(first,))[1] == half
    assert len(train_split(0.5, mix=(extra, extra))[1]) == 4  # two mix caches: one block from each
    assert int(cached.train_token_counts(tiny.vocab_size).sum()) == 4 * 32
    expected = torch.bincount(torch.tensor(half).flatten(), minlength=tiny.vocab_size)
    assert torch.equal(cached.train_token_counts(tiny.vocab_size), expected)
    with pytest.raises(ValueError, match="mix_share"):
        CachedFeatures(str(main), mix=[str(extra)], mix_share=1.0)


def test_train_share_keeps_the_first_blocks_and_the_same_validation(corpus, tiny, tmp_path):
    """data.train_share: the first share of the training blocks (a seeded sample: the split is stored shuffled),
    validation untouched; a share outside (0, 1] is refused in one line."""
    dm = text_blocks(corpus, tiny)
    path = tmp_path / "main"
    cache_features(dm, tiny, str(path), layers=(LAST,), topk=8)
    n = len(dm.blocks["train"])
    assert n >= 4

    def splits(share):
        cached = CachedFeatures(str(path), train_share=share)
        cached.setup()
        return {name: [tuple(s[i]["input_ids"].tolist()) for i in range(len(s))] for name, s in cached.splits.items()}

    everything, half = splits(None), splits(0.5)
    assert half["train"] == everything["train"][: round(n / 2)]
    assert half["val"] == everything["val"]
    assert splits(1.0) == everything
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="train_share"):
            CachedFeatures(str(path), train_share=bad)


@pytest.mark.parametrize("drafter", ["medusa", "early_exit"])
def test_train_py_from_cache(corpus, tiny, tmp_path, monkeypatch, drafter):
    """python train.py data=cached trains and saves a drafter, and the base never runs a forward."""
    cache = tmp_path / "feat"
    cache_features(text_blocks(corpus, tiny), tiny, str(cache), layers=(LAST, 1), topk=16)
    overrides = ["base=tiny", "data=cached", f"data.path={cache}", "data.batch_size=2", f"drafter={drafter}",
                 "trainer.max_steps=4", "trainer.val_check_interval=2", "callbacks.progress_bar.refresh_rate=0"]
    if drafter == "early_exit":
        overrides += ["drafter.exit_layers=[1]"]
    cfg = compose_train(overrides, tmp_path)
    calls = []
    real = Base.features
    monkeypatch.setattr(Base, "features", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    metrics = train(cfg)
    assert calls == []
    assert all(np.isfinite(metrics[k]) for k in ("train/loss", "val/loss", "val/expected_tau"))  # validation ran
    assert (Path(cfg.paths.output_dir) / "drafter" / "drafter.safetensors").exists()


RECIPES = sorted(p.stem for p in (Path(__file__).parents[2] / "configs" / "experiment" / "recipe").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_trains_from_a_cache(corpus, tmp_path, recipe):
    """Each family's recipe (experiment=recipe/<family>) trains from a feature cache as configured: its drafter
    settings, draft vocab and schedule, on a 10-layer tiny base whose cache stores the layers the recipes read."""
    base = tiny_base(num_layers=10)
    cache = tmp_path / "feat"
    # the layers every recipe reads there: the last, 8 (the prophet fuses it) and 2, 5, 9 (eagle3's, dflash's and peagle's recipes name
    # SmolLM2's inputs of 2, 15 and 29, the last layer's: here 2, L//2 and L-1)
    cache_features(text_blocks(corpus, base), base, str(cache), layers=(LAST, 2, 5, 8, 9), topk=16)
    own = ["drafter.aux_layers=[2,5,9]"] if recipe in ("eagle3", "dflash", "peagle") else []
    cfg = compose_train([f"experiment=recipe/{recipe}", "base=tiny", "base.num_layers=10", f"data.path={cache}",
                         "data.batch_size=2", "drafter.draft_vocab_size=32", "trainer.max_steps=2",
                         "trainer.max_time=null", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
                         "callbacks.progress_bar.refresh_rate=0", *own], tmp_path)
    metrics = train(cfg)
    assert all(np.isfinite(metrics[k]) for k in ("train/loss", "val/loss", "val/expected_tau"))  # validation ran
    assert (Path(cfg.paths.output_dir) / "drafter" / "drafter.safetensors").exists()


def test_features_command_on_the_tiny_base(corpus, tmp_path):
    """python -m specdec.data.features with its yaml: composes, runs, and data=cached reads what it wrote."""
    out = tmp_path / "feat"
    cfg = compose_train(["base=tiny", "data=text", f"data.source.path={corpus}/*.txt", "data.block_size=32",
                         "data.val_fraction=0.2", "layers=[-1]", "topk=8", f"out_dir={out}"], tmp_path,
                        config_name="features")
    features_mod.main.__wrapped__(cfg)
    cached = CachedFeatures(str(out))
    cached.setup()
    batch = next(iter(cached.train_dataloader()))
    assert batch["hidden"][-1].dtype == torch.float16 and batch["top_idx"].shape[-1] == 8


def test_a_quick_cache_keeps_the_first_training_blocks(corpus, tiny, tmp_path):
    dm = text_blocks(corpus, tiny)
    meta = cache_features(dm, tiny, str(tmp_path / "quick"), topk=8, max_train_blocks=2)
    assert meta["blocks"]["train"] == 2 and meta["blocks"]["val"] == len(dm.blocks["val"])
    ids = np.load(tmp_path / "quick" / "train" / "00000" / "input_ids.npy")
    assert np.array_equal(ids, np.asarray(dm.blocks["train"][:2]["input_ids"]))


def chat_blocks(tmp_path: Path, tiny) -> TextDataModule:
    """Two-turn conversations in the chat template: blocks with an answer mask."""
    from specdec.data.sources import chat

    rows = [{"messages": [{"role": "user", "content": f"request {i}: " + "why " * (i % 5 + 1)},
                          {"role": "assistant", "content": f"answer {i} " + "because " * (i % 7 + 6)}]}
            for i in range(40)]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return TextDataModule(lambda: chat(str(path)), tiny.tokenizer, block_size=32, batch_size=2, val_fraction=0.2,
                          cache_dir=None)


@pytest.mark.parametrize("topk", [None, 16])
def test_the_answer_mask_is_cached_and_trains_on_answers_alone(tiny, tmp_path, topk):
    k = topk or tiny.vocab_size
    meta = cache_features(chat_blocks(tmp_path, tiny), tiny, str(tmp_path / "feat"), topk=k, dtype="float32")
    assert meta["answer_mask"] and CachedFeatures(str(tmp_path / "feat")).answer_mask
    online = chat_blocks(tmp_path, tiny)
    online.setup()
    cached = CachedFeatures(str(tmp_path / "feat"), batch_size=2)
    cached.setup()
    pairs = list(zip(online.val_dataloader(), cached.val_dataloader()))
    assert all(torch.equal(a["loss_mask"].bool(), b["loss_mask"]) for a, b in pairs)
    mask = torch.cat([b["loss_mask"] for _, b in pairs])
    assert 0.5 < mask.float().mean() < 0.8  # the answers are the longer turns
    # a batch with both: a prompt and the answer after it
    a, b = next((a, b) for a, b in pairs if 0 < b["loss_mask"].float().mean() < 1)
    drafter = trained_medusa(tiny)
    answers = module(tiny, drafter, loss_on="answers")._step(b, "val")
    torch.testing.assert_close(answers, module(tiny, drafter, target_topk=topk, loss_on="answers")._step(a, "val"),
                               rtol=1e-5, atol=1e-5)
    assert not torch.isclose(answers, module(tiny, drafter)._step(b, "val"), rtol=1e-3)  # the mask changed the loss


def test_answers_only_training_refuses_blocks_without_a_mask(corpus, tiny, tmp_path):
    cache_features(text_blocks(corpus, tiny), tiny, str(tmp_path / "feat"), topk=16, dtype="float32")
    cached = CachedFeatures(str(tmp_path / "feat"), batch_size=2)
    assert not cached.answer_mask  # train(cfg) refuses module.loss_on=answers on it before training
    cached.setup()
    batch = next(iter(cached.val_dataloader()))
    assert batch["loss_mask"].all()  # raw text: every token counts
    with pytest.raises(ValueError, match="answer mask"):
        module(tiny, trained_medusa(tiny), loss_on="answers")._step({k: v for k, v in batch.items()
                                                                      if k != "loss_mask"}, "val")


def test_train_py_trains_on_the_answers_of_a_masked_cache_and_refuses_an_unmasked_one(corpus, tiny, tmp_path):
    masked, plain = tmp_path / "masked", tmp_path / "plain"
    cache_features(chat_blocks(tmp_path, tiny), tiny, str(masked), topk=16)
    cache_features(text_blocks(corpus, tiny), tiny, str(plain), topk=16)
    overrides = ["base=tiny", "data=cached", "data.batch_size=2", "drafter=medusa", "drafter.num_heads=2",
                 "module.loss_on=answers", "trainer.max_steps=2", "trainer.val_check_interval=2",
                 "callbacks.progress_bar.refresh_rate=0"]
    metrics = train(compose_train([*overrides, f"data.path={masked}"], tmp_path / "a"))
    assert np.isfinite(metrics["train/loss"]) and 0 <= metrics["val/head1_accept"] <= 1
    with pytest.raises(ValueError, match="answer mask"):
        train(compose_train([*overrides, f"data.path={plain}"], tmp_path / "b"))
