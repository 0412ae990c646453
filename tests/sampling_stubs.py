"""Stub drafters and tiny bases shared by the sampler tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.base import Base, Features
from specdec.drafters.drafter import Drafter


def micro_base(vocab: int = 6, seed: int = 0, sharpness: float = 40.0) -> Base:
    """A one-layer Llama with a tiny vocabulary (exact targets are enumerable), lm_head scaled so p is peaked."""
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=64, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
        model.lm_head.weight.data *= sharpness
    return Base(model, None, f"micro-v{vocab}")


class Oracle(Drafter):
    """Knows the base's greedy continuation (a no-cache forward per node): its top-1 child is right at depths
    < right_for (one for all rows, or one per row) and wrong (argmax + 1) deeper. Ranks below 1 are fixed pseudo-random tokens."""

    reads_logits = True  # records the verify logits it is handed

    def __init__(self, base: Base, right_for: int | list[int] = 1 << 30):
        super().__init__(base)
        self.right_for = right_for
        self.seen_logits: list[torch.Tensor] = []  # verify logits handed to observe, per round [B, n, V]
        self.seen_tokens: list[torch.Tensor] = []
        self.seen_n_new: list[torch.Tensor] = []

    def init_state(self, batch_size: int, max_len: int):
        return {"hist": [[] for _ in range(batch_size)], "paths": {}}

    def observe(self, state, ctx, feats: Features, tokens, n_new, next_token) -> None:
        for b, (row, k) in enumerate(zip(tokens.tolist(), n_new.tolist())):
            state["hist"][b] += row[:k]
        state["paths"] = {0: next_token[:, None]}
        self.seen_logits.append(feats.logits)
        self.seen_tokens.append(tokens)
        self.seen_n_new.append(n_new)

    def expand(self, state, ctx, tokens, parents, depth, nodes):
        paths = state["paths"]
        if depth > 0:
            for i, (node, par) in enumerate(zip(nodes.tolist(), parents.tolist())):
                paths[node] = torch.cat([paths[par], tokens[:, i : i + 1]], 1)
        v = self.base.vocab_size
        gen = torch.Generator().manual_seed(depth)
        out = []
        for b, hist in enumerate(state["hist"]):
            ctx_ids = torch.stack([torch.tensor(hist + paths[n][b].tolist()) for n in nodes.tolist()])
            best = self.base(ctx_ids.to(self.base.device))[:, -1].argmax(-1).cpu()  # [F]
            right_for = self.right_for[b] if isinstance(self.right_for, list) else self.right_for
            want = best if depth < right_for else (best + 1) % v
            noise = torch.rand(len(best), v, generator=gen)
            out.append(noise + 10 * torch.nn.functional.one_hot(want, v))
        return torch.stack(out).to(self.base.device)  # [B, F, V]


class Table(Drafter):
    """A fixed bigram-like draft: logits depend on the node's own token only (q differs from p)."""

    def __init__(self, base: Base, seed: int = 1, scale: float = 2.0):
        super().__init__(base)
        g = torch.Generator().manual_seed(seed)
        self.table = (torch.randn(base.vocab_size, base.vocab_size, generator=g) * scale).to(base.device)

    def init_state(self, batch_size: int, max_len: int):
        return {}

    def observe(self, state, ctx, feats, tokens, n_new, next_token) -> None:
        pass

    def expand(self, state, ctx, tokens, parents, depth, nodes):
        return self.table[tokens]  # [B, N, V]
