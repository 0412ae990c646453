"""Hidden states in speculators' offline format (vLLM's drafter trainer), both ways: a speculators run dir -> a
specdec feature cache that `train.py data=cached` trains from (`import_run`), and any feature cache -> a run dir
their `scripts/train.py` trains from (`export_cache`).

Their format (github.com/vllm-project/speculators at c05b95b3, paths under src/speculators/ unless they name their
top directory; and vLLM's hidden-states connector). tests/fixtures/speculators_offline_format.json holds the same:

    RUN_DIR/                              scripts/train.py --data-path; scripts/prepare_data.py's --output
      dataset_info.json state.json        an HF `datasets` save_to_disk in torch format, one row per sample
      data-*.arrow                          (data_generation/preprocessing.py `_append_row`): input_ids [T] (int32 in
                                            the arrow file, int64 as read), loss_mask [T] int64 (1: trained on, the
                                            assistant's turns through their end), seq_len
      token_freq.pt                       {token id: count} over the loss-masked tokens (train/vocab_mapping.py); their
                                          train.py picks the draft vocab from it (--draft-vocab-size)
      hidden_states/hs_{i}.safetensors    row i (scripts/data_generation_offline.py; hs_connectors/transfer.py
                                          FileTransfer): token_ids [T] int64, hidden_states [T, A+1, H] in the model's
                                          dtype (vLLM kv_connector/v1/example_hidden_states_connector.py)

The A+1 entries are vLLM's eagle_aux_hidden_state_layer_ids in order: the A ids training takes as --target-layer-ids
(default [2, L//2, L-3], models/utils.py resolve_target_layer_ids), then L = num_hidden_layers, which
scripts/launch_vllm.py appends. The run dir does not record them. vLLM captures id k as the residual stream entering
decoder layer k (0: the embeddings) and id L as the stream after the last layer, before the final norm (vLLM
models/interfaces.py EagleModelMixin._maybe_add_hidden_state). Their reader (train/data.py ArrowDataset) hands
hidden_states[:, :-1] flattened [T, A*H] to the drafter and hidden_states[:, -1] [T, H] through the verifier's norm
and lm_head for the targets (models/eagle3/core.py); it trains on the first int(N * --train-data-ratio) rows
(default 0.9) and validates on the rest.

Onto our layer keys (Features.hidden: HF hidden_states[l]):

    their id k, 0 <= k < L  <->  our key k: the same tensor, the input of block k (0: the embeddings)
    their id L (pre-norm)    ->  our LAST = base.norm(it); the top-k targets are log_softmax(lm_head(LAST))
    our LAST (normed)        ->  their id L: a cache holds no pre-norm state, so export writes a state x whose
                                 RMS norm is LAST (`_unnormed`): the base's own pre-norm state where the stored
                                 precision still determines its scale, else that state at another scale, which the
                                 norm their trainer applies cannot tell apart

Our key L (HF's last entry) is normed like LAST, so only LAST crosses. Samples of any length are packed like our
text: concatenated in row order and cut into blocks of `block_size` (the tail dropped), split by row as their
trainer splits. Import reruns the base on the first sample's first tokens and refuses states that are not its own
at the ids given (naming the layer they match). A float16 cache (the default) exported in float32 (the default) and
imported back has the same blocks, answer masks and states bit for bit (a float32 cache's LAST: within float32
rounding); its top-k targets are recomputed from LAST.

Commands (their trainer: the base's HF directory as the verifier, with the layer ids export prints):
    python -m specdec.data.speculators_offline import RUN_DIR OUT_DIR [--base smollm2_135m] [--layer-ids 2 15 27]
    python train.py data=cached data.path=OUT_DIR drafter=eagle3 drafter.aux_layers=[2,15,27]
    python -m specdec.data.speculators_offline export CACHE_DIR OUT_DIR [--layers 2 15 29] [--dtype bfloat16]
    python scripts/train.py --verifier-name-or-path BASE_DIR --data-path OUT_DIR --target-layer-ids 2 15 29 \\
        --train-data-ratio R --on-missing raise
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from datasets import Dataset, load_from_disk
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specdec.base import LAST, SMOLLM2, Base, load_base
from specdec.checkpoint import write_json
from specdec.data.features import STORE_DTYPES, tokens_hash, read_meta

HS_DIR = "hidden_states"
EXPORT_META = "specdec_export.json"  # ours, beside their files (their trainer reads none it does not know)
TRAIN_RATIO = 0.9  # their --train-data-ratio default (train/config/schema.py DataArgs)
EXPORT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CHECK_TOKENS = 64  # the base reruns this many tokens of the first sample to check the layer ids


# -- theirs -> ours ----------------------------------------------------------------------------------------------
@torch.no_grad()
def import_run(run_dir: str | Path, out_dir: str | Path, base: Base | str = SMOLLM2,
               layer_ids: list[int] | None = None, train_ratio: float | None = None, block_size: int | None = None,
               topk: int | None = None, dtype: str | None = None, shard_blocks: int | None = None,
               hidden_states_dir: str | Path | None = None, check: bool = True) -> dict:
    """A speculators offline run dir -> a feature cache under `out_dir` (see the module docstring). base: the model
    vLLM ran, a Base or a name load_base takes (loaded once the run dir passes its own checks). layer_ids: the aux
    ids vLLM captured (their --target-layer-ids; a trailing L is accepted); default: what export recorded, else
    their default [2, L//2, L-3]. train_ratio: their --train-data-ratio (default: what export recorded, else 0.9).
    block_size, topk, dtype, shard_blocks: as features.py's (default: the exported cache's, else 256, 64, float16,
    256). check: rerun the base on the first sample's first tokens and refuse states that are not its own at those
    layer ids. Returns the meta dict."""
    run, out = Path(run_dir).expanduser(), Path(out_dir).expanduser()
    _refuse_existing(out)
    rows = _dataset(run)
    ours = _export_meta(run)
    cache = ours.get("cache", {})  # the exported cache's settings: a round trip rebuilds it
    block_size, topk = block_size or cache.get("block_size", 256), topk or cache.get("topk", 64)
    dtype, shard_blocks = dtype or cache.get("dtype", "float16"), shard_blocks or cache.get("shard_blocks", 256)
    if dtype not in STORE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(STORE_DTYPES)}, got {dtype!r}")
    hs_dir = Path(hidden_states_dir).expanduser() if hidden_states_dir else run / HS_DIR
    _refuse_missing(hs_dir, len(rows))
    base = _load(base) if isinstance(base, str) else base
    if ours and any(base.fingerprint().get(k) != v for k, v in ours["fingerprint"].items()):
        raise ValueError(f"{run} was exported from a cache of {ours['base_name']}, not of {base.name}")
    L = base.num_layers
    ids = _aux_ids(layer_ids if layer_ids is not None else ours.get("target_layer_ids"), L)
    ratio = train_ratio if train_ratio is not None else ours.get("train_data_ratio", TRAIN_RATIO)
    if not 0 < ratio < 1:
        raise ValueError(f"train_ratio must be in (0, 1), got {ratio}")
    topk = min(topk, base.vocab_size)
    n_train = int(len(rows) * ratio)  # their split (train/data.py ArrowDataset)
    if check:
        _check_against_base(_sample(hs_dir, 0, rows[0], base, ids), ids, base, hs_dir / "hs_0.safetensors")
    layers = [LAST, *ids]
    tmp = _tmp_beside(out)
    try:
        splits = {}
        for name, idx in (("train", range(n_train)), ("val", range(n_train, len(rows)))):
            samples = (_sample(hs_dir, i, rows[i], base, ids) for i in idx)
            blocks = _pack(samples, block_size)
            splits[name] = _write_split(tmp / name, blocks, base, ids, topk, STORE_DTYPES[dtype], shard_blocks)
        empty = [name for name, s in splits.items() if len(s) == 0]
        if empty:
            raise ValueError(f"{run}: too few tokens for blocks of {block_size} in {' and '.join(empty)} "
                             f"({len(rows)} rows, train_ratio {ratio}); pass a smaller block_size")
        meta = {
            "layers": layers,
            "topk": topk,
            "dtype": dtype,
            "precision": "fp32",  # the targets: the states as vLLM wrote them, normed and projected in float32
            "shard_blocks": shard_blocks,
            "block_size": block_size,
            "blocks": {name: len(s) for name, s in splits.items()},
            "tokens_sha256": tokens_hash({name: torch.from_numpy(s) for name, s in splits.items()}),
            "answer_mask": True,
            "base_name": base.name,
            "fingerprint": base.fingerprint(),
            "source": {"format": "speculators offline", "run_dir": str(run), "rows": len(rows),
                       "train_rows": n_train, "layer_ids": [*ids, L]},
        }
        write_json(tmp / "meta.json", meta)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[specdec] {run} ({len(rows)} samples) -> {out}: {meta['blocks']['train']} train / "
          f"{meta['blocks']['val']} val blocks of {block_size}, layers {layers}")
    return meta


def _dataset(run: Path) -> Dataset:
    """The run's rows (prepare_data.py's dataset), refused in one line where it is not one."""
    if not (run / "state.json").exists() or not (run / "dataset_info.json").exists():
        raise FileNotFoundError(f"{run} is not a speculators run dir: no dataset (prepare_data.py --output) there")
    rows = load_from_disk(str(run)).with_format("numpy")
    missing = sorted({"input_ids", "loss_mask"} - set(rows.column_names))
    if missing:
        raise ValueError(f"{run}: the dataset has no {' and no '.join(missing)} column ({rows.column_names})")
    if len(rows) == 0:
        raise ValueError(f"{run}: the dataset has no rows")
    return rows


def _export_meta(run: Path) -> dict:
    """What export_cache recorded beside a run dir it wrote ({} for one vLLM wrote)."""
    path = run / EXPORT_META
    return json.loads(path.read_text()) if path.exists() else {}


def _refuse_missing(hs_dir: Path, n: int) -> None:
    missing = [i for i in range(n) if not (hs_dir / f"hs_{i}.safetensors").exists()]
    if missing:
        raise FileNotFoundError(f"{hs_dir}: hs_{missing[0]}.safetensors and {len(missing) - 1} more of {n} rows' "
                                f"hidden states are missing (scripts/data_generation_offline.py writes them)")


def _aux_ids(ids: list[int] | None, L: int) -> list[int]:
    """Their aux layer ids, checked against a base of L layers (a trailing L, as launch_vllm.py appends it, is
    dropped: it is the last entry of every file)."""
    if ids is None:
        ids = [2, L // 2, L - 3]  # their default (models/utils.py resolve_target_layer_ids)
    ids = [int(k) for k in ids]
    if ids and ids[-1] == L:
        ids = ids[:-1]
    bad = [k for k in ids if not 0 <= k < L]
    if bad or len(set(ids)) != len(ids) or not ids:
        raise ValueError(f"layer ids {ids} must be distinct aux layers 0..{L - 1} of this {L}-layer base "
                         f"(vLLM's eagle_aux_hidden_state_layer_ids without the last, {L})")
    return ids


def _sample(hs_dir: Path, i: int, row: dict, base: Base, ids: list[int]) -> dict:
    """Row i: {input_ids [T] int64, loss_mask [T] uint8, states [T, A+1, H] float32}, refused in one line where it
    does not fit the base or its dataset row."""
    path = hs_dir / f"hs_{i}.safetensors"
    try:
        data = load_file(path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a safetensors file ({e})") from None
    if "token_ids" not in data or "hidden_states" not in data:
        raise ValueError(f"{path}: holds {sorted(data)}, not token_ids and hidden_states")
    tokens, hs = data["token_ids"].long(), data["hidden_states"]  # [T], [T, A+1, H]
    if hs.dim() != 3 or hs.shape[0] != tokens.shape[0]:
        raise ValueError(f"{path}: hidden_states {list(hs.shape)} is not [T={tokens.shape[0]}, layers, hidden]")
    if hs.shape[2] != base.hidden_size:
        raise ValueError(f"{path}: hidden size {hs.shape[2]}, the base {base.name} has {base.hidden_size}")
    if hs.shape[1] != len(ids) + 1:
        raise ValueError(f"{path}: {hs.shape[1]} layers, but layer ids {ids} name {len(ids)} aux layers and the "
                         f"last; pass the ids vLLM captured (launch_vllm.py --target-layer-ids)")
    bad = tokens[(tokens < 0) | (tokens >= base.vocab_size)]
    if len(bad):
        raise ValueError(f"{path}: token id {int(bad[0])} is outside the vocab of {base.name} "
                         f"({base.vocab_size} tokens)")
    if not torch.equal(tokens, torch.as_tensor(np.asarray(row["input_ids"]), dtype=torch.long)):
        raise ValueError(f"{path}: token_ids differ from the dataset's row {i} input_ids")
    mask = np.asarray(row["loss_mask"])
    if mask.shape != (tokens.shape[0],):
        raise ValueError(f"{path}: loss_mask of row {i} has {mask.shape[0]} entries for {tokens.shape[0]} tokens")
    if not torch.isfinite(hs).all():
        raise ValueError(f"{path}: the hidden states hold non-finite values")
    return {"input_ids": tokens, "loss_mask": (mask != 0).astype(np.uint8), "states": hs.float()}


def _pack(samples: Iterator[dict], block_size: int) -> Iterator[dict]:
    """Samples of any length -> blocks of `block_size` tokens, concatenated in order (the tail is dropped):
    {input_ids [T], loss_mask [T], states [T, A+1, H]}."""
    rest = None  # what is left of the samples so far: fewer than block_size tokens
    for s in samples:
        buf = s if rest is None else {k: (np.concatenate if k == "loss_mask" else torch.cat)([rest[k], s[k]])
                                      for k in s}
        n = len(buf["input_ids"]) // block_size
        for b in range(n):
            yield {k: v[b * block_size : (b + 1) * block_size] for k, v in buf.items()}
        rest = {k: v[n * block_size :] for k, v in buf.items()}


def _write_split(root: Path, blocks: Iterator[dict], base: Base, ids: list[int], topk: int, store: type,
                 shard_blocks: int) -> np.ndarray:
    """Blocks -> shards of features.py's layout under root; returns the split's token ids [n, T] int32."""
    out_ids, shard, s = [], [], 0
    for block in blocks:
        states = block["states"]  # [T, A+1, H] float32
        last = base.norm(states[:, -1].to(base.device, base.dtype)).float()  # [T, H]
        top_logp, top_idx = _log_probs(base, last).topk(topk, dim=-1)  # [T, k], sorted descending
        row = {"input_ids": block["input_ids"].numpy().astype(np.int32),
               "top_idx": top_idx.cpu().numpy().astype(np.int32), "top_logp": top_logp.cpu().numpy(),
               "loss_mask": block["loss_mask"], f"hidden_{LAST}": last.cpu().numpy().astype(store)}
        row |= {f"hidden_{k}": states[:, j].numpy().astype(store) for j, k in enumerate(ids)}
        shard.append(row)
        out_ids.append(row["input_ids"])
        if len(shard) == shard_blocks:
            _save_shard(root / f"{s:05d}", shard)
            shard, s = [], s + 1
    if shard:
        _save_shard(root / f"{s:05d}", shard)
    return np.stack(out_ids) if out_ids else np.zeros((0, 0), dtype=np.int32)


def _save_shard(path: Path, rows: list[dict]) -> None:
    arrays = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    for key, arr in arrays.items():
        if key.startswith("hidden_") and not np.isfinite(arr).all():
            raise ValueError(f"the hidden states overflow {arr.dtype}: import with dtype=float32")
    path.mkdir(parents=True)
    for key, arr in arrays.items():
        np.save(path / f"{key}.npy", arr)


def _log_probs(base: Base, last: torch.Tensor) -> torch.Tensor:
    """The base's next-token log-probs from its normed last state [.., H] -> [.., V], as its forward computes them."""
    logits = base.lm_head(last.to(base.dtype)).float()
    cap = getattr(base.config, "final_logit_softcapping", None)
    if cap:  # (Gemma2 caps its logits after the head)
        logits = cap * torch.tanh(logits / cap)
    return torch.log_softmax(logits, -1)


