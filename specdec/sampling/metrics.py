"""Speculative-decoding metrics (docs/sampler.md §4) as plain dicts, per prompt, for evaluation to tabulate."""

from __future__ import annotations

from collections import Counter


def prompt_metrics(accepted: list[int], drafted: list[int], num_tokens: int, seconds: float,
                   decode_seconds: float) -> dict:
    """One prompt: a_s accepted and γ_s drafted per round; tokens generated, end-to-end and decode-only time."""
    steps = len(accepted)
    emitted = [a + 1 for a in accepted]
    depth = max(accepted, default=0)
    # r_i = #{a_s >= i} / S and alpha_i = #{a_s >= i} / #{a_s >= i-1}, for i = 1..max depth reached
    reach = [sum(a >= i for a in accepted) for i in range(depth + 1)]
    return {
        "steps": steps,
        "tau": sum(emitted) / steps if steps else 1.0,
        "alpha": sum(accepted) / sum(drafted) if sum(drafted) else 0.0,
        "draft_len": sum(drafted) / steps if steps else 0.0,  # mean γ_s (adaptive draft length: < gamma)
        "r": [reach[i] / steps for i in range(1, depth + 1)],
        "alpha_i": [reach[i] / reach[i - 1] for i in range(1, depth + 1)],
        "accept_hist": dict(sorted(Counter(accepted).items())),
        "tokens": num_tokens,
        "tok_per_s": num_tokens / seconds if seconds > 0 else 0.0,
        # the first token comes from the prefill, so decode-only throughput counts the rest
        "decode_tok_per_s": (num_tokens - 1) / decode_seconds if decode_seconds > 0 else 0.0,
    }


def token_acceptance(accepted: list[int], drafted: list[int]) -> float:
    """Leviathan et al.'s α, the probability that one draft token is accepted, from chain rounds (a_s accepted of
    γ_s drafted): accepted tokens / tokens the verifier decided on. A round decides on its a_s accepted tokens plus
    the one it rejected, if any (a_s < γ_s); the tokens after a rejection were never tried. This is the maximum-
    likelihood α of Leviathan's i.i.d. model, the α its τ = (1 − α^{γ+1})/(1 − α) expects. The rate α̂ = Σa_s/Σγ_s
    (docs/sampler.md §4) counts the untried tokens as failures, so it is lower and that formula underpredicts τ with it."""
    tried = sum(a + (a < g) for a, g in zip(accepted, drafted))
    return sum(accepted) / tried if tried else float("nan")
