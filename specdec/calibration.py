"""What a drafter with nothing to train (layer skip) asks of the sampler while it searches its settings: the base's
verify times, the acceptance of a candidate setting on calibration prompts, and the time of a chain draft, all on
one engine. Handed to `Drafter.calibrate` by training, so drafters import neither the sampler nor an engine."""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from specdec.base import Base
from specdec.drafters.drafter import Drafter
from specdec.sampling.config import SamplerConfig
from specdec.sampling.context import SamplingContext
from specdec.sampling.cost import forward_costs, wall_clock
from specdec.sampling.decode import generate
from specdec.sampling.engine import REFERENCE, Engine
from specdec.sampling.trees import chain_paths, draft_static


class SamplerProbe:
    def __init__(self, base: Base, engine: Engine = REFERENCE):
        self.base, self.engine = base, engine

    def verify_times(self, ns: list[int], prompt_len: int, reps: int) -> dict[int, float]:
        """Median seconds of a verify forward over n tokens after a prompt of prompt_len, for each n in ns."""
        return forward_costs(self.base, ns, prompt_len=prompt_len, reps=reps, engine=self.engine)

    @torch.no_grad()
    def acceptance(self, drafter: Drafter, prompts: list[list[int]], gamma: int, max_new_tokens: int,
                   temperature: float, seed: int) -> tuple[list[int], int]:
        """Decode the prompts with the drafter drafting chains of γ -> (accepted draft tokens per round, tokens
        drafted in all)."""
        cfg = SamplerConfig(max_new_tokens=max_new_tokens, temperature=temperature, gamma=gamma)
        gen = torch.Generator(device=self.base.device).manual_seed(seed)
        r = generate(self.base, prompts, drafter, cfg, generator=gen, engine=self.engine)
        return [a for row in r.accepted for a in row], sum(g for row in r.drafted for g in row)

    @torch.no_grad()
    def draft_times(self, drafter: Drafter, prompt: list[int], gamma: int, settings: dict[Hashable, Callable[[], None]],
                    reps: int) -> dict[Hashable, list[float]]:
        """Seconds of one chain draft of γ tokens after `prompt` by the sampler's own drafting code, `reps` times for
        each setting (`settings[k]()` puts the drafter in setting k), interleaved so drift hits every setting alike;
        a first pass warms up and is not kept."""
        base, dev = self.base, self.base.device
        ids = torch.tensor([prompt], device=dev)
        ctx = SamplingContext(base, 1, len(prompt) + gamma + 2, self.engine)
        ctx.commit_layout(len(prompt))
        ctx.base_forward(ids)
        ctx.commit(torch.tensor([len(prompt)], device=dev), [len(prompt)])
        times: dict[Hashable, list[float]] = {k: [] for k in settings}
        with self.engine.installed(base, [drafter]):
            for rep in range(reps + 1):
                for k, put in settings.items():
                    put()
                    t0 = wall_clock(dev)
                    draft_static(drafter, drafter.init_state(1, ctx.max_len), ctx, ids[:, -1], chain_paths(gamma))
                    if rep:
                        times[k].append(wall_clock(dev) - t0)
        return times
