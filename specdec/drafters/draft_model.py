"""A standalone draft model (Leviathan et al. 2023, Chen et al. 2023; HF's `generate(assistant_model=...)`): a
small causal LM with the base's tokenizer drafts token by token on its own KV store. Two kinds:
- `model=<hub name or directory>`: any HF causal LM whose tokenizer is the base's (checked), frozen, evaluate-only
  (python evaluate.py draft_models=[<name>]);
- `model=null`: a small LM of the base's own class built from the base's config with `num_layers` layers, whose
  token embeddings and lm_head are the base's, shared frozen (or an EAGLE-3 draft vocab), trained by the
  DraftTrainer with KL to the base like every other drafter (python train.py drafter=draft_model).
Either way the sampler runs the model's own HF forward (its embeddings, rotary and norm) through the DraftContext,
on a drafter-private store, so no HF modeling code is copied and any architecture works."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from specdec.base import Base, Features
from specdec.drafters.drafter import DraftContext, Drafter, DraftVocab, TrainOutput

STORE = "draft_model"  # the drafter-private KV store in the sampler's DraftContext


class DraftModel(Drafter):
    drafts_from_tokens = True  # its own model (layers, KV) over the path's tokens: stages may check proposals

    def __init__(self, base: Base, model: str | None = None, num_layers: int = 4, init: str = "copy",
                 draft_vocab_size: int | None = None, gamma: int = 4):
        super().__init__(base, model=model, num_layers=num_layers, init=init, draft_vocab_size=draft_vocab_size,
                         gamma=gamma)
        if init not in ("copy", "fresh"):
            raise ValueError(f"init must be 'copy' or 'fresh', got {init!r}")
        if model is not None and draft_vocab_size:
            raise ValueError("a draft vocab needs a draft model trained for it (model=null), not a pretrained one")
        self.gamma = gamma
        self.feature_layers = ()  # a standalone LM: it reads tokens, never the base's features
        self.target_offsets, self.head_names = [0], ["draft"]  # entry t predicts t+1, like the base
        if model is not None:
            self.lm = load_pretrained(base, model)
            return
        if not 1 <= num_layers <= base.num_layers:
            raise ValueError(f"num_layers must be in 1..{base.num_layers} (the base's), got {num_layers}")
        self.draft_vocab = DraftVocab(base, draft_vocab_size) if draft_vocab_size else None
        self.lm = self._small(num_layers, init)

    def _small(self, num_layers: int, init: str) -> PreTrainedModel:
        base = self.base
        config = copy.deepcopy(base.config)
        n = base.num_layers
        # init=copy: base layers spread evenly over its depth, first and last included (a layer-dropped base)
        source = [round(i * (n - 1) / max(num_layers - 1, 1)) for i in range(num_layers)]
        if getattr(config, "layer_types", None):  # per-layer attention kinds (sliding/full) follow the copied layers
            config.layer_types = [config.layer_types[i] for i in source]
        config.num_hidden_layers = num_layers
        lm = type(base.model)(config).to(device=base.device, dtype=base.dtype)  # the base's own class
        if init == "copy":
            for layer, i in zip(lm.model.layers, source):
                layer.load_state_dict(base.layers[i].state_dict())
            lm.model.norm.load_state_dict(base.norm.state_dict())
        # Token embeddings and lm_head are the base's own tensors, frozen: non-persistent buffers, so they are
        # neither trained nor saved (the checkpoint holds the layers and the norm only).
        _share(lm.get_input_embeddings(), base.embed_tokens.weight)
        if self.draft_vocab is None:
            _share(lm.get_output_embeddings(), base.lm_head.weight)
        else:  # full-vocab logits (−inf off the draft vocab): what HF's assisted generation and the sampler read
            lm.set_output_embeddings(FullVocabHead(self.draft_vocab))
        return lm

    def hf_assistant(self) -> PreTrainedModel:
        return self.lm

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Last hidden state [..., H'] -> draft logits [..., V_d] (V_d = V without a draft vocab)."""
        return self.draft_vocab.head(h) if self.draft_vocab is not None else self.lm.get_output_embeddings()(h)

    # -- training: the small LM's own causal forward over the data; the trainer's KL to the base does the rest ----
    def forward_train(self, feats: Features, input_ids: torch.Tensor) -> TrainOutput:
        h = self.lm.model(input_ids=input_ids, use_cache=False).last_hidden_state  # [B, T, H]
        return TrainOutput(logits=self._logits(h)[:, :, None])  # [B, T, 1, V_d]

    def expected_tau(self, accept: torch.Tensor) -> torch.Tensor:
        """Chain of gamma drafts each accepted with α: Σ_{i≤γ} α^i = (1 − α^{γ+1}) / (1 − α) (docs/sampler.md §4)."""
        return torch.stack([accept[0] ** i for i in range(self.gamma + 1)]).sum()

    def calibrate(self, blocks, log):
        raise ValueError(f"drafter.model={self.hparams['model']} is a pretrained draft model: nothing to train, it is "
                         f"evaluate-only (python evaluate.py draft_models=[{self.hparams['model']}])")

    # -- sampling ------------------------------------------------------------------------------------------------
    def init_state(self, batch_size: int, max_len: int) -> dict[str, Any]:
        return {"reread": True}

    def skip_round(self, state) -> None:
        state["reread"] = True

    def observe(self, state, ctx: DraftContext, feats: Features, tokens, n_new, next_token) -> None:
        # After the prefill, the draft model reads the whole prompt. After a round, its store already holds every
        # committed token but each row's deepest accepted node: the nodes above it were expanded as its ancestors
        # (and moved into place by the sampler); only the deepest may be an unexpanded leaf. So it re-runs from the
        # shallowest such node on: at most the last token of a chain whose every draft was accepted.
        # After a lookup round (skip_round) nothing was expanded: it reads every committed token, as after the prefill.
        start = 0 if state.pop("reread", False) else int(n_new.min()) - 1
        ctx.run_model(self.lm.model, tokens[:, start:], STORE)

    def expand(self, state, ctx: DraftContext, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
               nodes: torch.Tensor) -> torch.Tensor:
        h = ctx.run_model(self.lm.model, tokens, STORE)  # [B, N, H']
        return self._logits(h)  # [B, N, V_d]


