"""Copy-aware Hydra heads: Hydra heads that also read what n-gram lookup would propose.

Nearly half the tokens of the base's answers to HumanEval continue an n-gram that occurs earlier in the prompt or
the answer (the signature and docstring it repeats, names, repeated lines), and there lookup's proposal is right at
77 % of the positions where it has one; a Hydra head, which sees only the base's newest hidden state and the tokens
on its path, drafts those copies worse than the rest (experiments/pages/where_drafts_miss.md). Lookup alone cannot
tell a right copy from a wrong one, nor draft where nothing matches. So head k here reads, beside h_t and the path
tokens x_{t+1}..x_{t+k}, the token lookup proposes for x_{t+k+1} from everything before it (`ngram_match` over the
context and the path: 2-3-grams) and the length of the match (none, 2, 3), and learns when to copy it and when to
draft its own. The base's tied embeddings make a copy easy to learn: the proposal's embedding, passed through,
scores its own token highest under the lm_head.

Training computes the proposals of every position of a block from the block's tokens (`lookup_proposals`, the same
rule as `ngram_match`); sampling computes them from the row's committed tokens and the node's path. The proposals
are inputs, never drafts of their own: the sampler verifies whatever the heads draft, so decoding stays lossless."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specdec.base import LAST, Base, Features
from specdec.drafters.drafter import DraftContext, Drafter, TrainOutput
from specdec.drafters.hydra import Hydra, HydraHead
from specdec.ngram import MAX_NGRAM, MIN_NGRAM, lookup_proposals, ngram_match


class CopyHydra(Hydra):
    """Hydra heads whose head k also reads lookup's proposal for the token it drafts and the match's length (0: no
    match, else its n)."""

    graph_draft = False  # expand reads the committed tokens on the host (lookup)
    # depth by depth through `expand`: Hydra's whole chain of heads (one native call) has no lookup input
    greedy_chain = Drafter.greedy_chain

    def __init__(self, base: Base, num_heads: int = 1, num_layers: int = 1, own_lm_head: bool = False,
                 draft_vocab_size: int | None = None):
        super().__init__(base, num_heads=num_heads, num_layers=num_layers, own_lm_head=own_lm_head,
                         draft_vocab_size=draft_vocab_size)
        h = base.hidden_size
        norm_cls, eps = type(base.norm), base.config.rms_norm_eps
        # head k reads k path tokens and the proposal: k + 1 embeddings (a missing proposal is a zero vector)
        self.heads = nn.ModuleList(HydraHead(h, k + 1, num_layers, norm_cls(h, eps=eps))
                                   for k in range(1, num_heads + 1))
        self.match = nn.Embedding(MAX_NGRAM + 1, h)  # the match's n (0: none) as a bias on each head's input
        nn.init.zeros_(self.match.weight)
        self.to(device=base.device, dtype=base.dtype)

    def _head(self, k: int, h: torch.Tensor, path: torch.Tensor, proposal: torch.Tensor, n: torch.Tensor
              ) -> torch.Tensor:
        """Head k (0-based) on h [..., H], its path's embeddings [..., k+1, H] and the proposal [...] with its n
        [...] -> [..., H]."""
        emb = self.base.embed_tokens(proposal) * (n > 0)[..., None]  # [..., H], zero where nothing matched
        return self.heads[k](h + self.match(n), torch.cat([path, emb[..., None, :]], dim=-2))

    def forward_train(self, feats: Features, input_ids: torch.Tensor) -> TrainOutput:
        h = feats.hidden[LAST]  # [B, T, H]
        b, t, _ = h.shape
        k_max = len(self.heads)
        ahead = self.ahead(input_ids)  # [B, T, K, H]
        proposal, n = lookup_proposals(input_ids)  # [B, T]: for position p + 1 from tokens ≤ p
        pad = lambda x: torch.cat([x, x.new_zeros(b, k_max + 1)], dim=1)  # noqa: E731 (past the end: no match)
        proposal, n = pad(proposal), pad(n)  # [B, T+K+1]
        # head k (0-based) at t reads x_{t+1}..x_{t+k+1} and drafts x_{t+k+2}: lookup's proposal for it comes from the
        # tokens up to t+k+1
        logits = [self.head_logits(self._head(k, h, ahead[:, :, : k + 1], proposal[:, k + 1 : k + 1 + t],
                                              n[:, k + 1 : k + 1 + t]), k)
                  for k in range(k_max)]
        return TrainOutput(logits=torch.stack(logits, dim=2))  # [B, T, K, V]

    # -- sampling ----------------------------------------------------------------------------
    def init_state(self, batch_size: int, max_len: int) -> dict[str, Any]:
        return super().init_state(batch_size, max_len) | {"history": [[] for _ in range(batch_size)]}

    def observe(self, state, ctx: DraftContext, feats: Features, tokens, n_new, next_token) -> None:
        super().observe(state, ctx, feats, tokens, n_new, next_token)
        for row, (toks, n) in enumerate(zip(tokens.tolist(), n_new.tolist())):
            state["history"][row] += toks[:n]  # the committed tokens (the root joins at the next observe)

    def expand(self, state, ctx: DraftContext, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
               nodes: torch.Tensor) -> torch.Tensor:
        b, n = tokens.shape
        paths = self.node_paths(state, ctx, tokens, parents, depth, nodes)  # [B, N, K] root first
        # lookup over each row's committed tokens and the node's path (root included)
        found = [[ngram_match(state["history"][row] + path[: depth + 1], 1, MIN_NGRAM, MAX_NGRAM)
                  for path in paths[row].tolist()] for row in range(b)]
        proposal = torch.tensor([[p[0] if p else 0 for p, _ in r] for r in found], device=tokens.device)  # [B, N]
        match = torch.tensor([[m for _, m in r] for r in found], device=tokens.device)  # [B, N]
        emb = self.base.embed_tokens(paths[:, :, : depth + 1])  # [B, N, d+1, H]
        h = state["h"][:, None].expand(-1, n, -1)  # [B, N, H]
        return self.head_logits(self._head(depth, h, emb, proposal, match), depth)  # [B, N, V_d]
