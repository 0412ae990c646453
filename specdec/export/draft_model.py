"""A trained standalone draft model as what loads it elsewhere, and back.

- hf: a plain HF model directory of the base's own class, tokenizer included: `AutoModelForCausalLM.from_pretrained`
  loads it, HF `generate(assistant_model=...)` and vLLM's draft-model speculation run it.
- gguf (gguf.py): that directory converted by llama.cpp's own converter: llama.cpp's `--model-draft`.

A draft model trained with a reduced draft vocab scores only part of the vocabulary, which a plain LM cannot say
(no -inf rows in an lm_head): it is refused in one line, with how to train one for export."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

from specdec.base import Base
from specdec.drafters.draft_model import DraftModel
from specdec.export.common import CheckpointError, check_base, write_record


def hf_model(d: DraftModel):
    """The draft model as a complete HF model: its layers and norm, the base's embeddings and lm_head."""
    if d.draft_vocab is not None:
        raise CheckpointError("a draft model with a draft vocab has no plain-LM form; train one for export with "
                              "drafter.draft_vocab_size=null")
    lm = type(d.lm)(d.lm.config).to(dtype=d.base.dtype)
    state = dict(d.lm.state_dict())
    if d.hparams.get("model") is None:  # trained here: its embeddings and lm_head are the base's (never saved)
        state["model.embed_tokens.weight"] = d.base.embed_tokens.weight
        state["lm_head.weight"] = d.base.lm_head.weight
    missing, _ = lm.load_state_dict({k: v.detach().cpu() for k, v in state.items()}, strict=False)
    if lm.config.tie_word_embeddings:  # (its lm_head is its embedding: one tensor under two names)
        lm.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing:
        raise CheckpointError(f"the draft model's weights lack {', '.join(missing[:3])}")
    return lm


def write_hf(d: DraftModel, out: Path, source: str) -> None:
    lm = hf_model(d)
    lm.config.architectures = [type(lm).__name__]
    lm.save_pretrained(out)
    d.base.tokenizer.save_pretrained(out)
    write_record(out, d.base, "hf", source, family="draft_model")


def is_hf(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors")) and not (path / "drafter.json").exists()


def read(path: Path, base: Base) -> DraftModel:
    config = AutoConfig.from_pretrained(path)
    check_base(path, base, None, None, getattr(config, "vocab_size", None))
    return DraftModel(base, model=str(path))  # (its tokenizer checked against the base's there)



