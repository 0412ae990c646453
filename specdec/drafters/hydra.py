"""Hydra heads (Ankner et al. 2024): Medusa heads made sequentially dependent. Head k reads the base's last
hidden state h_t AND the embeddings of the k tokens t+1..t+k that precede the one it predicts (t+k+1): in
training the data tokens (teacher-forced), in sampling the root and the drafted tokens on the node's path."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specdec.base import LAST, Base, Features
from specdec.drafters.drafter import (
    DraftContext,
    Drafter,
    DraftVocab,
    HeadParts,
    NodeTable,
    TrainOutput,
    copy_lm_head,
    newest,
)
from specdec.drafters.medusa import ResBlock


class HydraHead(nn.Module):
    """[h_t ; norm(e_{t+1}) ; … ; norm(e_{t+k})] -> in_proj -> residual SiLU blocks -> [H].

    in_proj starts as [I, 0, …, 0] and the blocks as the identity, so a fresh head is exactly the base's own
    head on h_t (a fresh Medusa head); the token columns still get gradient at once (their inputs are not 0).
    The embeddings are RMS-normalised first: raw they are ~15x smaller than the normed features (SmolLM2: RMS
    0.14 vs 2.2) and their columns would learn that much slower."""

    def __init__(self, hidden_size: int, num_tokens: int, num_layers: int, emb_norm: nn.Module):
        super().__init__()
        h = hidden_size
        self.emb_norm = emb_norm
        self.in_proj = nn.Linear((num_tokens + 1) * h, h)
        with torch.no_grad():
            self.in_proj.weight.zero_()
            self.in_proj.weight[:, :h].copy_(torch.eye(h))
            self.in_proj.bias.zero_()
        self.blocks = nn.Sequential(*(ResBlock(h) for _ in range(num_layers)))

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """h [..., H], emb [..., k, H] (embeddings of tokens t+1..t+k) -> [..., H]."""
        return self.blocks(self.in_proj(torch.cat([h, self.emb_norm(emb).flatten(-2)], dim=-1)))


class Hydra(Drafter):
    graph_draft = True
    runs_layers = False

    def __init__(self, base: Base, num_heads: int = 4, num_layers: int = 1, own_lm_head: bool = False,
                 draft_vocab_size: int | None = None):
        super().__init__(base, num_heads=num_heads, num_layers=num_layers, own_lm_head=own_lm_head,
                         draft_vocab_size=draft_vocab_size)
        h = base.hidden_size
        # Head k (1-based) conditions on k tokens; fresh modules per head (never [HydraHead(...)] * K). The
        # embedding norm is the base's own norm class, with its own trainable weight per head.
        norm_cls, eps = type(base.norm), base.config.rms_norm_eps
        self.heads = nn.ModuleList(
            HydraHead(h, k, num_layers, norm_cls(h, eps=eps)) for k in range(1, num_heads + 1)
        )
        self.draft_vocab = DraftVocab(base, draft_vocab_size) if draft_vocab_size else None
        self.lm_heads = (nn.ModuleList(copy_lm_head(base, draft_vocab_size) for _ in range(num_heads))
                         if own_lm_head else None)
        self.to(device=base.device, dtype=base.dtype)
        self.target_offsets = list(range(1, num_heads + 1))
        self.head_names = [f"head{k}" for k in range(1, num_heads + 1)]
        self.max_depth = num_heads
        self._chain_parts: dict[int, list[HeadParts] | None] = {}  # γ -> what `greedy_chain` runs

    def vocab_heads(self) -> list[nn.Linear]:
        return list(self.lm_heads or [])

    def head_logits(self, z: torch.Tensor, k: int) -> torch.Tensor:
        """z [..., H] of head k (0-based) -> logits [..., V_d]."""
        return self.project(z, self.lm_heads[k] if self.lm_heads is not None else None)

    def ahead(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of x_{t+1}..x_{t+K} at every t of input_ids [B, T] -> [B, T, K, H]; past the end of the
        sequence a zero vector (those entries' targets do not exist either, so the training module masks them)."""
        b, t = input_ids.shape
        k_max = len(self.heads)
        emb = self.base.embed_tokens(input_ids)  # [B, T, H]
        emb = torch.cat([emb, emb.new_zeros(b, k_max, emb.shape[-1])], dim=1)  # [B, T+K, H]
        return torch.stack([emb[:, k : k + t] for k in range(1, k_max + 1)], dim=2)  # [B, T, K, H]

    def forward_train(self, feats: Features, input_ids: torch.Tensor) -> TrainOutput:
        h = feats.hidden[LAST]  # [B, T, H]
        ahead = self.ahead(input_ids)  # [B, T, K, H]
        logits = [self.head_logits(head(h, ahead[:, :, : k + 1]), k) for k, head in enumerate(self.heads)]
        return TrainOutput(logits=torch.stack(logits, dim=2))  # [B, T, K, V]

    # -- sampling: head d+1 expands a depth-d node from h_t and the d+1 tokens on its path (root first) -------
    def init_state(self, batch_size: int, max_len: int) -> dict[str, Any]:
        return {"h": None, "paths": NodeTable()}

    def observe(self, state, ctx: DraftContext, feats: Features, tokens, n_new, next_token) -> None:
        state["h"] = newest(feats.hidden[LAST], n_new)  # [B, H] newest committed position
        state["paths"] = NodeTable()  # a new round

    def expand(
        self, state, ctx: DraftContext, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
        nodes: torch.Tensor,
    ) -> torch.Tensor:
        paths = self.node_paths(state, ctx, tokens, parents, depth, nodes)  # [B, N, K]
        emb = self.base.embed_tokens(paths[:, :, : depth + 1])  # [B, N, d+1, H]
        h = state["h"][:, None].expand(-1, tokens.shape[1], -1)  # [B, N, H]
        return self.head_logits(self.heads[depth](h, emb), depth)  # [B, N, V_d]

    def node_paths(self, state, ctx: DraftContext, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
                   nodes: torch.Tensor) -> torch.Tensor:
        """The path tokens of the frontier nodes [B, N, K] (root first; columns past depth unused): each parent's
        path and the node's own token tokens [B, N], kept for the next depth's children."""
        if depth >= len(self.heads):
            raise ValueError(f"{type(self).__name__} with {len(self.heads)} heads drafts at most depth "
                             f"{len(self.heads)}")
        b, n = tokens.shape
        if depth == 0:
            paths = tokens.new_zeros(b, n, len(self.heads))
        else:
            paths = state["paths"].get(parents, ctx).clone()  # each parent's path
        paths[:, :, depth] = tokens
        state["paths"].put(paths, nodes, ctx)
        return paths

    def greedy_chain(self, state, ctx: DraftContext, root: torch.Tensor, gamma: int,
                     top: int = 1) -> torch.Tensor | None:
        """The chain's `expand` calls (head d on the root and the d tokens drafted before) as one native call (one row
        on the CPU, SiLU blocks), else None. Its `paths` are left empty: nothing reads them before the next `observe`
        (they cost ~5 ops a round to make, a noticeable share of a CPU round)."""
        parts = self._chain_parts.get(gamma, False)
        if parts is False:  # (the modules a chain reads do not change: found once per length)
            silu = all(type(block.act) is nn.SiLU for head in self.heads[:gamma] for block in head.blocks)
            shared = self.base.lm_head if self.draft_vocab is None else self.draft_vocab.head
            parts = self._chain_parts[gamma] = [
                HeadParts(head.emb_norm, head.in_proj, [block.linear for block in head.blocks],
                                       self.lm_heads[k] if self.lm_heads is not None else shared)
                for k, head in enumerate(self.heads[:gamma])] if silu else None
        if parts is None:
            return None
        vocab = None if self.draft_vocab is None else self.draft_vocab.tokens
        tokens = ctx.head_chain(self, parts, self.base.embed_tokens.weight, vocab, state["h"], root, top)
        if tokens is not None:
            state["paths"] = NodeTable()
        return tokens