class FullVocabHead(nn.Module):
    """A draft vocab's projection as an lm_head with full-vocab output [..., V] (−inf off the subset)."""

    def __init__(self, vocab: DraftVocab):
        super().__init__()
        self._frozen = {"vocab": vocab}  # registered once, in the drafter (`draft_vocab`)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        vocab = self._frozen["vocab"]
        return vocab.to_base(vocab.head(h))


def load_pretrained(base: Base, name: str) -> PreTrainedModel:
    """An HF causal LM by hub name or directory, in the base's dtype and device, frozen; refused in one line unless
    its tokenizer is the base's (same token ids: the verifier compares them one to one)."""
    tokenizer = AutoTokenizer.from_pretrained(name)
    ours, theirs = base.tokenizer.get_vocab(), tokenizer.get_vocab()
    if ours != theirs:
        differ = len(set(ours.items()) ^ set(theirs.items()))
        raise ValueError(f"draft model {name}: its tokenizer differs from the base's ({len(theirs):,} vs {len(ours):,} "
                         f"tokens, {differ:,} (token, id) pairs differ); a draft model must share the base's tokenizer")
    model = AutoModelForCausalLM.from_pretrained(name, dtype=base.dtype,
                                                 attn_implementation=base.config._attn_implementation)
    if model.config.vocab_size != base.vocab_size:
        raise ValueError(f"draft model {name}: {model.config.vocab_size:,} output logits, the base has "
                         f"{base.vocab_size:,}; a draft model must score the base's vocabulary")
    return model.to(base.device).eval().requires_grad_(False)


def _share(module: nn.Module, weight: torch.Tensor) -> None:
    """Make module.weight the base's own tensor as a non-persistent buffer: used, never trained, never saved."""
    del module.weight
    module.register_buffer("weight", weight.detach(), persistent=False)
