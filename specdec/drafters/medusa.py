"""Medusa heads (Cai et al. 2024): K heads on the base's last hidden state h_t; head k predicts token t+k+1."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specdec.base import LAST, Base, Features
from specdec.drafters.drafter import DraftContext, Drafter, DraftVocab, TrainOutput, copy_lm_head, newest


class ResBlock(nn.Module):
    """x + SiLU(W x + b), zero-initialised so a fresh head is the identity (it starts as the base's own head)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class Medusa(Drafter):
    graph_draft = True
    runs_layers = False

    def __init__(self, base: Base, num_heads: int = 4, num_layers: int = 1, own_lm_head: bool = False,
                 draft_vocab_size: int | None = None):
        super().__init__(base, num_heads=num_heads, num_layers=num_layers, own_lm_head=own_lm_head,
                         draft_vocab_size=draft_vocab_size)
        h = base.hidden_size
        self.draft_vocab = DraftVocab(base, draft_vocab_size) if draft_vocab_size else None
        # A fresh ResBlock per (head, layer): never [ResBlock(h)] * n, which would share one module n times.
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResBlock(h) for _ in range(num_layers))) for _ in range(num_heads)
        )
        # Own projections are trainable copies of the base lm_head; otherwise the base's is shared, frozen.
        self.lm_heads = (nn.ModuleList(copy_lm_head(base, draft_vocab_size) for _ in range(num_heads))
                         if own_lm_head else None)
        self.target_offsets = list(range(1, num_heads + 1))
        self.head_names = [f"head{k}" for k in range(1, num_heads + 1)]
        self.max_depth = num_heads

    def vocab_heads(self) -> list[nn.Linear]:
        return list(self.lm_heads or [])

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> [..., K, V_d]: every head's logits (V_d = V unless a draft vocab is set)."""
        z = torch.stack([head(h) for head in self.heads], dim=-2)  # [..., K, H]
        if self.lm_heads is not None:
            return torch.stack([lm(z[..., k, :]) for k, lm in enumerate(self.lm_heads)], dim=-2)
        return self.project(z)

    def forward_train(self, feats: Features, input_ids: torch.Tensor) -> TrainOutput:
        return TrainOutput(logits=self.head_logits(feats.hidden[LAST]))  # [B, T, K, V]

    # -- sampling: the heads read only h_t, so every node at depth d gets head d+1's logits ------------------
    def init_state(self, batch_size: int, max_len: int) -> dict[str, Any]:
        return {"logits": None}

    def observe(self, state, ctx: DraftContext, feats: Features, tokens, n_new, next_token) -> None:
        state["logits"] = self.head_logits(newest(feats.hidden[LAST], n_new))  # [B, K, V_d] at the newest position

    def expand(self, state, ctx: DraftContext, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
               nodes: torch.Tensor) -> torch.Tensor:
        logits = state["logits"][:, depth]  # [B, V_d]
        return logits[:, None].expand(-1, tokens.shape[1], -1)  # [B, N, V_d]
