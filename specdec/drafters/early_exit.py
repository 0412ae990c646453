"""Early-exit drafter (LayerSkip / self-speculative style): the base's own first L layers, an optional stack of
trainable decoder blocks, a norm and a vocab projection, trained to predict the base's final next-token
distribution from the layer-L hidden state. It drafts autoregressively, one token per depth, and shares the
base's KV cache for layers 0..L-1 because those are the same weights."""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch import nn

from specdec.base import Base, Features
from specdec.drafters.drafter import DraftContext, Drafter, DraftVocab, TrainOutput, copy_lm_head

STORE = "early_exit"  # the private KV cache of the extra blocks (layers 0..L-1 use the base's own cache)


def causal_mask(T: int, like: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] additive mask: HF attention (eager or sdpa) uses a 4D mask as given, so this works for both."""
    blocked = torch.ones(T, T, dtype=torch.bool, device=like.device).triu(1)
    mask = torch.zeros(T, T, dtype=like.dtype, device=like.device)
    return mask.masked_fill(blocked, torch.finfo(like.dtype).min)[None, None]


def run_causal(base: Base, layers: Sequence[nn.Module], h: torch.Tensor) -> torch.Tensor:
    """Teacher-forced pass of decoder layers over full sequences h [B, T, H] (positions 0..T-1, no cache)."""
    if not len(layers):
        return h
    pos = torch.arange(h.shape[1], device=h.device)[None]  # [1, T]
    rope = base.rotary_emb(h, pos)  # (cos, sin), each [1, T, head_dim]
    mask = causal_mask(h.shape[1], h)
    for layer in layers:
        h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
    return h


class ExitHead(nn.Module):
    """What sits on top of one exit layer L: extra decoder blocks -> norm -> vocab projection."""

    def __init__(self, base: Base, exit_layer: int, num_extra_layers: int, extra_init: str, own_lm_head: bool,
                 draft_vocab_size: int | None = None):
        super().__init__()
        # The base's own decoder-layer class built from the base config. layer_idx keys each block's slot in
        # the drafter-private cache, so the blocks of one head get distinct indices 0..n-1.
        layer_cls = type(base.layers[0])
        self.blocks = nn.ModuleList(layer_cls(base.config, layer_idx=i) for i in range(num_extra_layers))
        self.blocks.to(device=base.device, dtype=base.dtype)
        for i, block in enumerate(self.blocks):
            if extra_init == "copy":  # a trainable copy of the base layer the block replaces
                block.load_state_dict(base.layers[exit_layer + i].state_dict())
            else:
                block.apply(base.model._init_weights)  # the base's own init scheme
                # Zero the residual-branch outputs so a fresh block starts as the identity: training starts from
                # the plain layer-L exit rather than from a random perturbation of it.
                nn.init.zeros_(block.self_attn.o_proj.weight)
                nn.init.zeros_(block.mlp.down_proj.weight)
        # Starts as the base's final norm; train() because the copy inherits the frozen base's eval mode.
        self.norm = copy.deepcopy(base.norm).train().requires_grad_(True)
        # Own projection: a trainable copy of the base lm_head; otherwise the base's is used, frozen and unregistered.
        self.lm_head = copy_lm_head(base, draft_vocab_size) if own_lm_head else None


class EarlyExit(Drafter):
    """One training entry per exit layer (a layer sweep trains several at once, each with its own head); the
    sampler drafts with the first exit layer. Every entry predicts token t+1 from the layer-L state at t."""

    graph_draft = True
    drafts_from_tokens = True  # the base's first layers and its own blocks over the path's tokens: stages may check

    def __init__(
        self,
        base: Base,
        exit_layers: Sequence[int] = (8,),
        num_extra_layers: int = 0,
        extra_init: str = "fresh",
        own_lm_head: bool = False,
        gamma: int = 4,
        draft_vocab_size: int | None = None,
    ):
        exit_layers = [int(l) for l in exit_layers]  # plain ints: hparams go to the checkpoint json
        super().__init__(
            base, exit_layers=exit_layers, num_extra_layers=num_extra_layers, extra_init=extra_init,
            own_lm_head=own_lm_head, gamma=gamma, draft_vocab_size=draft_vocab_size,
        )
        n = base.num_layers
        if not exit_layers or any(not 0 <= l <= n for l in exit_layers):
            raise ValueError(f"exit_layers must be a non-empty list of layers in 0..{n}, got {exit_layers}")
        if extra_init not in ("fresh", "copy"):
            raise ValueError(f"extra_init must be 'fresh' or 'copy', got {extra_init!r}")
        if extra_init == "copy" and max(exit_layers) + num_extra_layers > n:
            raise ValueError(f"extra_init=copy needs exit layer + num_extra_layers <= {n} base layers")
        if num_extra_layers and n in exit_layers:
            # Blocks on top of the full base make a drafter slower than the base itself, and its observed
            # layer-n feature would be the normed final state (see `exit_hidden`).
            raise ValueError(f"an exit at the last layer ({n}) takes no extra blocks")
        self.exit_layers = exit_layers
        self.gamma = gamma
        self.draft_vocab = DraftVocab(base, draft_vocab_size) if draft_vocab_size else None  # shared by every exit
        self.exits = nn.ModuleList(
            ExitHead(base, l, num_extra_layers, extra_init, own_lm_head, draft_vocab_size) for l in exit_layers
        )
        # Features.hidden[n] is HF's last hidden state, already normed; an exit at n reads layer n-1 instead
        # and runs the base's last block itself (see `exit_hidden`).
        self.feature_layers = tuple(sorted({l - 1 if l == n else l for l in exit_layers}))
        self.target_offsets = [0] * len(exit_layers)
        self.head_names = [f"exit{l}" for l in exit_layers]

    # -- shared by training and sampling -----------------------------------------------------
    def vocab_heads(self) -> list[nn.Linear]:
        return [e.lm_head for e in self.exits if e.lm_head is not None]

    def head_logits(self, k: int, h: torch.Tensor) -> torch.Tensor:
        """Exit k's pre-norm state h [..., H] (after its extra blocks) -> logits [..., V_d]."""
        head = self.exits[k]
        return self.project(head.norm(h), head.lm_head)

    # -- training ----------------------------------------------------------------------------
    def exit_hidden(self, feats: Features, layer: int) -> torch.Tensor:
        """The pre-norm output of base block layer-1 [B, T, H]. HF's hidden_states[num_layers] is the final
        state AFTER the base norm (== last_hidden_state), not the block output, so for an exit at the last layer
        the frozen last block is run here on hidden[num_layers - 1], in the base's dtype."""
        if layer < self.base.num_layers:
            return feats.hidden[layer]
        h = feats.hidden[layer - 1]
        with torch.no_grad():
            return run_causal(self.base, self.base.layers[layer - 1 :], h.to(self.base.dtype)).to(h.dtype)

    def forward_train(self, feats: Features, input_ids: torch.Tensor) -> TrainOutput:
        # feats come from a no-grad frozen forward: nothing upstream of the exit state is trainable, so there
        # is no gradient to stop or to let through (no "detach" option, see configs/drafter/early_exit.yaml).
        logits = []
        for k, layer in enumerate(self.exit_layers):
            h = run_causal(self.base, self.exits[k].blocks, self.exit_hidden(feats, layer))  # [B, T, H]
            logits.append(self.head_logits(k, h))  # [B, T, V]
        return TrainOutput(logits=torch.stack(logits, dim=2))  # [B, T, K, V]

    def expected_tau(self, accept: torch.Tensor) -> torch.Tensor:
        """Autoregressive chain of gamma drafts, each accepted with the same α: τ = (1 − α^{γ+1}) / (1 − α),
        written as Σ_{i≤γ} α^i (no 0/0 at α = 1). A layer sweep reports the first exit: the one the sampler uses."""
        alpha = accept[0]
        return torch.stack([alpha**i for i in range(self.gamma + 1)]).sum()

    # -- sampling: the first exit layer drafts; one base layer-L pass + head per depth ------------------
    def init_state(self, batch_size: int, max_len: int) -> dict[str, Any]:
        return {}

    def observe(self, state, ctx: DraftContext, feats: Features, tokens, n_new, next_token) -> None:
        # Layers 0..L-1 need nothing: the verify forward already wrote their cache slots. The extra blocks get
        # the committed positions' layer-L states from the base, replacing whatever the draft wrote there.
        head = self.exits[0]
        if len(head.blocks):
            ctx.run_layers(head.blocks, feats.hidden[self.exit_layers[0]], store=STORE)

    def expand(self, state, ctx: DraftContext, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
               nodes: torch.Tensor) -> torch.Tensor:
        L = self.exit_layers[0]
        h = self.base.embed_tokens(tokens)  # [B, N, H]
        if L:  # base layers 0..L-1 on the base's own cache: the verify forward overwrites the same slots
            h = ctx.run_layers(self.base.layers[:L], h, store="base")
        head = self.exits[0]
        if len(head.blocks):
            h = ctx.run_layers(head.blocks, h, store=STORE)
        return self.head_logits(0, h)  # [B, N, V_d]
