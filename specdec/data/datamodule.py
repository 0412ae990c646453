"""Token blocks for drafter training: source rows -> chat-template rendering -> tokenise -> document-level
train/val split -> pack into fixed-length blocks. The packed result is cached on disk (keyed by the text,
the tokenizer and the packing settings), so a second run starts in a second."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import lightning as L
import numpy as np
import torch
from datasets import Dataset, DatasetDict, load_from_disk
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from specdec.data.sampler import train_loader


class TextDataModule(L.LightningDataModule):
    def __init__(
        self,
        source: Callable[[], Dataset],
        tokenizer: PreTrainedTokenizerBase,
        block_size: int = 256,
        batch_size: int = 4,
        val_fraction: float = 0.02,
        max_val_blocks: int | None = 64,
        num_workers: int = 0,
        seed: int = 0,
        cache_dir: str | None = "~/.cache/specdec/data",
    ):
        super().__init__()
        self.source = source
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_val_blocks = max_val_blocks
        self.num_workers = num_workers
        self.seed = seed
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else None
        self.blocks: DatasetDict | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.blocks is None:
            self.blocks = self._packed().with_format("torch")

    def train_dataloader(self) -> DataLoader:
        return train_loader(self.blocks["train"], self.batch_size, self.seed, self.num_workers, self.trainer)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.blocks["val"], batch_size=self.batch_size, num_workers=self.num_workers)

    def train_token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs in the training blocks [vocab_size] (picks a reduced draft vocab)."""
        self.setup()
        ids = torch.as_tensor(self.blocks["train"][:]["input_ids"]).flatten()
        return torch.bincount(ids, minlength=vocab_size)

    # -- building ----------------------------------------------------------------------------
    def _packed(self) -> DatasetDict:
        ds = self.source()
        texts = self._texts(ds)
        if not texts:
            raise ValueError(f"the training data has no usable rows ({len(ds)} rows, all empty)")
        key = self._cache_key(texts)
        path = self.cache_dir / key if self.cache_dir else None
        if path is not None and path.exists():
            return load_from_disk(str(path))
        packed = self._pack_splits(texts)
        if path is not None:  # temp dir + rename: an interrupted run never leaves a half-written cache
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=path.parent, prefix=".tmp-")
            packed.save_to_disk(tmp)
            try:
                os.replace(tmp, path)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)  # another process cached the same key first
        return packed

    def _texts(self, ds: Dataset) -> list[str]:
        if "messages" in ds.column_names:
            render = lambda m: self.tokenizer.apply_chat_template(m, tokenize=False)  # noqa: E731
            return [render(m) for m in ds["messages"]]
        return [t for t in ds["text"] if t and t.strip()]

    def _cache_key(self, texts: list[str]) -> str:
        h = hashlib.sha256()
        for t in texts:
            h.update(hashlib.sha256(t.encode()).digest())
        tok = self.tokenizer
        settings = (tok.name_or_path, len(tok), tok.eos_token_id, self.block_size, self.val_fraction,
                    self.max_val_blocks, self.seed)
        h.update(repr(settings).encode())
        return h.hexdigest()[:24]

    def _pack_splits(self, texts: list[str]) -> DatasetDict:
        # Split by document before packing, so no validation block shares a document with training.
        order = np.random.default_rng(self.seed).permutation(len(texts))
        n_val = max(1, round(self.val_fraction * len(texts))) if len(texts) > 1 else 0
        val_docs = [texts[i] for i in order[:n_val]]
        train_docs = [texts[i] for i in order[n_val:]] or val_docs
        train, val = self._pack(train_docs), self._pack(val_docs)
        if self.max_val_blocks is not None:
            val = val[: self.max_val_blocks]
        if len(train) == 0 or len(val) == 0:
            raise ValueError(f"too little text for blocks of {self.block_size} tokens "
                             f"({len(train)} train / {len(val)} val blocks)")
        return DatasetDict({"train": Dataset.from_dict({"input_ids": train}),
                            "val": Dataset.from_dict({"input_ids": val})})

    def _pack(self, docs: list[str]) -> np.ndarray:
        """Concatenate documents, each closed by EOS, and cut into [N, block_size] (the tail is dropped)."""
        if not docs:
            return np.zeros((0, self.block_size), dtype=np.int64)
        eos = self.tokenizer.eos_token_id
        ids = self.tokenizer(docs, add_special_tokens=False)["input_ids"]
        flat = np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.int64)
        n = len(flat) // self.block_size
        return flat[: n * self.block_size].reshape(n, self.block_size)
