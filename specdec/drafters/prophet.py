"""ProphetNet-style feature-level predictor (in the spirit of EAGLE): a small decoder, built from the base's own
decoder-layer class, that predicts the base's next last-layer feature from the known features and tokens and
then keeps going on its OWN predicted features, one step at a time (specdec/drafters/feature.py: the entries,
positions, training unroll and sampling it shares with EAGLE-3).

- Step input: fc([f; emb_norm(emb(x))]) (2H -> H), f the feature of position t (real or predicted), x = x_{t+1}.
- Readout: ĥ = norm(layers' output), the predicted (normed) last-layer feature of position t + 1, which the next step
  reads; the logits are the vocab head's over ĥ. Training regresses ĥ on the base's real feature (feature_weight).

With `fuse_layers` (EAGLE-3's feature fusion), the real f_t is not the last layer alone but a learnt mix of it and
the hidden states of earlier base layers: f_t = fuse([norm(h^{l_1}_t); …; h_t]), which starts as h_t exactly. The
chain steps still read the predictor's own ĥ, so fusion changes only what the real entries carry."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.base import LAST, Base, Features
from specdec.drafters.drafter import ChainParts, DraftContext, DraftVocab, NodeTable, TrainOutput, copy_lm_head
from specdec.drafters.feature import POSITION_OFFSET, FeatureDrafter

STORE = "prophet"  # the drafter-private KV store in the sampler's DraftContext


class Prophet(FeatureDrafter):
    aux_metric_names = ("feature_loss", "feature_loss_last")
    store = STORE

    def __init__(
        self,
        base: Base,
        num_layers: int = 1,
        unroll_steps: int = 4,
        feature_weight: float = 0.1,
        own_lm_head: bool = False,
        draft_vocab_size: int | None = None,
        fuse_layers: list[int] | None = None,
    ):
        fuse_layers = sorted(int(l) for l in fuse_layers or ())
        super().__init__(
            base, num_layers=num_layers, unroll_steps=unroll_steps, feature_weight=feature_weight,
            own_lm_head=own_lm_head, draft_vocab_size=draft_vocab_size, fuse_layers=fuse_layers,
        )
        h = base.hidden_size
        if any(not 0 < l < base.num_layers for l in fuse_layers):
            raise ValueError(f"fuse_layers must be inner base layers in (0, {base.num_layers}), got {fuse_layers}")
        self.fuse_layers = fuse_layers
        self.feature_layers = (*fuse_layers, LAST)
        # Inner hidden states are un-normed residual streams whose scale grows with depth: each gets its own RMSNorm
        # so the fusion starts from comparable inputs.
        self.fuse_norms = nn.ModuleList(type(base.norm)(h, eps=base.config.rms_norm_eps) for _ in fuse_layers)
        self.fuse = nn.Linear((len(fuse_layers) + 1) * h, h, bias=False) if fuse_layers else None
        # Token embeddings are ~15x smaller than the normed features (SmolLM2: RMS 0.14 vs 2.2): normalise them
        # first, or the token half of fc learns far slower than the feature half.
        self.emb_norm = type(base.norm)(h, eps=base.config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        # The base's decoder-layer class, built from the base config; layer_idx keys this drafter's own cache.
        layer_cls = type(base.layers[0])
        self.blocks = nn.ModuleList(layer_cls(base.config, layer_idx=i) for i in range(num_layers))
        self.norm = copy.deepcopy(base.norm).requires_grad_(True).train()  # trainable, starts as the base's final norm
        self.draft_vocab = DraftVocab(base, draft_vocab_size) if draft_vocab_size else None
        self.lm_head = copy_lm_head(base, draft_vocab_size) if own_lm_head else None
        self._init_identity()
        self.to(device=base.device, dtype=base.dtype)
        self.unroll_steps = unroll_steps
        self.feature_weight = feature_weight
        self.target_offsets = list(range(1, unroll_steps + 1))
        self.head_names = [f"step{j}" for j in range(1, unroll_steps + 1)]
        self.max_depth = None  # a chain can run as deep as the sampler asks
        self._native_parts: ChainParts | None = None  # what the native calls read (`init_state`)

    @torch.no_grad()
    def _init_identity(self) -> None:
        """A fresh predictor returns ĥ = norm(fc([h; e])) = h exactly, i.e. it starts as the base's own head on
        h_t (like a fresh Medusa head) instead of as noise. The h-half of fc undoes the final norm's weight, so
        the stream the blocks see is unit-RMS like the base's residual direction; the token half and every
        block's output projections start at zero (each residual branch is then the identity) and get gradient
        from the first step."""
        h = self.fc.in_features // 2
        w = self.base.norm.weight.detach().float()
        w = torch.where(w.abs() < 1e-2, torch.full_like(w, 1e-2).copysign(w), w)  # no blow-up at tiny weights
        self.fc.weight.zero_()
        self.fc.weight[:, :h].copy_(torch.diag(1 / w))
        for block in self.blocks:
            nn.init.zeros_(block.self_attn.o_proj.weight)
            nn.init.zeros_(block.mlp.down_proj.weight)
        if self.fuse is not None:  # f = h_last: the inner layers' columns start at zero
            self.fuse.weight.zero_()
            self.fuse.weight[:, -h:].copy_(torch.eye(h))

    @property
    def layers(self) -> nn.ModuleList:
        return self.blocks  # (the state dict's name for them: `blocks.*`)

    # -- pieces shared by training and sampling ----------------------------------------------------------------
    def real_feature(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The base's hidden states {layer: [..., H]} -> the feature a real entry carries [..., H]: the last layer's,
        or with fuse_layers its fusion with the inner ones."""
        if self.fuse is None:
            return hidden[LAST]
        inner = [norm(hidden[l]) for norm, l in zip(self.fuse_norms, self.fuse_layers)]
        return self.fuse(torch.cat([*inner, hidden[LAST]], dim=-1))

    def step_input(self, feature: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """[..., H] feature of position t (real or predicted) and [..., H] embedding of x_{t+1} -> [..., H]."""
        return self.fc(torch.cat([feature, self.emb_norm(token_emb)], dim=-1))

    def vocab_heads(self) -> list[nn.Linear]:
        return [self.lm_head] if self.lm_head is not None else []

    def readout(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block output [..., H] -> (predicted normed feature ĥ [..., H], logits [..., V_d])."""
        hat = self.norm(out)
        return hat, self.project(hat, self.lm_head)

    # -- training ----------------------------------------------------------------------------------------------
    def forward_train(self, feats: Features, input_ids: torch.Tensor) -> TrainOutput:
        logits, hats = self.unroll(self.real_feature(feats.hidden), input_ids, self.unroll_steps)
        if not self.feature_weight:
            return TrainOutput(logits=logits)
        # Step j's ĥ at t is the base's real h_{t+j+1} (last layer), which exists for t < T-j-1.
        h = feats.hidden[LAST]  # [B, T, H]
        t = h.shape[1]
        per_step = torch.stack(
            [F.smooth_l1_loss(_wide(hats[:, : t - j - 1, j]), _wide(h[:, j + 1 :])) for j in range(hats.shape[2])
             if t - j - 1 > 0]
        )  # [steps]
        feature_loss = per_step.mean()
        return TrainOutput(
            logits=logits,
            aux_loss=self.feature_weight * feature_loss,
            aux_metrics={"feature_loss": feature_loss.detach(), "feature_loss_last": per_step[-1].detach()},
        )

    # -- sampling ----------------------------------------------------------------------------------------------
    def init_state(self, batch_size: int, max_len: int) -> dict[str, Any]:
        # what the native calls read, looked up once a decode (~10 module attribute reads, which twice a round would
        # cost a noticeable share of a CPU draft); kept on the drafter, not in the state, whose every value a CUDA graph
        # of the whole draft takes in (draft_graph.py)
        self._native_parts = self._parts()
        return super().init_state(batch_size, max_len)

    def entries(self, ctx: DraftContext, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The real entries in one native call where the engine has one and it is faster, else through the layers."""
        return ctx.feature_entries(self, self._native_parts, features, tokens, STORE, POSITION_OFFSET,
                                   otherwise=lambda: super(Prophet, self).entries(ctx, features, tokens))

    def greedy_chain(self, state, ctx: DraftContext, root: torch.Tensor, gamma: int,
                     top: int = 1) -> torch.Tensor | None:
        """The chain's `expand` calls as one native call (one row on the CPU, native layers attached), else None (and
        for a chain that fans out at its end, top > 1)."""
        return None if top > 1 else self.adaptive_chain(state, ctx, root, gamma, 0.0)

    def adaptive_chain(self, state, ctx: DraftContext, root: torch.Tensor, gamma: int,
                       stop: float) -> torch.Tensor | None:
        """The same native call, ended after its first token of top-1 probability < stop (stop 0: all γ)."""
        drafted = ctx.feature_chain(self, self._native_parts, state["root"], gamma, STORE, POSITION_OFFSET, stop)
        if drafted is None:
            return None
        tokens, hats = drafted  # [1, d], [1, d, H] (d = γ without a stop)
        state["feats"] = NodeTable.of(hats)  # nodes 0 .. d-1, as the chain's expand calls leave it
        return tokens

    def _parts(self) -> ChainParts:
        """What `step_input`, the blocks and `readout` are made of, for the native calls (native_chain.py)."""
        head = self.lm_head if self.lm_head is not None else (
            self.base.lm_head if self.draft_vocab is None else self.draft_vocab.head)
        return ChainParts(
            embed=self.base.embed_tokens.weight, emb_norm=self.emb_norm, fc=self.fc, blocks=self.blocks,
            norm=self.norm, head=head, vocab=None if self.draft_vocab is None else self.draft_vocab.tokens)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 for a loss: bf16/fp16 features are upcast, fp64 ones are left alone."""
    return x if x.element_size() >= 4 else x.float()
