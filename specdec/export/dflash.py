"""DFlash drafters in the two layouts serving engines load, both ways.

- speculators (vllm-project/speculators `DFlashDraftModel`; vLLM reads it by `speculators_model_type: dflash`):
  config.json with `transformer_layer_config` (a decoder config of the draft's layer count), `block_size`,
  `mask_token_id`, `aux_hidden_state_layer_ids`, `draft_vocab_size`, `target_hidden_size`, `sample_from_anchor`
  and `speculators_config`; tensors `layers.{i}.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`,
  `lm_head.weight` (the draft vocab's rows), `embed_tokens.weight`, and `d2t` / `t2d` where the draft vocab is
  smaller than the base's (d2t [V_d] int64 offsets: base id of draft index i = i + d2t[i]; t2d [V] bool).
  Its aux ids are ours: the INPUT of base layer l (HF hidden_states[l]); vLLM's reader turns them into
  `dflash_config.target_layer_ids` = l − 1 itself.
- sglang (z-lab's layout, what SGLang's `--speculative-algorithm DFLASH` loads): the draft's decoder config at the
  top level with `architectures: [DFlashDraftModel]`, `block_size`, `num_target_layers` and `dflash_config`
  {`mask_token_id`, `target_layer_ids`}; tensors `layers.{i}.*`, `fc.weight`, `hidden_norm.weight` and
  `norm.weight` only. Its target ids are layer OUTPUTS (z-lab reads hidden_states[id + 1]; SGLang captures the
  input of layer id + 1), so ours are written one lower.

Where their DFlash computes what ours does: c_t = hidden_norm(fc(concatenated features)); each draft layer reads
c_t through k_proj / v_proj (no input norm, keys normed per head and rotated at t) beside the block's own keys;
the block [anchor, mask × (b − 1)] attends to the context before the anchor and to itself both ways; then norm and
the vocab head; masked slot k proposes token a + k (their `sample_from_anchor: false`). Where they differ, the
export is refused in one line rather than written to serve other drafts:

- Their draft layer is always Qwen3's (per-head RMSNorm on queries and keys, a SiLU MLP), whatever the target.
  Ours is the base's own class, so only a drafter on a Qwen3 base exports; a Llama one (SmolLM2) has no q/k norms,
  and their loaders would normalise its queries and keys anyway.
- vLLM and SGLang capture the residual stream entering a base layer: layer L (our normed output, also −1) is not
  one of them.
- SGLang's DFLASH scores with the target's own embeddings and whole lm_head: a draft vocab or a trained head has
  no place in the layout (its loader skips unknown tensors), so those go to speculators, whose lm_head is the
  drafter's own rows and which vLLM maps back through d2t.
- Sliding-window draft layers are refused: ours attend to the whole context.

`sliding_window_non_causal` is written true: vLLM's reader makes every draft layer causal when it is false, while
speculators reads it for sliding-window layers only (none here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.base import LAST, Base
from specdec.drafters.dflash import DFlash
from specdec.export.common import (CheckpointError, check_base, read_config, read_tensors, save, take,
                                   speculators_config, write_record)

WEIGHTS = "model.safetensors"
QWEN3_LAYER = "Qwen3DecoderLayer"  # the decoder layer every DFlash loader builds, whatever the target
# the draft layer's settings a checkpoint must share with the base for our layers (the base's class) to be its own
LAYER_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act",
              "rms_norm_eps", "attention_bias", "rope_theta", "rope_scaling", "rope_parameters")


def layer_config(base: Base, num_layers: int) -> dict:
    """The base's own decoder config cut to the draft's layers (what both layouts carry for them)."""
    cfg = base.config.to_dict()
    for k in ("architectures", "auto_map", "_name_or_path", "transformers_version", "quantization_config"):
        cfg.pop(k, None)
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:num_layers]
    cfg.update(num_hidden_layers=num_layers, tie_word_embeddings=False)
    return cfg


def refusal(d: DFlash, fmt: str) -> str | None:
    """Why `fmt`'s loader would draft differently from `d` (one line), or None."""
    base, n = d.base, len(d.layers)
    layer = type(d.layers[0]).__name__
    if layer != QWEN3_LAYER:
        return (f"vLLM's, SGLang's and speculators' DFlash layers are Qwen3's, with per-head RMSNorm on queries and "
                f"keys; this drafter's are the base's {layer}, which has none, so they would draft otherwise "
                f"(a drafter on a Qwen3 base exports)")
    if getattr(base.config, "hidden_act", "silu") != "silu":
        return f"the serving engines' DFlash MLP is SiLU's; this base's is {base.config.hidden_act}"
    if "sliding_attention" in (getattr(base.config, "layer_types", None) or [])[:n]:
        return "its draft layers use sliding-window attention, which the serving engines window otherwise"
    late = [l for l in d.aux_layers if l == LAST or l >= base.num_layers]
    if late:
        return (f"it fuses layer {late[0]} (the base's normed output); vLLM and SGLang capture the input of a base "
                f"layer, 1 .. {base.num_layers - 1}")
    narrowed = d.draft_vocab is not None and d.draft_vocab.size < base.vocab_size
    if fmt == "sglang" and (d.lm_head is not None or narrowed):
        head = "its own trained head" if d.lm_head is not None else f"a {d.draft_vocab.size:,}-token draft vocab"
        return (f"SGLang's DFLASH scores with the target's whole lm_head and this drafter with {head}: "
                f"export --to speculators (vLLM reads both), or train with draft_vocab_size=null own_lm_head=false")
    return None


