"""The eager engine: PyTorch ops only. A Llama-style decoder layer runs as its lean form (lean.py: the same math in
fewer, fused ops, taken only where it reproduces the layer's own forward); any other layer, and every layer with
`lean` off or autograd on, runs its own HF forward. Nothing is measured or recorded."""

from __future__ import annotations

import torch
from torch import nn

from specdec.engines.config import EngineConfig
from specdec.engines.eager.lean import LeanLayer, lean
from specdec.sampling.engine import Engine


class EagerEngine(Engine):
    name = "eager"

    def __init__(self, cfg: EngineConfig | None = None):
        super().__init__()
        self.cfg = cfg or EngineConfig(name="eager")

    def key(self, greedy: bool) -> tuple:
        return (self.name, self.cfg.lean, greedy)

    def paths(self, base, drafters=()):
        layers = "the lean layers (eager/lean.py) where a layer is Llama-shaped" if self.cfg.lean else None
        return super().paths(base, drafters) | ({"layers": layers} if layers else {})

    def fast_layer(self, layer: nn.Module) -> LeanLayer | None:
        if not self.cfg.lean or torch.is_grad_enabled():  # (the lean path is for decoding)
            return None
        return lean(layer)
