"""Medusa heads in the two layouts serving engines read, both ways.

- vllm (vLLM's `MedusaModel`): config.json {num_heads, num_hidden_layers, hidden_size, vocab_size,
  truncated_vocab_size, medusa_fc_bias}; tensors `blocks.{h}.layers.{l}.weight|bias` (x + SiLU(W x + b) each),
  `lm_heads.{h}.weight` [V_d, H] and, with a draft vocab, `token_map` [V_d] (the base ids of its rows).
- medusa (FasterDecoding/Medusa, what TGI and TensorRT-LLM convert from): config.json {medusa_num_heads,
  medusa_num_layers, base_model_name_or_path} and medusa_lm_head.safetensors with `{h}.{l}.linear.weight|bias` and
  `{h}.{L}.weight` [V, H]. It has no draft vocab, and its heads repeat one block module, so a head of several
  distinct blocks has no form there: both are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.base import Base
from specdec.drafters.medusa import Medusa
from specdec.export.common import (CheckpointError, check_base, read_config, read_tensors, save, take,
                                   verifier_name, write_record)

VLLM_WEIGHTS = "model.safetensors"
REPO_WEIGHTS = "medusa_lm_head.safetensors"


def _heads(d: Medusa) -> list[torch.Tensor]:
    """Each head's vocab projection [V_d, H]: its own, or the base's (frozen) rows."""
    if d.lm_heads is not None:
        return [lm.weight for lm in d.lm_heads]
    w = d.base.lm_head.weight if d.draft_vocab is None else d.draft_vocab.head.weight
    return [w] * len(d.heads)


def write_vllm(d: Medusa, out: Path, source: str) -> None:
    base, k, n = d.base, len(d.heads), len(d.heads[0])
    size = d.draft_vocab.size if d.draft_vocab is not None else base.vocab_size
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": base.hidden_size,
              "vocab_size": base.vocab_size, "num_heads": k, "num_hidden_layers": n, "truncated_vocab_size": size,
              "medusa_fc_bias": True, "base_model_name_or_path": verifier_name(base)}
    tensors = {}
    for h, head in enumerate(d.heads):
        for l, block in enumerate(head):
            tensors[f"blocks.{h}.layers.{l}.weight"] = block.linear.weight
            tensors[f"blocks.{h}.layers.{l}.bias"] = block.linear.bias
    tensors |= {f"lm_heads.{h}.weight": w for h, w in enumerate(_heads(d))}
    if d.draft_vocab is not None:
        tensors["token_map"] = d.draft_vocab.tokens
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save(tensors, out / VLLM_WEIGHTS)
    write_record(out, base, "vllm_medusa", source, family="medusa")


def write_repo(d: Medusa, out: Path, source: str) -> None:
    if d.draft_vocab is not None:
        raise CheckpointError("--to medusa: the Medusa repo's heads score the full vocabulary; train with "
                              "drafter.draft_vocab_size=null, or export --to vllm_medusa (truncated_vocab_size)")
    if len(d.heads[0]) > 1:
        raise CheckpointError("--to medusa: the Medusa repo repeats one block per head ([ResBlock] * n); train with "
                              "drafter.num_layers=1, or export --to vllm_medusa")
    config = {"medusa_num_heads": len(d.heads), "medusa_num_layers": 1,
              "base_model_name_or_path": verifier_name(d.base)}
    tensors = {}
    for h, (head, w) in enumerate(zip(d.heads, _heads(d))):
        tensors[f"{h}.0.linear.weight"], tensors[f"{h}.0.linear.bias"] = head[0].linear.weight, head[0].linear.bias
        tensors[f"{h}.1.weight"] = w
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save(tensors, out / REPO_WEIGHTS)
    write_record(out, d.base, "medusa", source, family="medusa")


def is_vllm(config: dict) -> bool:
    return config.get("model_type") == "medusa" or "MedusaModel" in config.get("architectures", [])


def is_repo(config: dict) -> bool:
    return "medusa_num_heads" in config and not is_vllm(config)


def read(path: Path, base: Base) -> Medusa:
    config = read_config(path)
    h_size = base.hidden_size
    if is_vllm(config):
        k, n = int(config["num_heads"]), int(config.get("num_hidden_layers", 1))
        size = int(config.get("truncated_vocab_size") or config.get("vocab_size"))
        check_base(path, base, config.get("base_model_name_or_path"), config.get("hidden_size"), config.get("vocab_size"))
        t = read_tensors(path, VLLM_WEIGHTS)
        block = lambda h, l, p: f"blocks.{h}.layers.{l}.{p}"  # noqa: E731
        head = lambda h: f"lm_heads.{h}.weight"  # noqa: E731
        tokens = take(t, "token_map", (size,), path).long() if size < base.vocab_size else None
    else:
        k, n, size = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1)), base.vocab_size
        check_base(path, base, config.get("base_model_name_or_path"), None, None)
        t = read_tensors(path, REPO_WEIGHTS)
        block = lambda h, l, p: f"{h}.{l}.linear.{p}"  # noqa: E731
        head = lambda h, n=n: f"{h}.{n}.weight"  # noqa: E731
        tokens = None
    d = Medusa(base, num_heads=k, num_layers=n, own_lm_head=True, draft_vocab_size=size if tokens is not None else None)
    state = {}
    for h in range(k):
        for l in range(n):
            state[f"heads.{h}.{l}.linear.weight"] = take(t, block(h, l, "weight"), (h_size, h_size), path)
            bias = t.get(block(h, l, "bias"))  # vLLM without medusa_fc_bias has none: zero
            state[f"heads.{h}.{l}.linear.bias"] = bias if bias is not None else torch.zeros(h_size)
        state[f"lm_heads.{h}.weight"] = take(t, head(h), (size, h_size), path)
    if tokens is not None:
        if tokens.min() < 0 or tokens.max() >= base.vocab_size or len(tokens.unique()) != size:
            raise CheckpointError(f"{path}: token_map does not name {size} distinct base tokens")
        order = tokens.argsort()  # ours are held sorted: every head's rows follow them
        for h in range(k):
            state[f"lm_heads.{h}.weight"] = state[f"lm_heads.{h}.weight"][order]
        d.draft_vocab.set(tokens.to(base.device))
        state["draft_vocab.tokens"] = d.draft_vocab.tokens
    d.load_state_dict(state, strict=True)
    return d.to(device=base.device, dtype=base.dtype).eval()