def _layers_and_context(d: DFlash) -> dict[str, torch.Tensor]:
    return {k: v for k, v in d.state_dict().items() if k.split(".")[0] in ("layers", "fc", "hidden_norm", "norm")}


def write_speculators(d: DFlash, out: Path, source: str) -> None:
    base = d.base
    size = d.draft_vocab.size if d.draft_vocab is not None else base.vocab_size
    config = {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer_config(base, len(d.layers)),
        "draft_vocab_size": size,
        "block_size": d.block_size,
        "target_hidden_size": base.hidden_size,
        "aux_hidden_state_layer_ids": list(d.aux_layers),  # (the input of layer l, as ours)
        "mask_token_id": d.mask_token_id,
        "sliding_window_non_causal": True,  # (vLLM: false makes every layer causal; see the module docstring)
        "sample_from_anchor": False,
        "speculators_config": speculators_config(base, "dflash", d.block_size - 1),
    }
    head = d.lm_head.weight if d.lm_head is not None else (
        d.draft_vocab.rows(base.lm_head.weight) if d.draft_vocab is not None else base.lm_head.weight)
    tensors = _layers_and_context(d) | {"lm_head.weight": head, "embed_tokens.weight": base.embed_tokens.weight}
    if d.draft_vocab is not None and size < base.vocab_size:
        tokens = d.draft_vocab.tokens
        t2d = torch.zeros(base.vocab_size, dtype=torch.bool, device=tokens.device)
        t2d[tokens] = True
        tensors |= {"d2t": tokens - torch.arange(size, device=tokens.device), "t2d": t2d}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save(tensors, out / WEIGHTS)
    write_record(out, base, "speculators", source, family="dflash")


