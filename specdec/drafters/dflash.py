"""DFlash (Chen et al. 2026, arXiv 2602.06036): a block drafter. One forward pass of a few decoder layers fills a
whole block of masked positions, conditioned on the base's hidden states injected as keys and values.

- Context: for every committed position t, c_t = hidden_norm(fc([a^{l_1}_t; …; a^{l_k}_t])) (k·H -> H, no bias),
  a^l the input of base layer l (HF hidden_states[l]). Each draft layer reads c_t through its own k_proj / v_proj
  (no input norm: c_t is normed already), rotated at position t: keys and values only, never a query.
- Block: [anchor, MASK × (b − 1)] at positions a .. a + b − 1, the anchor the newest token the base emitted (the
  round's root). The block's queries attend to the context strictly before a and to the whole block (bidirectional),
  through the base's own decoder-layer class; then norm and the vocab head. Block index k (k ≥ 1) proposes a + k.
- Training sees every position as an anchor at once: one block per position, each blind to the other blocks
  (the trainer's entry j at position t is block index j + 1, target offset j: token t + 1 + j). The paper samples
  anchors instead; anchoring every position trains on every block the data offers, at one block's cost per position
  (the trainer's losses are per position). Entries are weighted module.head_decay ** j, DFlash's exp(-(k-1)/γ) with
  head_decay = exp(-1/γ).
- Sampling: `observe` writes the newly committed positions' context keys (DraftContext.write_keys); the first
  `expand` of a round runs the block once; every depth reads its position's logits from that pass.

The token embeddings and the mask token's embedding are the base's, frozen; the vocab head is the base's lm_head
(frozen, its draft-vocab rows with a draft vocab) unless own_lm_head. A fresh drafter starts from the base's last
`num_layers` layers, and fc and hidden_norm pass the highest fused layer through that first layer's input norm: the
first draft layer's context keys and values are then exactly that base layer's own.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from specdec.base import LAST, Base, Features, cache_arg, layer_keys
from specdec.drafters.drafter import DraftContext, Drafter, DraftVocab, TrainOutput, copy_lm_head
from specdec.drafters.eagle3 import default_aux_layers

STORE = "dflash"  # the drafter-private KV store in the sampler's DraftContext


def default_mask_token(base: Base) -> int:
    """The tokenizer's mask token; without one (SmolLM2 has no spare id: 49,152 tokens, 49,152 embedding rows) its
    highest special token that is none of bos, eos, pad and unk (SmolLM2: 16, <empty_output>); without a tokenizer's
    specials, the last id."""
    tok = base.tokenizer
    if getattr(tok, "mask_token_id", None) is not None:
        return int(tok.mask_token_id)
    used = {getattr(tok, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")}
    # the added tokens marked special, not only the named ones all_special_ids lists (SmolLM2's are bos, eos, unk)
    specials = set(getattr(tok, "all_special_ids", [])) | {
        i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    spare = [i for i in specials if i not in used and i < base.vocab_size]
    return max(spare) if spare else base.vocab_size - 1


@functools.lru_cache(maxsize=8)
def train_mask(t: int, b: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive mask of training's every-position blocks, queries [T·b] (block t's b slots in a row) over keys
    [T context | T·b blocks]: block t sees the context before t and its own b slots -> [T·b, T + T·b]."""
    anchor = torch.arange(t, device=device).repeat_interleave(b)  # [T·b] each query's anchor
    sees_context = torch.arange(t, device=device)[None] < anchor[:, None]  # [T·b, T]
    sees_block = anchor[:, None] == anchor[None]  # [T·b, T·b]
    allowed = torch.cat([sees_context, sees_block], dim=1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)


