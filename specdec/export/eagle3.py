"""EAGLE-3 drafters in the two layouts the field ships them in, both ways.

- speculators (vllm-project/speculators; vLLM detects it by `speculators_model_type`): config.json with
  `speculators_config` and `transformer_layer_config`; tensors `fc.weight`, `layers.0.*`, `norm.weight`,
  `lm_head.weight`, `embed_tokens.weight`, `d2t`, `t2d`. Its `eagle_aux_hidden_state_layer_ids` are the layers whose
  INPUT is fused (HF hidden_states[l]), as ours. EAGLE-3.1's switches are the booleans `fc_norm` (its norms'
  tensors `fc_norm.{i}.weight`, one per fused layer) and `norm_output`, read by speculators' Eagle3SpeculatorConfig
  and passed on by vLLM's speculators reader (algos.py, update_eagle3) under the same names.
- sglang (SGLang's and the EAGLE repo's `LlamaForCausalLMEagle3`, what SpecForge writes): a plain Llama config of one
  layer with `draft_vocab_size`; the layer's tensors under `midlayer.*`. SGLang reads
  `eagle_config.eagle_aux_hidden_state_layer_ids` as layer OUTPUTS and adds one, so ours are written one lower.
  EAGLE-3.1 drafters are written to the speculators layout only.

In both, d2t [V_d] int64 holds offsets (base id of draft index i = i + d2t[i]) and t2d [V] bool marks the draft
vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.base import Base
from specdec.drafters.eagle3 import Eagle3, default_aux_layers
from specdec.export.common import (CheckpointError, check_base, read_config, read_tensors, save, take,
                                   speculators_config, write_record)

WEIGHTS = "model.safetensors"


def layer_config(base: Base, draft_vocab_size: int) -> dict:
    """The base's own config as a one-layer model (what both layouts carry for the decoder layer)."""
    cfg = base.config.to_dict()
    for k in ("architectures", "auto_map", "_name_or_path", "transformers_version", "quantization_config"):
        cfg.pop(k, None)
    cfg.update(num_hidden_layers=1, tie_word_embeddings=False, draft_vocab_size=draft_vocab_size)
    return cfg


def _tensors(d: Eagle3, layer_prefix: str) -> dict[str, torch.Tensor]:
    state = {k: v for k, v in d.state_dict().items() if k != "draft_vocab.tokens"}
    out = {(layer_prefix + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v for k, v in state.items()}
    out |= {"embed_tokens.weight": d.base.embed_tokens.weight, "d2t": d.d2t(), "t2d": d.t2d()}
    return out


def write_speculators(d: Eagle3, out: Path, source: str) -> None:
    base = d.base
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer_config(base, d.draft_vocab.size),
        "draft_vocab_size": d.draft_vocab.size,
        "target_hidden_size": base.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(d.aux_layers),
        "norm_before_residual": False,  # (written out: vLLM takes True where the key is absent, llama.cpp False)
        "norm_before_fc": False,
        "fc_norm": d.fc_norm is not None,
        "norm_output": d.norm_output,
        "embed_requires_grad": False,
        "speculators_config": speculators_config(base, "eagle3", d.ttt_steps),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save(_tensors(d, "layers.0."), out / WEIGHTS)
    write_record(out, base, "speculators", source, family="eagle3")


def refuse_eagle31(d: Eagle3, where: str) -> None:
    """One line where a layout's reader would drop an EAGLE-3.1 switch and draft otherwise."""
    on = [k for k, v in (("fc_norm", d.fc_norm is not None), ("norm_output", d.norm_output)) if v]
    if on:
        raise CheckpointError(f"an eagle3 drafter with {' and '.join(on)} (EAGLE-3.1) exports to speculators only: "
                              f"{where} reads neither switch")


def write_sglang(d: Eagle3, out: Path, source: str) -> None:
    refuse_eagle31(d, "this layout")
    base = d.base
    config = layer_config(base, d.draft_vocab.size) | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "target_hidden_size": base.hidden_size,
        # SGLang's convention: the OUTPUT of layer l (it captures l + 1's input)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [l - 1 for l in d.aux_layers], "use_aux_hidden_state": True},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save(_tensors(d, "midlayer."), out / WEIGHTS)
    write_record(out, base, "sglang", source, family="eagle3")


def is_speculators(config: dict) -> bool:
    return config.get("speculators_model_type") == "eagle3"


def is_sglang(config: dict) -> bool:
    return any("Eagle3" in a for a in config.get("architectures", [])) and "speculators_model_type" not in config


def read(path: Path, base: Base) -> Eagle3:
    """Either layout -> an Eagle3 drafter on `base` (refused in one line for another base or a malformed file)."""
    config = read_config(path)
    tensors = read_tensors(path, WEIGHTS)
    if is_speculators(config):
        layer_cfg, prefix = config.get("transformer_layer_config", {}), "layers.0."
        spec = config.get("speculators_config", {})
        verifier = spec.get("verifier", {}).get("name_or_path")
        aux = config.get("eagle_aux_hidden_state_layer_ids")
        methods = spec.get("proposal_methods") or [{}]
        steps = int(methods[0].get("speculative_tokens", 3))
        if config.get("norm_before_residual") or config.get("norm_before_fc"):
            raise CheckpointError(f"{path}: norm_before_residual / norm_before_fc variants are not read")
        switches = {"fc_norm": bool(config.get("fc_norm")), "norm_output": bool(config.get("norm_output"))}
    else:
        layer_cfg, prefix, verifier, steps = config, "midlayer.", None, 7
        switches = {}
        if config.get("fc_norm") or config.get("norm_output"):
            raise CheckpointError(f"{path}: fc_norm / norm_output (EAGLE-3.1) are read from the speculators layout")
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = [l + 1 for l in ids] if ids else None
    check_base(path, base, verifier, config.get("target_hidden_size") or layer_cfg.get("hidden_size"),
               layer_cfg.get("vocab_size"))
    d2t = take(tensors, "d2t", None, path)
    size = int(config.get("draft_vocab_size") or layer_cfg.get("draft_vocab_size") or d2t.numel())
    d = Eagle3(base, ttt_steps=steps, draft_vocab_size=size, aux_layers=aux or default_aux_layers(base.num_layers),
               **switches)
    tokens = d2t.long() + torch.arange(size)
    if d2t.numel() != size or tokens.min() < 0 or tokens.max() >= base.vocab_size or len(tokens.unique()) != size:
        raise CheckpointError(f"{path}: d2t does not map {size} draft indices onto distinct base tokens")
    own = {k: v for k, v in d.state_dict().items() if k != "draft_vocab.tokens"}
    state = {k: take(tensors, prefix + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k,
                     tuple(v.shape), path) for k, v in own.items()}
    order = tokens.argsort()  # ours are held sorted: the lm_head's rows follow them
    state["lm_head.weight"] = state["lm_head.weight"][order]
    d.draft_vocab.set(tokens.to(base.device))
    d.load_state_dict(state | {"draft_vocab.tokens": d.draft_vocab.tokens}, strict=True)
    return d.to(device=base.device, dtype=base.dtype).eval()
