"""Offline base features. One pass of the frozen base over the packed token blocks of a data module stores what
drafters train from — the hidden states of the layers they read and the base's next-token distribution as
top-k log-probs (the rest of the mass is implied) — in memory-mapped shards, so training runs many epochs
without ever running the base (EAGLE / speculators style).

Layout of `out_dir`:
    meta.json                       settings, base fingerprint, blocks per split, a hash of the token ids
    {train,val}/00000/              one shard = up to `shard_blocks` blocks of T tokens, written atomically
        input_ids.npy   [n, T]      int32
        hidden_{l}.npy  [n, T, H]   float16 or float32; l = layer key (-1 = last, normed)
        top_idx.npy     [n, T, k]   int32, descending probability
        top_logp.npy    [n, T, k]   float32 log-probs of the base (full-vocab softmax)
        loss_mask.npy   [n, T]      uint8, 1 on the tokens of the base's answers (blocks of chat messages only;
                                    meta.json's answer_mask says whether the cache has it)

The base runs in bf16 autocast where this machine multiplies bf16 clearly faster (`precision=auto`, timed by
specdec.precision as for training; bf16 rounds the stored hidden states and top-k targets, so a cache records it),
else in its own dtype; meta.json records which.

Run: python -m specdec.data.features [data=distilled] [layers=[-1,8]] [topk=64] [precision=auto|fp32|bf16]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from specdec.base import LAST, Base
from specdec.checkpoint import write_json
from specdec.precision import AUTO, choose_precision

STORE_DTYPES = {"float16": np.float16, "float32": np.float32}


def cache_features(
    datamodule,
    base: Base,
    out_dir: str,
    layers: tuple[int, ...] = (LAST,),
    topk: int = 64,
    dtype: str = "float16",
    shard_blocks: int = 256,
    batch_size: int = 8,
    max_train_blocks: int | None = None,
    precision: str = "fp32",
) -> dict:
    """Cache features of every train/val block of `datamodule` (a TextDataModule) under `out_dir`. Resumable:
    complete shards are kept and a rerun computes only the missing ones; a rerun with other settings, another
    base or other blocks is refused. precision: fp32 (the base's own dtype), bf16 (autocast) or auto (bf16 where
    measured faster here; a cache being resumed keeps its own). Returns the meta dict."""
    if dtype not in STORE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(STORE_DTYPES)}, got {dtype!r}")
    out = Path(out_dir).expanduser()
    precision = _resolve_precision(precision, base, out)
    topk = min(topk, base.vocab_size)
    datamodule.setup()
    splits = {name: torch.as_tensor(datamodule.blocks[name][:]["input_ids"]) for name in ("train", "val")}  # [N, T]
    answer_mask = "loss_mask" in datamodule.blocks["train"].column_names
    masks = {name: torch.as_tensor(datamodule.blocks[name][:]["loss_mask"]) if answer_mask else None
             for name in splits}  # [N, T]
    if max_train_blocks is not None:  # a quick cache (the demo): the first blocks of the shuffled training split
        splits["train"] = splits["train"][:max_train_blocks]
        masks["train"] = masks["train"][:max_train_blocks] if answer_mask else None
    meta = {
        "layers": [int(l) for l in layers],
        "topk": topk,
        "dtype": dtype,
        "precision": precision,
        "shard_blocks": shard_blocks,
        "block_size": int(splits["train"].shape[1]),
        "blocks": {name: int(ids.shape[0]) for name, ids in splits.items()},
        "tokens_sha256": tokens_hash(splits),
        "answer_mask": answer_mask,
        "base_name": base.name,
        "fingerprint": base.fingerprint(),
    }
    _write_or_check_meta(out, meta)

    start, computed = time.perf_counter(), 0
    for name, ids in splits.items():
        shards = range(0, ids.shape[0], shard_blocks)
        for s, lo in enumerate(tqdm(shards, desc=f"features {name}", unit="shard")):
            path = out / name / f"{s:05d}"
            if path.exists():  # finished by an earlier (interrupted) run
                continue
            with torch.autocast(base.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                arrays = _shard(base, ids[lo : lo + shard_blocks], meta["layers"], topk, STORE_DTYPES[dtype],
                                batch_size)
            if answer_mask:
                arrays["loss_mask"] = masks[name][lo : lo + shard_blocks].numpy().astype(np.uint8)
            _save_atomic(path, arrays)
            computed += arrays["input_ids"].size
    elapsed = time.perf_counter() - start
    if computed:
        print(f"[specdec] cached features of {computed:,} tokens in {elapsed:.0f} s ({computed / elapsed:.0f} tok/s, "
              f"the base in {precision}), {bytes_per_token(out):,.0f} bytes/token -> {out}")
    return meta


@torch.no_grad()
def _shard(base: Base, ids: torch.Tensor, layers: list[int], topk: int, store: type, batch_size: int) -> dict:
    """ids [n, T] -> numpy arrays of one shard (see the module docstring)."""
    parts: dict[str, list[np.ndarray]] = {}
    for lo in range(0, ids.shape[0], batch_size):
        batch = ids[lo : lo + batch_size].to(base.device)  # [b, T]
        feats = base.features(batch, layers=tuple(layers))
        logp = torch.log_softmax(feats.logits.float(), -1)  # [b, T, V]
        top_logp, top_idx = logp.topk(topk, dim=-1)  # [b, T, k], sorted descending
        row = {"input_ids": batch.int(), "top_idx": top_idx.int(), "top_logp": top_logp}
        row |= {f"hidden_{l}": feats.hidden[l].float() for l in layers}
        for key, t in row.items():
            arr = t.cpu().numpy()
            parts.setdefault(key, []).append(arr.astype(store) if key.startswith("hidden_") else arr)
    return {key: np.concatenate(chunks) for key, chunks in parts.items()}


def _resolve_precision(precision: str, base: Base, out: Path) -> str:
    """fp32 | bf16 for `precision` (fp32 | bf16 | auto). auto: a cache being resumed keeps the precision it was begun
    in (a meta.json without one: fp32), else bf16 where choose_precision times bf16 products ≥ 1.25x faster on
    this device for the base's widest product (its lm_head), else fp32; the choice is printed."""
    if precision not in (AUTO, "fp32", "bf16"):
        raise ValueError(f"precision must be auto, fp32 or bf16, got {precision!r}")
    if precision != AUTO:
        return precision
    existing = _existing_meta(out)
    if existing is not None:
        return existing["precision"]
    if base.dtype != torch.float32:  # a base loaded in bf16/fp16 runs in its own dtype either way
        return "fp32"
    chosen, why = choose_precision(base.device, base.hidden_size, base.vocab_size)
    precision = "bf16" if chosen == "bf16-mixed" else "fp32"
    print(f"[specdec] feature pass in {precision} ({why})", flush=True)
    return precision


