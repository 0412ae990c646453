"""A training loader whose order depends only on (seed, epoch) and that can restart mid-epoch, so a run resumed from
a checkpoint sees exactly the batches the uninterrupted run would have seen (Lightning restores the model, the
optimizer, the scheduler and the loop counters, but replays a plain shuffled DataLoader from its first batch)."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class ResumableSampler(Sampler[int]):
    """Epoch e visits randperm(n) drawn from seed + e. `resume(k)` makes the next pass skip its first k samples."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.epoch, self._skip = 0, 0

    def set_epoch(self, epoch: int) -> None:  # called by Lightning at every epoch start (restored on resume)
        self.epoch = epoch

    def resume(self, samples_done: int) -> None:
        self._skip = samples_done

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        skip, self._skip = self._skip, 0
        return iter(order[skip:].tolist())

    def __len__(self) -> int:
        return self.n - self._skip


def train_loader(dataset: Dataset, batch_size: int, seed: int, num_workers: int, trainer=None) -> DataLoader:
    """Shuffled, drop_last batches. With a `trainer` restored from a checkpoint (global_step > 0), the first epoch
    pass starts after the samples its optimizer steps already consumed (on every rank: under DDP Lightning deals
    this sampler's order out to the ranks)."""
    sampler = ResumableSampler(len(dataset), seed)
    if trainer is not None and trainer.global_step > 0:
        step_samples = batch_size * trainer.accumulate_grad_batches * trainer.world_size
        per_epoch = len(dataset) // (batch_size * trainer.world_size)  # drop_last
        steps_per_epoch = per_epoch // trainer.accumulate_grad_batches
        sampler.resume((trainer.global_step % steps_per_epoch) * step_samples)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, num_workers=num_workers)
