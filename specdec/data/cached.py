"""Training from a feature cache (see features.py): batches carry the base's hidden states and top-k targets,
so a training step never runs the base. Drop-in for TextDataModule: python train.py data=cached

Caches of other text can join the training split (`mix`): the targets are the base's own distribution over
whatever text the blocks hold, so any text the base reads is training signal for a drafter; validation stays on
the main cache, so its numbers compare with runs trained on that cache alone. A mix cache larger than the main one
would crowd it out of the batches; `mix_share` caps the mix caches' share of the training blocks with the first of
their (shuffled) blocks, the same on every run, so a resumed run sees the same blocks."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from specdec.data.features import read_meta
from specdec.data.sampler import train_loader


class FeatureShards(Dataset):
    """Blocks of one split across its memory-mapped shards. An item is
    {input_ids [T] long, hidden {layer: [T, H]} (stored dtype), top_idx [T, k] long, top_logp [T, k] float,
    loss_mask [T] bool (the cache's answer mask; all true in a shard without one)}.
    keep: the blocks (indices into all the shards' blocks, in order) this dataset holds; None: every block."""

    def __init__(self, roots: list[Path], layers: list[int], keep: np.ndarray | None = None):
        self.shards = []
        done = [p for root in roots if root.exists()
                for p in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))]
        for d in done:
            arrays = {"input_ids": np.load(d / "input_ids.npy", mmap_mode="r"),
                      "top_idx": np.load(d / "top_idx.npy", mmap_mode="r"),
                      "top_logp": np.load(d / "top_logp.npy", mmap_mode="r")}
            if (d / "loss_mask.npy").exists():
                arrays["loss_mask"] = np.load(d / "loss_mask.npy", mmap_mode="r")
            arrays |= {l: np.load(d / f"hidden_{l}.npy", mmap_mode="r") for l in layers}
            self.shards.append(arrays)
        self.layers = layers
        sizes = [len(s["input_ids"]) for s in self.shards]
        self.starts = np.cumsum([0, *sizes])
        self.keep = np.arange(self.starts[-1]) if keep is None else np.sort(np.asarray(keep, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, item: int) -> dict:
        i = int(self.keep[item])
        s = int(np.searchsorted(self.starts, i, side="right")) - 1
        shard, r = self.shards[s], i - int(self.starts[s])
        return {
            "input_ids": torch.from_numpy(shard["input_ids"][r].astype(np.int64)),
            "hidden": {l: torch.from_numpy(np.array(shard[l][r])) for l in self.layers},
            "top_idx": torch.from_numpy(shard["top_idx"][r].astype(np.int64)),
            "top_logp": torch.from_numpy(np.array(shard["top_logp"][r])),
            "loss_mask": (torch.from_numpy(shard["loss_mask"][r] == 1) if "loss_mask" in shard
                          else torch.ones(len(shard["input_ids"][r]), dtype=torch.bool)),
        }

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs in the kept blocks [vocab_size]."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for shard, start, end in zip(self.shards, self.starts[:-1], self.starts[1:]):
            rows = self.keep[(self.keep >= start) & (self.keep < end)] - start
            ids = np.asarray(shard["input_ids"][rows], dtype=np.int64)  # [rows, T]
            counts += torch.bincount(torch.from_numpy(ids).flatten(), minlength=vocab_size)
        return counts


class CachedFeatures(L.LightningDataModule):
    def __init__(self, path: str, batch_size: int = 4, num_workers: int = 0, seed: int = 0, tokenizer=None,
                 mix: list[str] | None = None, mix_share: float | None = None, train_share: float | None = None):
        """`tokenizer` is accepted so every data config is built the same way; the cache already holds token ids.
        mix: further caches whose training blocks join this one's (same base; validation stays this cache's).
        mix_share: at most this share of the training blocks comes from `mix` (0 <= share < 1); None: all of it.
        train_share: train on the first share of this cache's training blocks (0 < share <= 1), a seeded sample of
        them (a learning curve's points); None: all of them. Validation is the same whatever the share."""
        super().__init__()
        if mix_share is not None and not 0 <= mix_share < 1:
            raise ValueError(f"mix_share must be in [0, 1) or null, got {mix_share}")
        if train_share is not None and not 0 < train_share <= 1:
            raise ValueError(f"train_share must be in (0, 1] or null, got {train_share}")
        self.mix_share, self.train_share = mix_share, train_share
        self.path = Path(path).expanduser()
        self.meta = read_meta(self.path)
        self.mix = [Path(p).expanduser() for p in mix or []]
        self.mix_meta = [read_meta(p) for p in self.mix]
        for p, m in zip(self.mix, self.mix_meta):  # blocks of one batch must stack
            differ = [k for k in ("block_size", "topk", "dtype") if m[k] != self.meta[k]]
            if differ:
                raise ValueError(f"feature cache {p} cannot join {self.path}: they differ in {', '.join(differ)}")
        # the layers every cache stores: what a mixed batch can carry
        self.layers = [l for l in self.meta["layers"] if all(l in m["layers"] for m in self.mix_meta)]
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.splits: dict[str, FeatureShards] = {}

    @property
    def answer_mask(self) -> bool:
        """Whether every cache read (the main one and the mix) holds the answer mask (module.loss_on=answers needs
        it; a shard without one reads as all ones)."""
        return all(m.get("answer_mask", False) for m in [self.meta, *self.mix_meta])

    def check(self, base, drafter) -> None:
        """One-line errors before any training: a cache of another base, or without the layers the drafter reads."""
        fp = base.fingerprint()
        for path, meta in zip([self.path, *self.mix], [self.meta, *self.mix_meta]):
            diff = sorted(k for k in fp if meta["fingerprint"].get(k) != fp[k])
            if diff:
                raise ValueError(f"feature cache {path} was built on another base "
                                 f"({meta['base_name']}; differs in {', '.join(diff)})")
            missing = sorted(set(drafter.feature_layers) - set(meta["layers"]))
            if missing:
                raise ValueError(f"feature cache {path} has layers {meta['layers']}, {type(drafter).__name__} reads "
                                 f"{list(drafter.feature_layers)}: rebuild it with layers={sorted(set(meta['layers']) | set(missing))}")

    def setup(self, stage: str | None = None) -> None:
        if not self.splits:
            for path, meta in zip([self.path, *self.mix], [self.meta, *self.mix_meta]):
                for name in ("train", "val"):
                    have = len(FeatureShards([path / name], []))
                    if have != meta["blocks"][name]:  # an interrupted features run
                        raise ValueError(f"feature cache {path} is incomplete: {name} has {have} of "
                                         f"{meta['blocks'][name]} blocks; rerun python -m specdec.data.features")
            self.splits = {"train": FeatureShards([p / "train" for p in [self.path, *self.mix]], self.layers,
                                                  keep=self._train_blocks()),
                           "val": FeatureShards([self.path / "val"], self.layers)}

    def _train_blocks(self) -> np.ndarray | None:
        """The training blocks kept under mix_share (indices into the blocks of [main, *mix] in order): all of the main
        cache's, then the first blocks of each mix cache, in proportion to its size. A cache's training split is
        stored shuffled, so its first blocks are a seeded sample of it, and the same blocks a cache built with
        `max_train_blocks` holds. Under train_share the main cache keeps its first share of blocks, and the mix its
        proportion of those. None keeps every block."""
        if self.mix_share is None and self.train_share is None:
            return None
        sizes = [self.meta["blocks"]["train"], *(m["blocks"]["train"] for m in self.mix_meta)]
        n_main, n_mix = sizes[0], sum(sizes[1:])
        if self.train_share is not None:
            n_main = max(1, round(self.train_share * n_main))
        if self.mix_share is None:  # every mix block, or its share of them under train_share
            take = n_mix if self.train_share is None else round(self.train_share * n_mix)
        else:  # mix / (main + mix) <= share  <=>  mix <= share * main / (1 - share)
            take = min(n_mix, int(self.mix_share * n_main / (1 - self.mix_share)))
        starts = np.cumsum([0, *sizes])
        kept = [np.arange(n_main)] + [starts[i] + np.arange(take * sizes[i] // max(n_mix, 1))
                                      for i in range(1, len(sizes))]
        return np.concatenate(kept)

    def train_token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs in the training blocks [vocab_size] (picks a reduced draft vocab)."""
        self.setup()
        return self.splits["train"].token_counts(vocab_size)

    def train_dataloader(self) -> DataLoader:
        return train_loader(self.splits["train"], self.batch_size, self.seed, self.num_workers, self.trainer)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=self.batch_size, num_workers=self.num_workers)
