"""What every feature-level drafter shares (the prophet, EAGLE-3): a small stack of layers that reads the base's feature
of position t with the embedding of x_{t+1}, predicts x_{t+2}, and keeps going on its OWN output, one step at a time.

A family states three things: `real_feature` (the base's hidden states -> the feature a real entry carries),
`step_input` (a feature and a token embedding -> the layers' input) and `readout` (the layers' output -> the next
step's feature and the draft logits); and its `layers`. This class holds the rest, once:

- Entries and positions (training and sampling agree on both): slot s holds the real entry (f_{s-1}, x_s) at rotary
  position s − 1 (POSITION_OFFSET), so the root node's slot (the base's newest token) holds the root entry
  (f_t, x_{t+1}); slot 0 is a "sink" entry (0, x_0), which training carries too, so that both see the same keys.
- Training (`unroll`): k steps of every chain at once; step j at t reads its own step j − 1 output with the data's
  token x_{t+j+1}, attends to the real entries ≤ t and to its chain's earlier steps, never to later real entries.
- Sampling: `observe` writes the newly committed real entries and, in the same pass, the next round's root entry (a
  depth-0 `expand` of its own would read every layer weight a second time for one token); `expand` reads out the root
  entry at depth 0 and, deeper, runs each parent's predicted feature with the node's token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from specdec.base import Features, cache_arg
from specdec.drafters.drafter import DraftContext, Drafter, NodeTable, unroll_mask

POSITION_OFFSET = -1  # slot s holds the entry of position s − 1


class FeatureDrafter(Drafter):
    graph_draft = True
    store: str  # the drafter-private KV store in the sampler's DraftContext
    layers: nn.ModuleList  # run over step_input's output, in order

    # -- what a family states ------------------------------------------------------------------------------------
    def real_feature(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The base's hidden states {layer: [..., H]} -> the feature a real entry carries [..., H]."""
        raise NotImplementedError

    def step_input(self, feature: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """The feature of position t [..., H] (real or predicted) and emb(x_{t+1}) [..., H] -> the layers' input."""
        raise NotImplementedError

    def readout(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers' output [..., H] -> (the next step's feature [..., H], draft logits [..., V_d])."""
        raise NotImplementedError

    # -- training ------------------------------------------------------------------------------------------------
    def _run(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """The layers over x [B, n, ·] at rotary positions pos [n], additive mask [n, W], appending to cache."""
        pos = pos[None]  # [1, n]
        rope = self.base.rotary_emb(x, pos)  # (reads only x's dtype and device)
        for layer in self.layers:
            out = layer(x, attention_mask=mask[None, None], position_ids=pos, position_embeddings=rope,
                        use_cache=True, **cache_arg(layer, cache))
            x = out[0] if isinstance(out, tuple) else out
        return x

    def unroll(self, feature: torch.Tensor, input_ids: torch.Tensor, steps: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`steps` steps of every chain, each after the first on the previous step's own feature. feature [B, T, H]
        (`real_feature`), input_ids [B, T] -> logits [B, T, steps, V_d] (step j at t predicts x_{t+j+2}) and each
        step's feature [B, T, steps, H] (step j at t stands for position t + j + 1)."""
        b, t, hs = feature.shape
        dev = feature.device
        emb = self.base.embed_tokens(input_ids)  # [B, T, H]
        # emb(x_{t+k}) at every t, zero past the end (those chains' targets do not exist: masked by the trainer)
        padded = torch.cat([emb, emb.new_zeros(b, steps + 1, hs)], dim=1)  # [B, T+steps+1, H]

        def ahead(k: int) -> torch.Tensor:
            return padded[:, k : k + t]  # [B, T, H]

        # step 0 over [sink, (f_0, x_1), …, (f_{T-1}, x_T)] at positions -1..T-1, causal
        x0 = self.step_input(torch.cat([feature.new_zeros(b, 1, hs), feature], dim=1),
                             torch.cat([emb[:, :1], ahead(1)], dim=1))
        cache = DynamicCache()  # step 0's keys, then each later step's, in that order
        out = self._run(x0, torch.arange(-1, t, device=dev), unroll_mask(t, 0, x0.dtype, dev), cache)[:, 1:]
        feature, logit = self.readout(out)  # [B, T, H], [B, T, V_d]
        features, logits = [feature], [logit]
        for j in range(1, steps):
            x = self.step_input(feature, ahead(j + 1))  # the chain's own feature with x_{t+j+1}
            out = self._run(x, torch.arange(j, t + j, device=dev), unroll_mask(t, j, x0.dtype, dev), cache)
            feature, logit = self.readout(out)
            features.append(feature)
            logits.append(logit)
        return torch.stack(logits, dim=2), torch.stack(features, dim=2)

    # -- sampling ------------------------------------------------------------------------------------------------
    def init_state(self, batch_size: int, max_len: int) -> dict[str, Any]:
        f = torch.zeros(batch_size, self.base.hidden_size, device=self.base.device, dtype=self.base.dtype)
        # f: newest committed real feature per row (zero before the prompt: the sink); root: the root entry's layer
        # output (set by observe); feats: the round's feature per node (what each child reads)
        return {"f": f, "root": None, "feats": NodeTable()}

    def entries(self, ctx: DraftContext, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The real entries (features [B, n, H], tokens [B, n]) through the layers, observe's layout -> [B, n, H]."""
        return ctx.run_layers(self.layers, self.step_input(features, self.base.embed_tokens(tokens)), self.store,
                              POSITION_OFFSET)

    def observe(self, state, ctx: DraftContext, feats: Features, tokens, n_new, next_token) -> None:
        f = self.real_feature(feats.hidden)  # [B, n, H]
        b, n, _ = f.shape
        rows = torch.arange(b, device=f.device) if b > 1 else None
        # slot s gets (f_{s-1}, x_s): the first new slot pairs with the previous call's newest feature; one entry
        # more, at index n_new of each row, is the next round's root entry (f_t, x_{t+1}), x_{t+1} = next_token
        prev = torch.cat([state["f"][:, None], f], dim=1)  # [B, n+1, H]
        toks = torch.cat([tokens, next_token[:, None]], dim=1)  # [B, n+1]
        if rows is not None:  # (one row has no padding: its n_new is n, where the cat put next_token)
            toks[rows, n_new] = next_token
        ctx.commit_layout(n + 1)  # the root's slot L_b + n_new_b is index n_new_b of row b
        out = self.entries(ctx, prev, toks)  # [B, n+1, H]
        if rows is None:  # one row: its newest feature and its root entry are the last (views, not index ops)
            state["f"], state["root"] = f[:, -1], out[:, -1:]
        else:
            state["f"] = f[rows, n_new - 1]  # [B, H]
            state["root"] = out[rows, n_new][:, None]  # [B, 1, H]
        state["feats"] = NodeTable()  # a new round

    def expand(self, state, ctx: DraftContext, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
               nodes: torch.Tensor) -> torch.Tensor:
        if depth == 0:
            out = state["root"]  # [B, 1, H]: run (and its slot written) by `observe`
        else:  # the parents' features with the nodes' tokens
            x = self.step_input(state["feats"].get(parents, ctx), self.base.embed_tokens(tokens))
            out = ctx.run_layers(self.layers, x, self.store, POSITION_OFFSET)
        feature, logits = self.readout(out)  # [B, N, H], [B, N, V_d]
        state["feats"].put(feature, nodes, ctx)
        return logits