@torch.no_grad()
def _check_against_base(sample: dict, ids: list[int], base: Base, path: Path) -> None:
    """Rerun the base on the sample's first tokens: each aux entry must be closest to the base's own state at its
    id among all the base's layer inputs, and the last entry, normed, to the base's normed last state; else the
    ids are not the ones vLLM captured (the error names the closest layer) or the states are another model's."""
    n = min(CHECK_TOKENS, len(sample["input_ids"]))
    x = sample["input_ids"][:n].to(base.device)[None]
    feats = base.features(x, layers=tuple(range(base.num_layers)) + (LAST,))
    theirs = sample["states"][:n].to(base.device)  # [n, A+1, H]

    def err(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))

    for j, k in enumerate(ids):
        errs = [err(theirs[:, j], feats.hidden[l][0]) for l in range(base.num_layers)]
        best = int(np.argmin(errs))
        if errs[best] > 0.1:
            raise ValueError(f"{path}: entry {j} (layer id {k}) is none of {base.name}'s states (relative error "
                             f"{errs[best]:.3g} at best): another model's hidden states?")
        if best != k:
            raise ValueError(f"{path}: entry {j} (layer id {k}) is the base's layer {best} (relative error "
                             f"{errs[best]:.3g}, {errs[k]:.3g} at {k}): pass the ids vLLM captured "
                             f"(launch_vllm.py --target-layer-ids)")
    last = base.norm(theirs[:, -1].to(base.dtype))
    e = err(last, feats.hidden[LAST][0])
    if e > 0.1:
        raise ValueError(f"{path}: the last entry, normed, is not {base.name}'s last state (relative error {e:.3g}): "
                         f"another model's hidden states, or captured without the last layer?")