def write_sglang(d: DFlash, out: Path, source: str) -> None:
    base = d.base
    config = layer_config(base, len(d.layers)) | {
        "architectures": ["DFlashDraftModel"],
        "block_size": d.block_size,
        "num_target_layers": base.num_layers,
        # z-lab's and SGLang's convention: the OUTPUT of layer l (the input of l + 1)
        "dflash_config": {"mask_token_id": d.mask_token_id, "target_layer_ids": [l - 1 for l in d.aux_layers]},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save(_layers_and_context(d), out / WEIGHTS)
    write_record(out, base, "sglang", source, family="dflash")


def is_speculators(config: dict) -> bool:
    return config.get("speculators_model_type") == "dflash"


def is_zlab(config: dict) -> bool:
    return "DFlashDraftModel" in config.get("architectures", []) and "speculators_model_type" not in config


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's choice where a checkpoint names none (layer outputs): the middle layer for one draft layer, else
    draft-layer-many spread evenly from 1 to L − 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def read(path: Path, base: Base) -> DFlash:
    """Either layout -> a DFlash drafter on `base`, refused in one line for another base (hidden size, vocabulary,
    layer count, the draft layers' shape), a mask token outside the vocabulary or a malformed file."""
    config = read_config(path)
    tensors = {k.removeprefix("model."): v for k, v in read_tensors(path, WEIGHTS).items()}
    if is_speculators(config):
        layer_cfg = config.get("transformer_layer_config") or {}
        verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        aux, mask = config.get("aux_hidden_state_layer_ids"), config.get("mask_token_id")
        block, size, target_layers = config.get("block_size", 8), config.get("draft_vocab_size"), None
        if config.get("sample_from_anchor"):
            raise CheckpointError(f"{path}: sample_from_anchor drafts from the anchor slot too, which specdec's "
                                  f"DFlash does not")
    else:
        layer_cfg, verifier, size, dcfg = config, None, None, config.get("dflash_config") or {}
        block = dcfg.get("block_size", config.get("block_size"))
        mask = dcfg.get("mask_token_id", config.get("mask_token_id"))
        target_layers = dcfg.get("num_target_layers", config.get("num_target_layers"))
        ids = dcfg.get("target_layer_ids") or default_target_layers(target_layers or base.num_layers,
                                                                    int(config.get("num_hidden_layers", 1)))
        aux = [int(i) + 1 for i in ids]  # (a layer's output is the next layer's input)
    check_base(path, base, verifier, config.get("target_hidden_size") or layer_cfg.get("hidden_size"),
               layer_cfg.get("vocab_size"))
    if target_layers is not None and int(target_layers) != base.num_layers:
        raise CheckpointError(f"{path}: drafts for a {target_layers}-layer target, the base has {base.num_layers}")
    if not aux or any(not 0 < int(l) <= base.num_layers for l in aux):
        raise CheckpointError(f"{path}: reads base layers {aux}, the base has {base.num_layers}")
    if mask is None:
        raise CheckpointError(f"{path}: names no mask_token_id")
    if not 0 <= int(mask) < base.vocab_size:
        raise CheckpointError(f"{path}: mask_token_id {mask} is outside the base's vocabulary [0, {base.vocab_size})")
    ours = base.config.to_dict()
    for k in LAYER_KEYS:
        if k in layer_cfg and k in ours and layer_cfg[k] != ours[k]:
            raise CheckpointError(f"{path}: its draft layers have {k} {layer_cfg[k]}, this base's {ours[k]}")
    size = int(size) if size else base.vocab_size
    tokens = torch.arange(size)
    if size < base.vocab_size:
        tokens = take(tensors, "d2t", (size,), path).long() + tokens
        if tokens.min() < 0 or tokens.max() >= base.vocab_size or len(tokens.unique()) != size:
            raise CheckpointError(f"{path}: d2t does not map {size} draft indices onto distinct base tokens")
    order = tokens.argsort()  # ours are held sorted: the lm_head's rows follow them
    head = take(tensors, "lm_head.weight", (size, base.hidden_size), path)[order] if "lm_head.weight" in tensors \
        else None
    frozen = base.lm_head.weight.detach()[tokens[order].to(base.device)].cpu()
    own = head is not None and not torch.equal(head.to(frozen.dtype), frozen)
    try:
        d = DFlash(base, num_layers=int(layer_cfg.get("num_hidden_layers", 1)), block_size=int(block),
                   aux_layers=[int(l) for l in aux], mask_token_id=int(mask),
                   draft_vocab_size=size if size < base.vocab_size else None, own_lm_head=own)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if d.draft_vocab is not None:
        d.draft_vocab.set(tokens[order].to(base.device))
    state = d.state_dict()
    extra = sorted(k for k in tensors if k.startswith("layers.") and k not in state)
    if extra:
        raise CheckpointError(f"{path}: tensor {extra[0]} has no place in this base's {type(d.layers[0]).__name__}")
    state = {k: (head if k == "lm_head.weight" else v if k == "draft_vocab.tokens" else
                 take(tensors, k, tuple(v.shape), path)) for k, v in state.items()}
    d.load_state_dict(state, strict=True)
    return d.to(device=base.device, dtype=base.dtype).eval()
