"""P-EAGLE drafters in speculators' `peagle` layout, both ways (vllm-project/speculators PEagleDraftModel; vLLM
reads it by `speculators_model_type: peagle`, update_peagle in vllm/transformers_utils/configs/speculators/algos.py).

- config.json: EAGLE-3's (specdec/export/eagle3.py: `transformer_layer_config` of the draft's layer count,
  `draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` the INPUT of base layer l as ours,
  `norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output`, `embed_requires_grad`) plus `mask_token_id`
  (vLLM requires it and drafts with it as `pard_token`); `speculators_config.algorithm` is "peagle" and its greedy
  proposal's `speculative_tokens` the trained depths.
- tensors: EAGLE-3's (`fc.weight`, `layers.0.*` with q/k/v over 2H and `hidden_norm`, `norm.weight`, `lm_head.weight`
  over the draft vocab, `embed_tokens.weight`), the later layers `layers.{i}.*` (plain decoder layers over H),
  `mask_hidden` [1, 1, 3H] (the masked entries' stand-in for the fused layers, before fc), and `d2t` [V_d] int64
  offsets (base id of draft index i = i + d2t[i]) / `t2d` [V] bool where the draft vocab is smaller than the base's.

Written with every switch off (`norm_before_residual`: vLLM's update_peagle takes false where the key is absent,
speculators' trainer defaults to true, so it is always written), and `embed_requires_grad` false: the embeddings are
the base's. A checkpoint that sets a switch, or whose embeddings are not the base's (speculators trains P-EAGLE's by
default), would draft otherwise here and is refused in one line on load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.base import Base
from specdec.drafters.peagle import PEagle
from specdec.export import eagle3
from specdec.export.common import (CheckpointError, check_base, read_config, read_tensors, save, take,
                                   speculators_config, write_record)

WEIGHTS = "model.safetensors"
SWITCHES = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")  # EAGLE-3's variants, off here


def layer_config(base: Base, d: PEagle) -> dict:
    """The base's own decoder config cut to the draft's layers."""
    cfg = eagle3.layer_config(base, d.draft_vocab.size) | {"num_hidden_layers": len(d.layers)}
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][: len(d.layers)]
    return cfg


def write_speculators(d: PEagle, out: Path, source: str) -> None:
    base, size = d.base, d.draft_vocab.size
    config = {
        "architectures": ["PEagleSpeculator"],
        "speculators_model_type": "peagle",
        "transformer_layer_config": layer_config(base, d),
        "draft_vocab_size": size,
        "target_hidden_size": base.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(d.aux_layers),
        **{k: False for k in SWITCHES},
        "embed_requires_grad": False,
        "mask_token_id": d.mask_token_id,
        "speculators_config": speculators_config(base, "peagle", d.num_depths),
    }
    tensors = {k: v for k, v in d.state_dict().items() if k != "draft_vocab.tokens"}
    tensors["embed_tokens.weight"] = base.embed_tokens.weight
    if size < base.vocab_size:  # (speculators' DraftVocabMixin has the maps only then)
        tensors |= {"d2t": d.d2t(), "t2d": d.t2d()}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save(tensors, out / WEIGHTS)
    write_record(out, base, "speculators", source, family="peagle")


def is_speculators(config: dict) -> bool:
    return config.get("speculators_model_type") == "peagle"


def read(path: Path, base: Base) -> PEagle:
    """speculators' peagle layout -> a PEagle drafter on `base`, refused in one line for another base, a missing or
    out-of-vocabulary mask token, a switch or trained embeddings it would draft otherwise with, or a malformed file."""
    config = read_config(path)
    tensors = read_tensors(path, WEIGHTS)
    layer_cfg = config.get("transformer_layer_config") or {}
    spec = config.get("speculators_config") or {}
    check_base(path, base, (spec.get("verifier") or {}).get("name_or_path"),
               config.get("target_hidden_size") or layer_cfg.get("hidden_size"), layer_cfg.get("vocab_size"))
    on = [k for k in SWITCHES if config.get(k)]
    if on:
        raise CheckpointError(f"{path}: {on[0]} is set; specdec's P-EAGLE is EAGLE-3's layer without it")
    mask = config.get("mask_token_id")
    if mask is None:
        raise CheckpointError(f"{path}: names no mask_token_id")
    if "embed_tokens.weight" in tensors:
        emb = take(tensors, "embed_tokens.weight", (base.vocab_size, base.hidden_size), path)
        if not torch.equal(emb, base.embed_tokens.weight.detach().cpu().to(emb.dtype)):
            raise CheckpointError(f"{path}: its embed_tokens are not the base's (trained: embed_requires_grad); "
                                  f"specdec's P-EAGLE embeds with the base's own")
    size = int(config.get("draft_vocab_size") or base.vocab_size)
    tokens = torch.arange(size)
    if size < base.vocab_size:
        tokens = take(tensors, "d2t", (size,), path).long() + tokens
        if tokens.min() < 0 or tokens.max() >= base.vocab_size or len(tokens.unique()) != size:
            raise CheckpointError(f"{path}: d2t does not map {size} draft indices onto distinct base tokens")
    depths = int(((spec.get("proposal_methods") or [{}])[0]).get("speculative_tokens", 8))  # (speculators' default)
    try:
        d = PEagle(base, num_depths=depths, num_layers=int(layer_cfg.get("num_hidden_layers", 1)),
                   draft_vocab_size=size, aux_layers=config.get("eagle_aux_hidden_state_layer_ids"),
                   mask_token_id=int(mask))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    own = {k: v for k, v in d.state_dict().items() if k != "draft_vocab.tokens"}
    extra = sorted(k for k in tensors if k.startswith("layers.") and k not in own)
    if extra:
        raise CheckpointError(f"{path}: tensor {extra[0]} has no place in this base's {len(d.layers)}-layer P-EAGLE")
    hidden = take(tensors, "mask_hidden", None, path)
    if hidden.numel() != d.mask_hidden.numel():  # (vLLM views it as [1, 3H] whatever its shape)
        raise CheckpointError(f"{path}: tensor mask_hidden has shape {tuple(hidden.shape)}, expected "
                              f"{tuple(d.mask_hidden.shape)}")
    state = {k: hidden.reshape(v.shape) if k == "mask_hidden" else take(tensors, k, tuple(v.shape), path)
             for k, v in own.items()}
    order = tokens.argsort()  # ours are held sorted: the lm_head's rows follow them
    state["lm_head.weight"] = state["lm_head.weight"][order]
    d.draft_vocab.set(tokens.to(base.device))
    d.load_state_dict(state | {"draft_vocab.tokens": d.draft_vocab.tokens}, strict=True)
    return d.to(device=base.device, dtype=base.dtype).eval()
