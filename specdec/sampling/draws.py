"""The uniforms a sampled decode draws: one U(0,1) per row per draw, each row from its own generator where it has one,
so that a row's samples do not depend on its batch."""

from __future__ import annotations

from typing import Sequence

import torch


def row_uniforms(generators: Sequence[torch.Generator], device: torch.device) -> torch.Tensor:
    """One U(0,1) per generator [len], each drawn on its generator's own device, then moved to `device`: a CPU
    generator seeds a CUDA decode too, and gives it the same uniforms as a CPU decode."""
    return torch.cat([torch.rand(1, generator=g, device=g.device) for g in generators]).to(device)


class RowUniform:
    """Draws one U(0,1) per row. With one generator per row, a row's stream is independent of the batch."""

    def __init__(self, generator: torch.Generator | list[torch.Generator] | None, batch: int, device: torch.device):
        self.generator, self.batch, self.device = generator, batch, device

    def keep_rows(self, keep: list[int]) -> None:
        """Only the rows at batch positions `keep` go on (with one generator per row, each keeps its own)."""
        if isinstance(self.generator, list):
            self.generator = [self.generator[i] for i in keep]
        self.batch = len(keep)

    def __call__(self) -> torch.Tensor:
        if isinstance(self.generator, list):
            return row_uniforms(self.generator, self.device)
        if self.generator is None:
            return torch.rand(self.batch, device=self.device)
        # drawn where the generator lives, as row_uniforms does
        return torch.rand(self.batch, generator=self.generator, device=self.generator.device).to(self.device)
