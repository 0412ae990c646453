"""The interface between the algorithm and whatever runs its forwards fast.

The sampler (decode, context, trees, cost) asks an `Engine` how to run a stack of decoder layers, the verify's argmax,
a drafter's whole greedy chain or a whole recorded draft; every method here is the reference answer: each decoder
layer's own HF forward, PyTorch's stock kernels, nothing recorded, nothing measured. The engines in specdec/engines/
(eager, cpu, cuda) override what they speed up, and return None where they do not take a call, so the algorithm then
runs the reference way. The algorithm imports no engine: a caller builds one (`specdec.engines.build`) and passes it.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn


class Engine:
    name = "reference"

    def __init__(self) -> None:
        self.graphs = False  # whether forwards of a few tokens are replayed from recorded graphs

    # -- a call ----------------------------------------------------------------------------------
    def installed(self, base: nn.Module, drafters: Sequence[nn.Module] = ()) -> ContextManager:
        """Within the block, the base's and the drafters' modules run the engine's fast forms (patched products,
        native layers); on exit they are as before."""
        return nullcontext()

    def paths(self, base: nn.Module, drafters: Sequence[nn.Module] = ()) -> dict[str, str]:
        """What runs each kind of forward under this engine, {forward kind: path}, as a report's header names it (the
        CPU engine's depend on what it measured on this machine, so they are read after a decode has measured them)."""
        return {"layers": "each layer's own HF forward", "products": "PyTorch's F.linear",
                "verify argmax": "the float32 logits' argmax"}

    def key(self, greedy: bool) -> tuple:
        """What distinguishes this engine's verify cost from another's (the verify-cost curve is cached per key)."""
        return (self.name, greedy)

    # -- layers ----------------------------------------------------------------------------------
    def fast_layer(self, layer: nn.Module) -> nn.Module | None:
        """The engine's form of one HF decoder layer (called as form(hidden, rope, mask, cache) with the rotary in
        `rotary.lean_rope` form), or None: the layer runs its own HF forward."""
        return None

    def run_layer(self, fast: nn.Module, hidden: torch.Tensor, rope, mask: torch.Tensor | None, cache
                  ) -> torch.Tensor:
        """One layer's fast form over hidden [B, n, H] -> [B, n, H]."""
        return fast(hidden, rope, mask, cache)

    def run_stack(self, fast: Sequence[nn.Module], hidden: torch.Tensor, rope, mask: torch.Tensor | None, cache,
                  keep: Sequence[int], norm: nn.Module | None) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
        """A whole stack of fast forms in one call -> (hidden [B, n, H], {i: the input of layer i} for i in keep), or
        None: the context runs them one by one."""
        return None

    def graph_pool(self, ctx, store: str, fast: Sequence[nn.Module], x: torch.Tensor):
        """The recorded-graph pool that runs `fast` over x on `store` in ctx's current layout, or None (eager)."""
        return None

    # -- the verify's argmax ---------------------------------------------------------------------
    def greedy_head(self, lm_head: nn.Linear):
        """An object with `wins(rows) -> bool` and `argmax(hidden [B, n, H]) -> [B, n]` that gives the lm_head's
        exact argmax without its float32 logits where that is faster, or None: the logits' argmax."""
        return None

    # -- drafting --------------------------------------------------------------------------------
    def draft_round(self, drafter, state: Any, ctx, root: torch.Tensor, paths: list[list[int]]):
        """A whole greedy round replayed from one recorded graph (a `trees.Round`), or None."""
        return None

    def feature_chain(self, drafter: nn.Module, parts, ctx, root: torch.Tensor, gamma: int, store: str,
                      position_offset: int, stop: float = 0.0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A feature drafter's greedy chain (drafters.drafter.ChainParts) in one call -> (tokens [1, γ], ĥ [1, γ, H]),
        or None; with stop > 0 ended after its first token of top-1 probability < stop ([1, d], [1, d, H], d ≤ γ)."""
        return None

    def feature_entries(self, drafter: nn.Module, parts, ctx, features: torch.Tensor, tokens: torch.Tensor,
                        store: str, position_offset: int, otherwise: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A feature drafter's real entries over its blocks: otherwise() here, one call where the engine has one."""
        return otherwise()

    def head_chain(self, drafter: nn.Module, heads: list, embed: torch.Tensor, vocab: torch.Tensor | None,
                   h: torch.Tensor, root: torch.Tensor, top: int = 1) -> torch.Tensor | None:
        """Hydra's chain of heads (drafters.drafter.HeadParts) in one call -> tokens [1, γ − 1 + top], or None."""
        return None


REFERENCE = Engine()  # stateless: the default of every function that takes an engine
