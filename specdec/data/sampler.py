"""A training loader whose order depends only on (seed, epoch) and that can restart mid-epoch, so a run resumed from
a checkpoint sees exactly the batches the uninterrupted run would have seen (Lightning restores the model, the
optimizer, the scheduler and the loop counters, but replays a plain shuffled DataLoader from its first batch).

Under DDP each rank takes every world-th sample of the same order, so the ranks' batches together are the batch of
one process with world × batch_size. Lightning's own distributed sampler would reshuffle this order with a seed of
its own, so the trainer runs with use_distributed_sampler=false (configs/trainer/default.yaml)."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class ResumableSampler(Sampler[int]):
    """Epoch e visits randperm(n) drawn from seed + e, rank r every world-th index of it from r on (cut to equal
    length across ranks). `resume(k)` makes the next pass skip its first k samples."""

    def __init__(self, n: int, seed: int, rank: int = 0, world: int = 1):
        self.n, self.seed, self.rank, self.world = n, seed, rank, world
        self.epoch, self._skip = 0, 0

    def set_epoch(self, epoch: int) -> None:  # called by Lightning at every epoch start (restored on resume)
        self.epoch = epoch

    def resume(self, samples_done: int) -> None:
        self._skip = samples_done

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        mine = order[self.rank : self.n - self.n % self.world : self.world]
        skip, self._skip = self._skip, 0
        return iter(mine[skip:].tolist())

    def __len__(self) -> int:
        return self.n // self.world - self._skip


def train_loader(dataset: Dataset, batch_size: int, seed: int, num_workers: int, trainer=None) -> DataLoader:
    """Shuffled, drop_last batches of `batch_size` per rank. With a `trainer` restored from a checkpoint
    (global_step > 0), the interrupted epoch pass starts after the samples its optimizer steps already consumed."""
    rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
    sampler = ResumableSampler(len(dataset), seed, rank, world)
    if trainer is not None and trainer.global_step > 0:
        per_step = batch_size * trainer.accumulate_grad_batches  # samples one rank consumes per optimizer step
        steps_per_epoch = (len(dataset) // world // batch_size) // trainer.accumulate_grad_batches
        sampler.resume((trainer.global_step % steps_per_epoch) * per_step)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, num_workers=num_workers)