class DFlash(Drafter):
    def __init__(self, base: Base, num_layers: int = 1, block_size: int = 4, aux_layers: list[int] | None = None,
                 mask_token_id: int | None = None, draft_vocab_size: int | None = 8192, own_lm_head: bool = False):
        aux_layers = [int(l) for l in aux_layers] if aux_layers else default_aux_layers(base.num_layers)
        mask_token_id = default_mask_token(base) if mask_token_id is None else int(mask_token_id)
        draft_vocab_size = min(draft_vocab_size, base.vocab_size) if draft_vocab_size else None
        super().__init__(base, num_layers=num_layers, block_size=block_size, aux_layers=aux_layers,
                         mask_token_id=mask_token_id, draft_vocab_size=draft_vocab_size, own_lm_head=own_lm_head)
        if not 0 <= mask_token_id < base.vocab_size:
            raise ValueError(f"dflash: mask_token_id {mask_token_id} is outside the base's vocabulary "
                             f"[0, {base.vocab_size})")
        if block_size < 2:
            raise ValueError(f"dflash: block_size must be >= 2 (the anchor and one masked position), got {block_size}")
        if not 1 <= num_layers <= base.num_layers:
            raise ValueError(f"dflash: num_layers must be in [1, {base.num_layers}], got {num_layers}")
        if any(not (0 < l <= base.num_layers or l == LAST) for l in aux_layers):
            raise ValueError(f"dflash: aux_layers must be base layers in (0, {base.num_layers}] or {LAST} (the normed "
                             f"output), got {aux_layers}")
        h = base.hidden_size
        self.aux_layers, self.block_size, self.mask_token_id = aux_layers, block_size, mask_token_id
        self.feature_layers = tuple(aux_layers)
        self.fc = nn.Linear(len(aux_layers) * h, h, bias=False)
        self.hidden_norm = type(base.norm)(h, eps=base.config.rms_norm_eps)
        layer_cls = type(base.layers[0])
        self.layers = nn.ModuleList(layer_cls(base.config, layer_idx=i) for i in range(num_layers))
        self.norm = type(base.norm)(h, eps=base.config.rms_norm_eps)
        self.draft_vocab = DraftVocab(base, draft_vocab_size) if draft_vocab_size else None
        self.lm_head = copy_lm_head(base, draft_vocab_size) if own_lm_head else None
        self._init_from_base()
        self.to(device=base.device, dtype=base.dtype)
        self.target_offsets = list(range(block_size - 1))
        self.head_names = [f"pos{k}" for k in range(1, block_size)]
        self.max_depth = block_size - 1  # a deeper draft is refused by the sampler, in one line

    @torch.no_grad()
    def _init_from_base(self) -> None:
        """The draft layers start as the base's last len(layers) layers, the final norm as the base's; fc passes the
        highest fused layer through and hidden_norm is the first source layer's input norm, so the first draft
        layer's context keys and values start as that base layer's own for an input of the highest fused layer."""
        n, h = len(self.layers), self.fc.out_features
        sources = self.base.layers[self.base.num_layers - n:]
        for mine, theirs in zip(self.layers, sources):
            mine.load_state_dict(theirs.state_dict())
        self.fc.weight.zero_()
        self.fc.weight[:, -h:].copy_(torch.eye(h))
        self.hidden_norm.weight.copy_(sources[0].input_layernorm.weight)
        self.norm.weight.copy_(self.base.norm.weight)

    def vocab_heads(self) -> list[nn.Linear]:
        return [self.lm_head] if self.lm_head is not None else []

    def context(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The base's hidden states {layer: [B, n, H]} -> the context c [B, n, H] every draft layer reads."""
        return self.hidden_norm(self.fc(torch.cat([hidden[l] for l in self.aux_layers], dim=-1)))

    def block_input(self, anchors: torch.Tensor, size: int) -> torch.Tensor:
        """Anchor tokens [...] -> the embedded blocks [..., size, H]: each anchor, then size − 1 mask tokens."""
        ids = anchors.new_full((*anchors.shape, size), self.mask_token_id)
        ids[..., 0] = anchors
        return self.base.embed_tokens(ids)

    def readout(self, out: torch.Tensor) -> torch.Tensor:
        """The blocks' outputs at the masked positions [..., H] -> draft logits [..., V_d]."""
        return self.project(self.norm(out), self.lm_head)

    # -- training ----------------------------------------------------------------------------------------------
    def forward_train(self, feats: Features, input_ids: torch.Tensor) -> TrainOutput:
        bsz, t = input_ids.shape
        b, dev = self.block_size, input_ids.device
        c = self.context(feats.hidden)  # [B, T, H]
        x = self.block_input(input_ids, b).flatten(1, 2)  # [B, T·b, H]: block t's slots in a row
        pos = torch.arange(t, device=dev)
        block_pos = (pos[:, None] + torch.arange(b, device=dev)).flatten()[None].expand(bsz, -1)  # [B, T·b]
        cos, sin = self.base.rotary_emb(c, pos[None].expand(bsz, -1))  # [B, T, d]: the context's positions
        rope = self.base.rotary_emb(x, block_pos)
        mask = train_mask(t, b, x.dtype, dev)[None, None]  # [1, 1, T·b, T + T·b]
        cache = DynamicCache()  # each layer's context keys, then its blocks' (appended by the layer itself)
        for layer in self.layers:
            cache.update(*layer_keys(layer, c, cos, sin), layer.self_attn.layer_idx)
            out = layer(x, attention_mask=mask, position_ids=block_pos, use_cache=True, position_embeddings=rope,
                        **cache_arg(layer, cache))
            x = out[0] if isinstance(out, tuple) else out
        return TrainOutput(logits=self.readout(x.view(bsz, t, b, -1)[:, :, 1:]))  # [B, T, b − 1, V_d]

    # -- sampling ----------------------------------------------------------------------------------------------
    def init_state(self, batch_size: int, max_len: int) -> dict[str, Any]:
        # root: the round's anchor [B]; logits: the block's draft logits [B, b − 1, V_d] once drafted this round
        return {"root": None, "logits": None}

    def observe(self, state, ctx: DraftContext, feats: Features, tokens, n_new, next_token) -> None:
        ctx.commit_layout(tokens.shape[1])
        ctx.write_keys(self.layers, self.context(feats.hidden), STORE)  # (padding rows write slots never seen)
        state["root"], state["logits"] = next_token, None

    def draft_block(self, state, ctx: DraftContext) -> torch.Tensor:
        """The round's block in one pass: the anchor and a mask for each depth the round drafts (ctx.draft_depth, at
        most block_size − 1) -> logits [B, depth, V_d], kept for the round's later depths. Its size is the sampler's
        depth, never how the round is drafted: the block is bidirectional, so its size changes every position's
        logits."""
        size = min(ctx.draft_depth, self.max_depth) + 1
        ctx.block_layout(size)
        out = ctx.run_layers(self.layers, self.block_input(state["root"], size), STORE)  # [B, size, H]
        state["logits"] = self.readout(out[:, 1:])
        return state["logits"]

    def expand(self, state, ctx: DraftContext, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
               nodes: torch.Tensor) -> torch.Tensor:
        logits = state["logits"] if depth else self.draft_block(state, ctx)
        return logits[:, depth, None].expand(-1, tokens.shape[1], -1)  # [B, N, V_d]: every node at this depth
