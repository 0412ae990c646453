"""One-line errors before and during a decode: prompts that do not fit the base's context, and logits that are not
finite (a broken base would otherwise emit tokens drawn from garbage)."""

from __future__ import annotations

import math

import torch

from specdec.base import Base
from specdec.drafters.drafter import Drafter
from specdec.sampling.config import SamplerConfig
from specdec.sampling.trees import close_paths


def check_inputs(base: Base, prompt_ids: list[list[int]], cfg: SamplerConfig, drafter: Drafter | None) -> int:
    """One-line errors before any work: empty prompts, a prompt + answer + draft tree beyond the base's context (the
    KV cache is sized to exactly that) or its sliding attention window (the sampler's own mask sees the whole prefix),
    and sampling from a base whose logits are soft-capped (the sampler's lm_head gives them uncapped; greedy decoding
    is unaffected: the cap keeps the order). Returns the cache length."""
    if not prompt_ids:
        raise ValueError("no prompts to decode")
    empty = [i for i, p in enumerate(prompt_ids) if len(p) == 0]
    if empty:
        raise ValueError(f"prompt(s) {empty} are empty: every prompt needs at least one token")
    longest, nodes = max(len(p) for p in prompt_ids), max_nodes(cfg, drafter)
    need = longest + cfg.max_new_tokens + nodes + 1
    context = getattr(base.config, "max_position_embeddings", None)
    if context is not None and need > context:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {cfg.max_new_tokens} + a draft of {nodes} "
                         f"nodes = {need} positions, beyond the base's context of {context}")
    window = getattr(base.config, "sliding_window", None)
    if window is not None and getattr(base.config, "use_sliding_window", True) is not False and need > window:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {cfg.max_new_tokens} + a draft of {nodes} "
                         f"nodes = {need} positions, beyond the base's sliding attention window of {window}")
    if cfg.temperature > 0 and getattr(base.config, "final_logit_softcapping", None):
        raise ValueError("sampling (temperature > 0) from a base with final_logit_softcapping is not supported: its "
                         "logits would be sampled uncapped; decode greedily (temperature=0)")
    return need


def max_nodes(cfg: SamplerConfig, drafter: Drafter | None) -> int:
    if drafter is None:
        drafted = 0
    elif cfg.tree == "dynamic":
        drafted = cfg.dynamic_depth * cfg.dynamic_topk * cfg.dynamic_topk
    else:
        drafted = cfg.gamma if cfg.tree == "chain" else len(close_paths(cfg.paths or []))
    return 1 + max(drafted, cfg.lookup_tokens)


def not_finite(where: str) -> FloatingPointError:
    """The one error for NaN/inf in the base's logits (every check below, and the greedy verify's marked argmax)."""
    return FloatingPointError(f"NaN/inf in the base's logits {where}: the base's weights or dtype are broken "
                              f"(try dtype=float32)")


def finite(logits: torch.Tensor, where: str) -> torch.Tensor:
    """Fail on NaN/inf in the base's logits instead of emitting tokens drawn from garbage. Their sum is finite when
    every logit is (a few times cheaper to check than each); only a sum
    that is not (an overflow, or a real NaN) looks at each logit."""
    if not bool(torch.isfinite(logits.sum())) and not bool(torch.isfinite(logits).all()):
        raise not_finite(where)
    return logits


def finite_argmax(logits: torch.Tensor, where: str) -> torch.Tensor:
    """logits [..., V].argmax(-1), failing as `finite` does where greedy decoding would emit garbage: a NaN anywhere in
    a row is its max (PyTorch orders NaN above every number, as argmax does, the first on a tie), so is +inf, and a row
    all -inf has no finite max. One op where `finite` and the argmax take four, each microseconds of dispatch on a CPU
    right after a forward. Unlike `finite`, an -inf logit below a finite max passes: it changes no greedy token."""
    best, target = logits.max(-1)
    if not all(map(math.isfinite, best.flatten().tolist())):
        raise not_finite(where)
    return target
