"""ProphetNet-style feature-level predictor (in the spirit of EAGLE): a small decoder, built from the base's own
decoder-layer class, that predicts the base's next last-layer feature from the known features and tokens and
then keeps going on its OWN predicted features, one step at a time.

Entries and positions (training and sampling agree on both):
- real entry for base position t: fc([h_t ; emb(x_{t+1})]) at rotary position t; its output ĥ_{t+1} -> x_{t+2};
- one "sink" entry fc([0 ; emb(x_0)]) at position -1 before them: at sampling time the first committed slot
  has no feature before it, so training carries the same entry instead of pretending it is not there;
- chain step j ≥ 1 rooted at t: fc([ĥ_{t+j} ; emb(x_{t+j+1})]) at position t+j, attending to the real
  entries of positions ≤ t (and the sink) and to its own chain's earlier steps, never to later real entries.
Sampling lays the entry for (h_{s-1}, x_s) in slot s, so the root node's slot (the base's newest token) holds
the root entry (h_t, x_{t+1}) and every slot of a row is written (by `observe` or `expand`) before it is seen;
`observe` writes the root entry too, in the same pass as the newly committed ones.

With `fuse_layers` (EAGLE-3's feature fusion), the real h_t is not the last layer alone but a learnt mix of it and
the hidden states of earlier base layers: f_t = fuse([norm(h^{l_1}_t); …; h_t]), which starts as h_t exactly. The
chain steps still read the predictor's own ĥ, so fusion changes only what the real entries carry."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from specdec.base import LAST, Base, Features, cache_arg
from specdec.drafters.drafter import (ChainParts, DraftContext, Drafter, DraftVocab, NodeTable, TrainOutput,
                                      copy_lm_head, unroll_mask)

STORE = "prophet"  # the drafter-private KV store in the sampler's DraftContext
POSITION_OFFSET = -1  # slot s holds the entry of position s-1 (see the module docstring)


class Prophet(Drafter):
    aux_metric_names = ("feature_loss", "feature_loss_last")
    graph_draft = True

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

    def _run(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Blocks over x [B, n, H] at rotary positions pos [n], additive mask [n, W], appending to cache."""
        pos = pos[None]  # [1, n]
        rope = self.base.rotary_emb(x, pos)
        for block in self.blocks:
            out = block(
                x, attention_mask=mask[None, None], position_ids=pos, use_cache=True, **cache_arg(block, cache),
                position_embeddings=rope,
            )
            x = out[0] if isinstance(out, tuple) else out
        return x

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

    def unroll(self, h: torch.Tensor, input_ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `steps` steps of every chain, each step on the previous step's OWN predicted feature.
        h [B, T, H] real features (`real_feature`), input_ids [B, T] -> logits [B, T, steps, V] (step j at t predicts x_{t+j+2})
        and predicted features ĥ [B, T, steps, H] (step j at t predicts h_{t+j+1})."""
        b, t, hs = h.shape
        dev = h.device
        emb = self.base.embed_tokens(input_ids)  # [B, T, H]
        # emb(x_{t+k}) at every t, zero past the end (those chains' targets do not exist: masked by the trainer)
        padded = torch.cat([emb, emb.new_zeros(b, steps + 1, hs)], dim=1)  # [B, T+steps+1, H]

        def ahead(k: int) -> torch.Tensor:
            return padded[:, k : k + t]  # [B, T, H]

        # Step 0 over [sink, (h_0, x_1), …, (h_{T-1}, x_T)] at positions -1..T-1, causal.
        x0 = self.step_input(torch.cat([h.new_zeros(b, 1, hs), h], dim=1), torch.cat([emb[:, :1], ahead(1)], dim=1))
        mask = unroll_mask(t, 0, x0.dtype, dev)
        cache = DynamicCache()  # the keys of step 0 and of every later step, in that order
        out = self._run(x0, torch.arange(-1, t, device=dev), mask, cache)[:, 1:]  # [B, T, H] chain t, step 0
        hat, logit = self.readout(out)
        hats, logits = [hat], [logit]

        for j in range(1, steps):
            mask = unroll_mask(t, j, x0.dtype, dev)  # [T, T+1 + j·T]
            x = self.step_input(hat, ahead(j + 1))  # [B, T, H]: ĥ_{t+j} (own prediction) with x_{t+j+1}
            out = self._run(x, torch.arange(j, t + j, device=dev), mask, cache)
            hat, logit = self.readout(out)
            hats.append(hat)
            logits.append(logit)
        return torch.stack(logits, dim=2), torch.stack(hats, dim=2)

    # -- sampling ----------------------------------------------------------------------------------------------
    def init_state(self, batch_size: int, max_len: int) -> dict[str, Any]:
        h = torch.zeros(batch_size, self.base.hidden_size, device=self.base.device, dtype=self.base.dtype)
        # what the native calls read, looked up once a decode (~10 module attribute reads, which twice a round would
        # cost a noticeable share of a CPU draft); kept on the drafter, not in the state, whose every value a CUDA graph of the whole
        # draft takes in (draft_graph.py)
        self._native_parts = self._parts()
        # h: newest committed real feature per row (zero before the prompt); root: the root entry's block output
        # (set by observe); hats: the round's predicted ĥ per node
        return {"h": h, "root": None, "hats": NodeTable()}

    def observe(self, state, ctx: DraftContext, feats: Features, tokens, n_new, next_token) -> None:
        h = self.real_feature(feats.hidden)  # [B, n, H]
        b, n, _ = h.shape
        rows = torch.arange(b, device=h.device) if b > 1 else None
        # Slot s gets the real entry (h_{s-1}, x_s): the first new slot pairs with the previous call's newest h. One
        # entry more, at index n_new of each row, is the next round's root entry (h_t, x_{t+1}) with x_{t+1} =
        # next_token: computed in this pass over the blocks rather than in a depth-0 `expand` of its own, which
        # would read every block weight a second time for one token.
        prev = torch.cat([state["h"][:, None], h], dim=1)  # [B, n+1, H]
        toks = torch.cat([tokens, next_token[:, None]], dim=1)  # [B, n+1]
        if rows is not None:  # (one row has no padding: its n_new is n, where the cat put next_token)
            toks[rows, n_new] = next_token
        ctx.commit_layout(n + 1)  # the root's slot L_b + n_new_b is index n_new_b of row b
        out = ctx.feature_entries(  # [B, n+1, H]: one call where the engine has one and it is faster, else the blocks
            self, self._native_parts, prev, toks, STORE, POSITION_OFFSET,
            otherwise=lambda: ctx.run_layers(self.blocks, self.step_input(prev, self.base.embed_tokens(toks)), STORE,
                                             POSITION_OFFSET))
        if rows is None:  # one row: its newest feature and its root entry are the last (views, not index ops)
            state["h"], state["root"] = h[:, -1], out[:, -1:]
        else:
            state["h"] = h[rows, n_new - 1]  # [B, H]
            state["root"] = out[rows, n_new][:, None]  # [B, 1, H] the root entry's block output; read out by expand
        state["hats"] = NodeTable()  # a new round

    def expand(
        self, state, ctx: DraftContext, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
        nodes: torch.Tensor,
    ) -> torch.Tensor:
        if depth == 0:
            out = state["root"]  # [B, 1, H]: the root entry, run (and its slot written) by `observe`
        else:
            # the parents' predicted features with the nodes' tokens
            x = self.step_input(state["hats"].get(parents, ctx), self.base.embed_tokens(tokens))  # [B, N, H]
            out = ctx.run_layers(self.blocks, x, STORE, POSITION_OFFSET)
        hat, logits = self.readout(out)  # [B, N, H], [B, N, V_d]
        state["hats"].put(hat, nodes, ctx)
        return logits

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
        state["hats"] = NodeTable.of(hats)  # nodes 0 .. d-1, as the chain's expand calls leave it
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