# -- ours -> theirs ----------------------------------------------------------------------------------------------
@torch.no_grad()
def export_cache(cache_dir: str | Path, out_dir: str | Path, layers: list[int] | None = None,
                 base: Base | str | None = None, dtype: str = "float32") -> dict:
    """A feature cache -> a speculators offline run dir under `out_dir` (see the module docstring): one sample per
    block, the training blocks first, then the validation blocks. layers: the aux layers to write, in the order
    their --target-layer-ids takes them (default: every layer the cache holds but LAST, ascending); LAST is always
    the last entry. base: the cache's base, a Base or a name load_base takes (default: the name the cache records);
    export needs its final norm. dtype: of the written states (float32 keeps a round trip exact; bfloat16 is what
    vLLM writes and what their trainer computes in). Returns what it writes to specdec_export.json."""
    cache, out = Path(cache_dir).expanduser(), Path(out_dir).expanduser()
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    meta = read_meta(cache)
    _refuse_existing(out)
    if LAST not in meta["layers"]:
        raise ValueError(f"feature cache {cache} has layers {meta['layers']} without the last ({LAST}): speculators' "
                         f"trainer computes its targets from it; rebuild it with layers={[LAST, *meta['layers']]}")
    L = meta["fingerprint"]["num_layers"]
    stored = [l for l in meta["layers"] if l != LAST]
    if layers is None:
        layers = sorted(l for l in stored if 0 <= l < L)
    layers = [int(l) for l in layers]
    wrong = [l for l in layers if l not in stored or not 0 <= l < L]
    if wrong or len(set(layers)) != len(layers):
        raise ValueError(f"layers {layers}: export writes distinct aux layers 0..{L - 1} the cache holds "
                         f"({sorted(l for l in stored if 0 <= l < L)}); the last ({LAST}) is always written last")
    base = _load(base or meta["base_name"]) if not isinstance(base, Base) else base
    diff = sorted(k for k in meta["fingerprint"] if base.fingerprint().get(k) != meta["fingerprint"][k])
    if diff:
        raise ValueError(f"feature cache {cache} was built on another base ({meta['base_name']}; {base.name} differs "
                         f"in {', '.join(diff)})")
    for name in ("train", "val"):
        have = sum(len(np.load(d / "input_ids.npy", mmap_mode="r")) for d in _shards(cache / name))
        if have != meta["blocks"][name]:
            raise ValueError(f"feature cache {cache} is incomplete: {name} has {have} of {meta['blocks'][name]} "
                             f"blocks; rerun python -m specdec.data.features")
    scale, eps = _rms_norm(base)
    tmp = _tmp_beside(out)
    try:
        (tmp / HS_DIR).mkdir()
        cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
        freq: Counter = Counter()
        i = 0
        for name in ("train", "val"):
            for d in _shards(cache / name):
                ids = np.load(d / "input_ids.npy", mmap_mode="r")  # [n, T]
                mask = (np.load(d / "loss_mask.npy", mmap_mode="r") if (d / "loss_mask.npy").exists()
                        else np.ones(ids.shape, dtype=np.uint8))  # a cache without the mask trains on every token
                hidden = {l: np.load(d / f"hidden_{l}.npy", mmap_mode="r") for l in [*layers, LAST]}
                for r in range(len(ids)):
                    tokens = torch.from_numpy(ids[r].astype(np.int64))  # [T]
                    final = _unnormed(torch.from_numpy(hidden[LAST][r].astype(np.float32)), scale, eps)  # [T, H]
                    states = torch.stack([*(torch.from_numpy(hidden[l][r].astype(np.float32)) for l in layers),
                                          final], dim=1)  # [T, A+1, H]
                    save_file({"token_ids": tokens, "hidden_states": states.to(EXPORT_DTYPES[dtype]).contiguous()},
                              str(tmp / HS_DIR / f"hs_{i}.safetensors"))
                    m = mask[r].astype(np.int64)
                    cols["input_ids"].append(tokens.numpy())
                    cols["loss_mask"].append(m)
                    cols["seq_len"].append(len(tokens))
                    freq.update(tokens.numpy()[m == 1].tolist())
                    i += 1
        rows = Dataset.from_dict(cols)
        rows.set_format("torch")  # prepare_data.py's format: their reader compares torch tensors
        rows.save_to_disk(str(tmp))
        torch.save({int(t): int(c) for t, c in freq.items()}, tmp / "token_freq.pt")
        n_train = meta["blocks"]["train"]
        info = {
            "format": "speculators offline run dir (scripts/train.py --data-path)",
            "source": str(cache),
            "base_name": meta["base_name"],
            "fingerprint": meta["fingerprint"],
            "verifier_name_or_path": getattr(base.model, "name_or_path", "") or None,
            "target_layer_ids": layers,
            "hidden_states_layer_ids": [*layers, L],
            "last_entry": "the state whose RMS norm is the cache's last (normed) state",
            "dtype": dtype,
            "cache": {k: meta[k] for k in ("layers", "block_size", "topk", "dtype", "shard_blocks")},
            "rows": i,
            "train_data_ratio": _ratio(n_train, i),
            "blocks": meta["blocks"],
        }
        info["train_command"] = (
            f"python scripts/train.py --verifier-name-or-path {info['verifier_name_or_path'] or '<the base dir>'} "
            f"--data-path {out} --target-layer-ids {' '.join(map(str, layers))} "
            f"--train-data-ratio {info['train_data_ratio']!r} --on-missing raise")
        write_json(tmp / EXPORT_META, info)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[specdec] {cache} -> {out}: {i} samples, layer ids {[*layers, L]}\n  {info['train_command']}")
    return info


