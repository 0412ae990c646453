"""How a forward runs fast, behind the one interface the algorithm talks to (specdec.sampling.engine.Engine).

    engine = build(EngineConfig(), base.device)      # auto: the CPU engine on a CPU, the CUDA engine on a GPU
    generate(base, prompts, drafter, SamplerConfig(), engine=engine)

eager/ runs PyTorch ops (the lean decoder layers), cpu/ native C products and layers chosen by measurement, cuda/
CUDA graphs and Triton kernels chosen by measurement (docs/engines.md)."""

from __future__ import annotations

import torch

from specdec.engines.config import EngineConfig
from specdec.sampling.engine import Engine


def build(cfg: EngineConfig | None = None, device: torch.device | str = "cpu") -> Engine:
    """The engine `cfg` names for a base on `device`."""
    # (imported here: every engine module imports this package first, so it cannot import them at its top)
    from specdec.engines.cpu.engine import CpuEngine
    from specdec.engines.cuda.engine import CudaEngine
    from specdec.engines.eager.engine import EagerEngine

    cfg = cfg or EngineConfig()
    kind = torch.device(device).type
    name = cfg.name
    if name == "auto":
        name = "cuda" if kind == "cuda" else "cpu" if kind == "cpu" and cfg.cpu_kernels != "stock" else "eager"
    if name in ("cpu", "cuda") and name != kind:
        raise ValueError(f"engine: {name} engine for a base on {kind}; use engine=auto or engine=eager")
    if name == "cpu":
        return CpuEngine(cfg)
    if name == "cuda":
        return CudaEngine(cfg)
    return EagerEngine(cfg)


__all__ = ["Engine", "EngineConfig", "build"]