def _save_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    for key, arr in arrays.items():
        np.save(tmp / f"{key}.npy", arr)
    try:
        os.replace(tmp, path)
    except OSError:  # another process finished this shard first
        shutil.rmtree(tmp, ignore_errors=True)


def tokens_hash(splits: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, ids in splits.items():
        h.update(name.encode())
        h.update(ids.numpy().astype(np.int32).tobytes())
    return h.hexdigest()[:24]


def _existing_meta(out: Path) -> dict | None:
    """The meta.json of a cache begun under `out`, or None."""
    path = out / "meta.json"
    if not path.exists():
        return None
    meta = json.loads(path.read_text())
    meta.setdefault("precision", "fp32")  # a meta.json without the key: the base ran in its own dtype
    return meta


def _write_or_check_meta(out: Path, meta: dict) -> None:
    old = _existing_meta(out)
    if old is not None:
        # (a meta.json without answer_mask is the same cache without the mask: kept, and refused only by a training
        # that asks for the mask)
        diff = sorted(k for k in meta if old.get(k) != meta[k] and (k in old or k != "answer_mask"))
        if diff:
            raise ValueError(f"{out} holds a feature cache with other {', '.join(diff)}; "
                             f"use another out_dir or delete it")
        return
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "meta.json", meta)


def read_meta(path: str | Path) -> dict:
    meta = Path(path).expanduser() / "meta.json"
    if not meta.exists():
        raise FileNotFoundError(f"no feature cache at {meta.parent} (build one with: python -m specdec.data.features)")
    return json.loads(meta.read_text())


def bytes_per_token(path: str | Path) -> float:
    root = Path(path).expanduser()
    files = list(root.glob("*/[0-9]*/*.npy"))
    tokens = sum(np.load(f, mmap_mode="r").size for f in files if f.name == "input_ids.npy")
    return sum(f.stat().st_size for f in files) / max(tokens, 1)


@hydra.main(version_base="1.3", config_path="../../configs", config_name="features")
def main(cfg: DictConfig) -> None:
    print(OmegaConf.to_yaml(cfg, resolve=False))
    base: Base = hydra.utils.instantiate(cfg.base)
    datamodule = hydra.utils.instantiate(cfg.data)(tokenizer=base.tokenizer)
    if hasattr(datamodule, "check"):  # e.g. distilled text of another base: refused before the base runs
        datamodule.check(base)
    cache_features(datamodule, base, cfg.out_dir, layers=tuple(cfg.layers), topk=cfg.topk, dtype=cfg.dtype,
                   shard_blocks=cfg.shard_blocks, batch_size=cfg.batch_size, max_train_blocks=cfg.max_train_blocks,
                   precision=cfg.precision)


if __name__ == "__main__":
    main()
