"""The CUDA engine: the eager engine's lean layers, with each small float32 product, each attention and each layer's
fused units run by the form measured fastest on this GPU (kernels.py, fused.py, layer.py: cuBLAS or Triton), the
forwards of a few tokens replayed from CUDA graphs (graphs.py) and a drafter's whole greedy round as one graph
(draft_graph.py), each where the config leaves it on."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from specdec.engines.config import EngineConfig
from specdec.engines.cuda import draft_graph, graphs
from specdec.engines.cuda import kernels as cuda_kernels
from specdec.engines.eager.engine import EagerEngine


class CudaEngine(EagerEngine):
    name = "cuda"

    def __init__(self, cfg: EngineConfig | None = None):
        super().__init__(cfg or EngineConfig(name="cuda"))
        self.graphs = self.cfg.cuda_graphs

    def key(self, greedy: bool) -> tuple:
        c = self.cfg
        return (self.name, c.lean, c.cuda_graphs, c.cuda_kernels, greedy)

    def installed(self, base: nn.Module, drafters: Sequence[nn.Module] = ()):
        if self.cfg.cuda_kernels == "stock":
            return super().installed(base, drafters)
        return cuda_kernels.measured(base, *drafters, fused=self.cfg.cuda_kernels == "measured")

    def run_layer(self, fast, hidden, rope, mask, cache):
        return fast.lean_forward(hidden, rope, mask, cache, cuda_kernels.units(fast))

    def graph_pool(self, ctx, store: str, fast: Sequence[nn.Module], x):
        return graphs.pool_for(ctx, store, fast, x)

    def draft_round(self, drafter, state, ctx, root, paths):
        if not (ctx.graphs and self.cfg.cuda_graph_draft and drafter.graph_draft):
            return None
        return draft_graph.draft(drafter, state, ctx, root, paths)
