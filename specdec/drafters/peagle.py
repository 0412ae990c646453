"""P-EAGLE (Hui et al. 2026, arXiv 2602.01469): EAGLE-3 that drafts K tokens in one forward pass, as speculators'
PEagleDraftModel trains it (vLLM reads its checkpoints: specdec/export/peagle.py).

- Real entries are EAGLE-3's (specdec/drafters/eagle3.py): for base position t, (g_t, x_{t+1}) with g_t = fc over the
  inputs of three base layers, through the EAGLE-3 layer (its attention reads cat(input_layernorm(emb(x)),
  hidden_norm(g))), then `num_layers` − 1 plain decoder layers of the base's class over H (speculators' and vLLM's
  later layers), the final norm and the draft lm_head. The round's root entry (g_t, x_{t+1}), x_{t+1} the base's
  newest token, is depth 0 and proposes x_{t+2}.
- Depth k ≥ 1 of anchor t is a masked entry: token `mask_token_id` (the base's embedding, frozen) with the learned
  `mask_hidden` [1, 1, 3H] in place of the three fused layers, fc(mask_hidden) in place of g. It sits at rotary
  position t + k and proposes x_{t+k+2}. It attends to the real entries ≤ t and to its own chain's masked entries at
  depths ≤ k (speculators' create_peagle_mask_mod: causal within the chain, never another anchor's): nothing it reads
  depends on the tokens drafted before it, so one pass drafts every depth.
- Training: depth 0 at every position, as EAGLE-3's first TTT step. Depth k ≥ 1 is thinned by COD, speculators'
  generate_cod_sample_indices: it keeps int(n_k · max(ratio^k, ratio_min)) anchors (n_k the anchors whose depth-k
  target lies in the block), drawn among the anchors depth k − 1 kept, so each kept entry's chain (what it attends to)
  is kept. The thinned entries alone carry gradient, in one pass of their own. The trainer here scores a dense
  [B, T, K, V] (TrainOutput): the entries COD leaves out get their values from a no-grad pass over every entry, so
  the logged losses and metrics are the dense ones and the gradient is COD's. The draws are the same for every row
  of a batch (speculators trains one sequence at a time) and ignore `module.loss_on` (speculators draws among
  loss-mask positions). Per kept entry, our trainer's weight is head_decay^(k+1) / n_k: with head_decay 1 every kept
  entry counts alike, as in speculators' mean over the sampled entries.
- Sampling: `observe` writes the committed real entries (slot s holds the entry of position s − 1, slot 0 the sink
  (0, x_0): the feature drafters' layout, specdec/drafters/feature.py); the root's `expand` runs [root entry,
  mask × (γ − 1)] once over the round's first γ slots, causal, and keeps its γ logits; each later depth reads its
  own. Every node at depth d gets depth d's logits, whichever tokens its ancestors are: the drafts are independent of
  one another, so a tree's siblings share them.

The token embeddings are the base's (speculators trains them, `embed_requires_grad`; here the mask token's embedding
is the base's row and `mask_hidden` is what is learned). A fresh drafter starts as EAGLE-3's (its first layer a copy
of the base layer its highest fused input feeds), its later layers copies of the base layers after that one, and
mask_hidden ~ N(0, 1) as speculators initialises it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from specdec.base import Base, Features
from specdec.drafters.dflash import default_mask_token
from specdec.drafters.drafter import DraftContext, TrainOutput, newest, unroll_mask
from specdec.drafters.eagle3 import Eagle3, default_aux_layers
from specdec.drafters.feature import POSITION_OFFSET

STORE = "peagle"  # the drafter-private KV store in the sampler's DraftContext


def cod_entries(t: int, num_depths: int, ratio: float, ratio_min: float,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """COD over a block of T positions: the masked entries training runs -> (anchors [S], depths [S]), depth-major,
    anchors sorted within a depth. Depth k (1 ≤ k < K) keeps int(n_k · max(ratio^k, ratio_min)) of the anchors depth
    k − 1 kept (every anchor for k = 1) that still have a target at depth k, n_k = T − 2 − k of them."""
    anchors, depths = [], []
    pool = torch.arange(max(t - 3, 0))  # the anchors with a depth-1 target: t ≤ T − 4
    for k in range(1, num_depths):
        n = t - 2 - k
        size = int(n * max(ratio**k, ratio_min)) if n > 0 else 0
        if size <= 0:
            break
        pool = pool[pool < n]
        if len(pool) > size:
            pool = pool[torch.randperm(len(pool), generator=generator)[:size]].sort().values
        anchors.append(pool)
        depths.append(torch.full_like(pool, k))
    if not anchors:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(anchors), torch.cat(depths)


def masked_mask(t: int, anchors: torch.Tensor, depths: torch.Tensor, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """The additive mask of masked entries (anchor, depth) [S] over keys [sink + T real entries | the S masked]:
    each sees the sink and the real entries ≤ its anchor (slots ≤ anchor + 1) and its own chain's masked entries at
    depths ≤ its own -> [S, T + 1 + S]."""
    anchors, depths = anchors.to(device), depths.to(device)
    real = torch.arange(t + 1, device=device)[None] <= anchors[:, None] + 1  # [S, T+1]
    chain = (anchors[:, None] == anchors[None]) & (depths[None] <= depths[:, None])  # [S, S]
    allowed = torch.cat([real, chain], dim=1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)


class PEagle(Eagle3):
    store = STORE
    graph_draft = False  # its root `expand` lays out its own block (commit_layout), which a recorded round would not

    def __init__(self, base: Base, num_depths: int = 4, num_layers: int = 1, draft_vocab_size: int | None = 8192,
                 aux_layers: list[int] | None = None, mask_token_id: int | None = None,
                 down_sample_ratio: float = 0.7, down_sample_ratio_min: float = 0.2):
        aux_layers = [int(l) for l in aux_layers] if aux_layers else default_aux_layers(base.num_layers)
        if len(aux_layers) != 3 or any(not 0 < l < base.num_layers for l in aux_layers):
            raise ValueError(f"peagle fuses three inner base layers in (0, {base.num_layers}), got {aux_layers}")
        mask_token_id = default_mask_token(base) if mask_token_id is None else int(mask_token_id)
        if not 0 <= mask_token_id < base.vocab_size:
            raise ValueError(f"peagle: mask_token_id {mask_token_id} is outside the base's vocabulary "
                             f"[0, {base.vocab_size})")
        if num_depths < 1:
            raise ValueError(f"peagle: num_depths must be >= 1 (the root entry's depth), got {num_depths}")
        if num_layers < 1:
            raise ValueError(f"peagle: num_layers must be >= 1, got {num_layers}")
        if not (0 < down_sample_ratio <= 1 and 0 <= down_sample_ratio_min <= 1):
            raise ValueError(f"peagle: COD's ratios must be in (0, 1] and [0, 1], got {down_sample_ratio} and "
                             f"{down_sample_ratio_min}")
        super().__init__(base, ttt_steps=num_depths, draft_vocab_size=draft_vocab_size, aux_layers=aux_layers)
        self.hparams = dict(num_depths=num_depths, num_layers=num_layers, draft_vocab_size=self.draft_vocab.size,
                            aux_layers=self.aux_layers, mask_token_id=mask_token_id,
                            down_sample_ratio=down_sample_ratio, down_sample_ratio_min=down_sample_ratio_min)
        h, kind = base.hidden_size, type(base.layers[0])
        for i in range(1, num_layers):  # layer i starts as the base layer i after the first one's source
            layer = kind(base.config, layer_idx=i)
            layer.load_state_dict(base.layers[min(self.aux_layers[-1] + i, base.num_layers - 1)].state_dict())
            self.layers.append(layer.to(device=base.device, dtype=base.dtype))
        # the three fused layers' stand-in at every masked entry, before fc (speculators' and vLLM's name and shape)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, len(self.aux_layers) * h, device=base.device,
                                                    dtype=base.dtype))
        self.num_depths, self.mask_token_id = num_depths, mask_token_id
        self.down_sample_ratio, self.down_sample_ratio_min = down_sample_ratio, down_sample_ratio_min
        self.head_names = [f"depth{k}" for k in range(num_depths)]  # entry k proposes x_{t+k+2}: offset k + 1
        self.max_depth = num_depths  # a deeper draft is refused by the sampler, in one line

    def mask_entry(self) -> torch.Tensor:
        """Every masked entry's step input [1, 1, 2H]: emb(mask token) with fc(mask_hidden)."""
        emb = self.base.embed_tokens(torch.tensor([[self.mask_token_id]], device=self.mask_hidden.device))
        return self.step_input(self.fc(self.mask_hidden), emb)

    # -- training ----------------------------------------------------------------------------------------------
    def forward_train(self, feats: Features, input_ids: torch.Tensor) -> TrainOutput:
        g = self.real_feature(feats.hidden)  # [B, T, H]
        t, k = input_ids.shape[1], self.num_depths
        if not (self.training and torch.is_grad_enabled()) or k == 1:
            return TrainOutput(logits=self.dense(g, input_ids))
        with torch.no_grad():  # the values of the entries COD leaves out: logged, never trained
            logits = self.dense(g, input_ids)
        anchors, depths = cod_entries(t, k, self.down_sample_ratio, self.down_sample_ratio_min)
        first, kept = self.parallel(g, input_ids, anchors, depths)
        logits[:, :, 0] = first
        logits[:, anchors.to(logits.device), depths.to(logits.device)] = kept
        return TrainOutput(logits=logits)  # [B, T, K, V_d]

    def dense(self, g: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Every depth at every position: g [B, T, H], input_ids [B, T] -> logits [B, T, K, V_d]."""
        b, t = input_ids.shape
        k = self.num_depths
        anchors, depths = torch.arange(t).repeat(k - 1), torch.arange(1, k).repeat_interleave(t)  # depth-major
        first, masked = self.parallel(g, input_ids, anchors, depths)  # [B, T, V_d], [B, (K−1)·T, V_d]
        masked = masked.view(b, k - 1, t, first.shape[-1]).transpose(1, 2)  # [B, T, K − 1, V_d]
        return torch.cat([first[:, :, None], masked], dim=2)

    def parallel(self, g: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                 depths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g [B, T, H] real features, input_ids [B, T], masked entries (anchor, depth) [S] -> (depth 0's logits at
        every position [B, T, V_d], the masked entries' [B, S, V_d]). Real entries: EAGLE-3's step 0 over
        [sink, (g_0, x_1), …, (g_{T-1}, x_T)] at positions −1 .. T − 1, causal (x_T past the block: zero)."""
        b, t, hs = g.shape
        dev = g.device
        emb = self.base.embed_tokens(input_ids)  # [B, T, H]
        nxt = torch.cat([emb[:, 1:], emb.new_zeros(b, 1, hs)], dim=1)  # emb(x_{t+1})
        x0 = self.step_input(torch.cat([g.new_zeros(b, 1, hs), g], 1), torch.cat([emb[:, :1], nxt], 1))
        cache = DynamicCache()  # the real entries' keys, then the masked entries'
        out = self._run(x0, torch.arange(-1, t, device=dev), unroll_mask(t, 0, x0.dtype, dev), cache)
        first = self.readout(out[:, 1:])[1]  # [B, T, V_d]
        if len(anchors) == 0:
            return first, first.new_zeros(b, 0, first.shape[-1])
        x = self.mask_entry().expand(b, len(anchors), -1)  # [B, S, 2H]
        pos = (anchors + depths).to(dev)
        out = self._run(x, pos, masked_mask(t, anchors, depths, x.dtype, dev), cache)
        return first, self.readout(out)[1]

    # -- sampling ----------------------------------------------------------------------------------------------
    def init_state(self, batch_size: int, max_len: int) -> dict[str, Any]:
        g = torch.zeros(batch_size, self.base.hidden_size, device=self.base.device, dtype=self.base.dtype)
        # g: newest committed real feature per row (zero before the prompt: the sink), the root entry's; logits:
        # the round's drafts [B, γ, V_d] once its root is expanded
        return {"g": g, "logits": None}

    def observe(self, state, ctx: DraftContext, feats: Features, tokens, n_new, next_token) -> None:
        # the committed entries only: the root entry runs in the round's one pass, with the masks that read it
        g = self.real_feature(feats.hidden)  # [B, n, H]
        prev = torch.cat([state["g"][:, None], g[:, :-1]], dim=1)  # [B, n, H]: slot L + i gets (g_{L+i-1}, x_{L+i})
        ctx.commit_layout(tokens.shape[1])
        ctx.run_layers(self.layers, self.step_input(prev, self.base.embed_tokens(tokens)), STORE, POSITION_OFFSET)
        state["g"], state["logits"] = newest(g, n_new), None

    def draft_block(self, state, ctx: DraftContext, root: torch.Tensor) -> torch.Tensor:
        """The round's drafts in one pass: root tokens [B] -> logits [B, γ, V_d] for the depths 0 .. γ − 1 the round
        drafts (γ = ctx.draft_depth). The entries take the round's first γ slots at depths 0 .. γ − 1, causal:
        commit_layout's layout, the committed length being the root's slot (block_layout's block would see itself
        both ways, and the root entry would read the masks)."""
        n = min(ctx.draft_depth, self.num_depths)
        root_entry = self.step_input(state["g"][:, None], self.base.embed_tokens(root)[:, None])  # [B, 1, 2H]
        x = torch.cat([root_entry, self.mask_entry().expand(root.shape[0], n - 1, -1)], dim=1)  # [B, γ, 2H]
        ctx.commit_layout(n)
        return self.readout(ctx.run_layers(self.layers, x, STORE, POSITION_OFFSET))[1]

    def expand(self, state, ctx: DraftContext, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
               nodes: torch.Tensor) -> torch.Tensor:
        if depth == 0:
            state["logits"] = self.draft_block(state, ctx, tokens[:, 0])
        return state["logits"][:, depth, None].expand(-1, tokens.shape[1], -1)  # [B, N, V_d]: every node at depth
