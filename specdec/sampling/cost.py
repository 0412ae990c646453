"""The verify-cost curve (docs/sampler.md §8): how long one base forward over n query tokens takes, relative to n = 1,
measured on the machine that runs it. A chain of γ pays v(γ+1) per round instead of 1, so the curve (not
"one verify = one base step") is what predicts a speedup: speedup = τ / (v(γ+1) + γ·c)."""

from __future__ import annotations

import statistics
import time
import weakref

import torch

from specdec.base import Base
from specdec.sampling.context import SamplingContext
from specdec.sampling.engine import REFERENCE, Engine

# Warm-up passes over every n after the prompt's prefill, before the timed ones. After one, the forwards still read
# slower than the same forward inside our AR loop (the prefill's float32 products have just gone through the caches),
# and every cost ratio divides by T_1: too few warm-ups make T_1 too large and our AR loop's time per token in T_1 (the
# Leviathan check's a) read below 1.
WARMUP = 8


def forward_costs(base: Base, ns: list[int], prompt_len: int = 128, reps: int = 7, engine: Engine = REFERENCE,
                  greedy: bool = False) -> dict[int, float]:
    """Median seconds of one verify forward (the base over n chain tokens after a prompt of `prompt_len`, lm_head
    included, exactly as the sampler runs it on `engine`; `greedy`: the argmax instead of the logits, as at T = 0)
    for each n in `ns`; rounds of all n are interleaved so drift on a noisy machine hits every n alike."""
    times = forward_times(base, ns, prompt_len, reps, engine, greedy)
    return {n: statistics.median(t) for n, t in times.items()}


@torch.no_grad()
def forward_times(base: Base, ns: list[int], prompt_len: int = 128, reps: int = 7, engine: Engine = REFERENCE,
                  greedy: bool = False, warmup: int = WARMUP) -> dict[int, list[float]]:
    """`forward_costs`' timings, every one (`reps` per n, after `warmup` passes that are not kept): a caller that
    samples again later, e.g. between an evaluation's prompts, pools them all."""
    dev = base.device
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, base.vocab_size, (1, prompt_len), generator=g).to(dev)
    times: dict[int, list[float]] = {n: [] for n in ns}
    with engine.installed(base):
        ctx = SamplingContext(base, 1, prompt_len + max(ns) + 1, engine)
        ctx.commit_layout(prompt_len)
        ctx.base_forward(prompt)
        ctx.commit(torch.tensor([prompt_len], device=dev), [prompt_len])
        head = engine.greedy_head(base.lm_head) if greedy else None  # as the decode takes it
        for rep in range(reps + warmup):  # the first passes warm up (and record each n's graph) and are not kept
            for n in ns:
                tokens = torch.randint(0, base.vocab_size, (1, n), generator=g).to(dev)
                ctx.tree_layout(torch.arange(n), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
                t0 = wall_clock(dev)
                if greedy and dev.type != "cpu":  # the argmax in the verify's graph, as the decode on a GPU
                    ctx.verify_forward(tokens)
                else:
                    hidden, _ = ctx.base_forward(tokens)
                    head.argmax(hidden) if head is not None and head.wins(n) else base.lm_head(hidden)
                if rep >= warmup:
                    times[n].append(wall_clock(dev) - t0)
    return times


# base -> {(the engine's key, every): v(0..n)}: each base's curve, measured once per process and engine setting
_CURVES: weakref.WeakKeyDictionary[Base, dict[tuple, list[float]]] = weakref.WeakKeyDictionary()


def verify_costs(base: Base, n_max: int, engine: Engine = REFERENCE, greedy: bool = False,
                 every: int = 1) -> list[float]:
    """v(n) = T_n / T_1 for n = 0..n_max (v[0] = 0) as the sampler runs a verify on `engine` on this machine,
    measured once per process and base (`forward_costs`, the time it took printed): at every n up to 16 and at every
    4th beyond, a size between two measured ones charged the next measured size up (the curve rises in steps: a new
    pass over the weights every few rows on a CPU). With `every` = b, only at multiples of b (and 1): a batch of b rows
    verifies b·n tokens, and a batch of thousands (a Monte Carlo test) would otherwise time every size up to b·n."""
    curves = _CURVES.setdefault(base, {})
    key = (engine.key(greedy), every)
    have = curves.get(key)
    if have is not None and len(have) > n_max:
        return have[: n_max + 1]
    steps = n_max // every
    grid = sorted({1, *(every * k for k in [*range(1, min(steps, 16) + 1), *range(20, steps + 1, 4)]), n_max})
    t0 = time.perf_counter()
    costs = forward_costs(base, grid, reps=5, engine=engine, greedy=greedy)
    print(f"[specdec] verify-cost curve v(1..{n_max}) measured in {time.perf_counter() - t0:.1f} s", flush=True)
    v = [0.0] + [costs[min(g for g in grid if g >= n)] / costs[1] for n in range(1, n_max + 1)]
    curves[key] = v
    return v


def chain_tau(alpha: float, gamma: int) -> float:
    """Leviathan et al.'s τ for a chain of γ with per-token acceptance α: (1 − α^{γ+1}) / (1 − α)."""
    return (1 - alpha ** (gamma + 1)) / (1 - alpha) if alpha < 1 else gamma + 1.0


def predicted_speedup(tau: float, gamma: float, c: float, v: float) -> float:
    """Chain of γ: τ emitted per round that costs v(γ+1) + γ·c AR steps (c = draft cost per depth / T_1); with an
    adaptive draft length, γ is the mean draft length and v the mean verify cost of the rounds."""
    return tau / (v + gamma * c)


def wall_clock(device: torch.device) -> float:
    """Seconds on a monotonic clock once the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class PhaseClock:
    """A decode's phase boundaries, read after it: `perf_counter` on a CPU; on CUDA an event recorded on the stream at
    each mark, so timing a round's phases costs no synchronize (five a round held the host until the GPU had drained
    at every boundary, where it could have queued the next work)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Each mark in seconds after the first."""
        if not self.cuda:
            return [t - self.marks[0] for t in self.marks]
        torch.cuda.synchronize()
        return [self.marks[0].elapsed_time(e) / 1e3 for e in self.marks]