def _rms_norm(base: Base) -> tuple[torch.Tensor, float]:
    """The base's final norm as (per-channel scale g [H], eps) of norm(x) = g * x / sqrt(mean(x^2) + eps), checked on
    a probe; refused in one line for a norm of another kind or a channel it zeroes (not invertible)."""
    norm, H = base.norm, base.hidden_size
    eps = next((float(getattr(norm, a)) for a in ("variance_epsilon", "eps") if hasattr(norm, a)),
               float(getattr(base.config, "rms_norm_eps", 1e-6)))
    one = torch.ones(H, device=base.device, dtype=base.dtype)
    scale = norm(one).double().cpu() * math.sqrt(1 + eps)  # [H]
    probe = torch.randn(H, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3  # [H]
    want = scale * probe / torch.sqrt((probe**2).mean() + eps)
    got = norm(probe.to(base.device, base.dtype)).double().cpu()
    if not torch.allclose(got, want, rtol=1e-3, atol=1e-5 * float(want.abs().max())):
        raise ValueError(f"the final norm of {base.name} ({type(norm).__name__}) is not an RMS norm: its input "
                         f"cannot be rebuilt from a normed state")
    weight = getattr(norm, "weight", None)
    if weight is not None and torch.allclose(scale, weight.double().cpu(), rtol=1e-5):
        scale = weight.double().cpu()  # (Llama-style: g is the weight itself, exactly)
    if (scale == 0).any():
        raise ValueError(f"the final norm of {base.name} zeroes {int((scale == 0).sum())} channels: its input "
                         f"cannot be rebuilt from a normed state")
    return scale, eps


def _unnormed(last: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """A state x [T, H] whose RMS norm is `last` [T, H]. With u = last / g (r = mean(u^2) = m / (m + eps) for the
    pre-norm state's mean square m), x = lam * u norms to g * lam * u / sqrt(lam^2 r + eps), which is `last` for
    lam^2 = eps / (1 - r) = m + eps: the pre-norm state itself. Where m >> eps, 1 - r is below the stored
    precision and the floor picks a smaller lam: x is then the pre-norm state rescaled, normed to `last` within it."""
    u = last.double() / scale  # [T, H]
    r = (u**2).mean(-1, keepdim=True)  # [T, 1]
    lam = torch.sqrt(eps / (1 - r).clamp_min(1e-6))
    return (lam * u).float()


def _ratio(n_train: int, n: int) -> float:
    """A train_data_ratio r with int(n * r) == n_train (their split), nudged where n_train / n rounds below."""
    r = n_train / n
    while int(n * r) < n_train:
        r = math.nextafter(r, 1.0)
    return r


def _shards(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.exists() else []


def _refuse_existing(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory; use another out_dir or delete it")


def _tmp_beside(out: Path) -> Path:
    """A temporary directory beside `out` that the finished result replaces it with, so an interrupted run leaves
    no half-written `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():  # (empty, checked by _refuse_existing)
        out.rmdir()
    return Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))


def _load(name: str) -> Base:
    """The base named `name`, or one line saying why it cannot be loaded."""
    try:
        return load_base(name, device="cpu")
    except OSError as e:
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__).rstrip(".")
        raise ValueError(f"cannot load the base {name!r}: {reason}; pass --base <hub name or model dir>") from None


# -- command line ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.data.speculators_offline",
                                 description="hidden states in speculators' offline format, both ways")
    sub = ap.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="a speculators offline run dir -> a specdec feature cache")
    imp.add_argument("run_dir")
    imp.add_argument("out_dir")
    imp.add_argument("--base", default=SMOLLM2, help="the model vLLM ran (hub name or directory; default %(default)s)")
    imp.add_argument("--layer-ids", type=int, nargs="+", default=None,
                     help="the aux ids vLLM captured (launch_vllm.py --target-layer-ids; default [2, L//2, L-3])")
    imp.add_argument("--train-ratio", type=float, default=None, help="their --train-data-ratio (default 0.9)")
    imp.add_argument("--block-size", type=int, default=None, help="tokens per block (default 256)")
    imp.add_argument("--topk", type=int, default=None, help="top-k targets per position (default 64)")
    imp.add_argument("--dtype", default=None, choices=sorted(STORE_DTYPES), help="of the states (default float16)")
    imp.add_argument("--hidden-states-dir", default=None, help="default RUN_DIR/hidden_states")
    imp.add_argument("--no-check", action="store_true", help="skip rerunning the base on the first sample")
    exp = sub.add_parser("export", help="a specdec feature cache -> a speculators offline run dir")
    exp.add_argument("cache_dir")
    exp.add_argument("out_dir")
    exp.add_argument("--layers", type=int, nargs="+", default=None,
                     help="aux layers in --target-layer-ids order (default: every one the cache holds)")
    exp.add_argument("--base", default=None, help="the cache's base (default: the name it records)")
    exp.add_argument("--dtype", default="float32", choices=sorted(EXPORT_DTYPES))
    args = ap.parse_args(argv)
    try:
        if args.cmd == "import":
            import_run(args.run_dir, args.out_dir, args.base, layer_ids=args.layer_ids,
                       train_ratio=args.train_ratio, block_size=args.block_size, topk=args.topk, dtype=args.dtype,
                       hidden_states_dir=args.hidden_states_dir, check=not args.no_check)
        else:
            export_cache(args.cache_dir, args.out_dir, layers=args.layers, base=args.base, dtype=args.dtype)
    except (ValueError, FileNotFoundError) as e:
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
