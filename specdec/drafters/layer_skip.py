"""Layer-skip self-speculation (Draft & Verify, Zhang et al. 2023): the base itself, with a set of its layers
skipped, drafts for the full base. Nothing is trained: the executed layers, the final norm and the lm_head are the
base's own, and the executed layers read and write the base's own KV store. A draft writes the base store at the
round's draft slots, which the verify forward then overwrites with the full model's keys (as for early exit), so
the committed prefix always holds the full model's KV; skipped layers need no draft KV at all.

The skip set is found by `calibrate` (python train.py drafter=layer_skip): Bayesian optimisation over skip sets of
the PREDICTED SPEEDUP τ(α) / (v(γ+1) + γ·c) (docs/sampler.md §8), not of α alone: α is measured by the sampler on
calibration prompts from the data, the verify cost v and the draft cost c are measured on this machine. The found
set is an hparam, so the drafter checkpoint (json + an empty or draft-vocab-only safetensors) rebuilds it."""

from __future__ import annotations

import itertools
import logging
import statistics
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from specdec.base import Base, Features
from specdec.drafters.drafter import DraftContext, Drafter, DraftVocab, TrainOutput


@dataclass
class SkipSearch:
    """How `calibrate` searches the skip set (the `search` node of configs/drafter/layer_skip.yaml)."""

    trials: int = 60  # skip sets evaluated; a base with 2^layers <= trials is enumerated exhaustively instead
    startup_trials: int = 12  # random skip sets before TPE starts modelling the objective
    prompts: int = 8  # calibration prompts: the first prompt_len tokens of the data's validation blocks
    prompt_len: int = 64
    max_new_tokens: int = 64  # tokens decoded per prompt to measure α
    temperature: float = 0.0  # 0: greedy acceptance (evaluation's default); > 0: lossless rejection sampling
    cost_reps: int = 5  # timed repetitions per executed-layer count for the draft cost c
    seed: int = 0


class LayerSkip(Drafter):
    drafts_from_tokens = True  # the base's own layers over the path's tokens: stages may check proposals
    calibration_metrics = ("val/predicted_speedup", "val/alpha", "val/expected_tau", "val/measured_tau",
                           "val/draft_cost", "val/verify_cost", "val/skipped_layers",
                           "val/uniform_predicted_speedup", "val/uniform_alpha")

    def __init__(self, base: Base, skip_layers: Sequence[int] | None = None, gamma: int = 4,
                 draft_vocab_size: int | None = None, search: SkipSearch | dict | None = None,
                 uniform: int | None = None):
        search = search if isinstance(search, SkipSearch) else SkipSearch(**(search or {}))
        n = base.num_layers
        if uniform is not None:  # Draft & Verify's baseline: that many layers at evenly spaced depths
            if skip_layers is not None:
                raise ValueError("give skip_layers or uniform (a number of evenly spaced layers), not both")
            if not 0 <= uniform <= n:
                raise ValueError(f"uniform must be a number of layers in 0..{n}, got {uniform}")
            skip_layers = uniform_skip(n, uniform)
        skip = None if skip_layers is None else sorted({int(l) for l in skip_layers})
        # uniform is not kept: the checkpoint rebuilds the drafter from skip_layers
        super().__init__(base, skip_layers=skip, gamma=gamma, draft_vocab_size=draft_vocab_size,
                         search=asdict(search))
        if skip is not None and any(not 0 <= l < n for l in skip):
            raise ValueError(f"skip_layers must be layers in 0..{n - 1}, got {skip}")
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.gamma, self.search = gamma, search
        self.fixed = skip is not None  # a given skip set is measured by `calibrate`, not searched
        # EAGLE-3's draft vocab: the lm_head is a fifth of a small base's weights, and the draft pays it every depth
        self.draft_vocab = DraftVocab(base, draft_vocab_size) if draft_vocab_size else None
        self.feature_layers = ()  # reads no base features: the base's KV store is all it shares
        self.target_offsets, self.head_names = [0], ["skip"]
        self.set_skip(skip or [])  # None = not searched yet: until then it drafts with every layer (the base)

    def set_skip(self, skip: Sequence[int]) -> None:
        """Skip these base layers from now on (the search tries sets on one drafter; the result is an hparam)."""
        self.skip_layers = sorted(int(l) for l in skip)
        self.hparams["skip_layers"] = list(self.skip_layers)
        # A plain list in `_frozen`: the base's layers are never registered in the drafter.
        self._frozen["layers"] = [layer for i, layer in enumerate(self.base.layers) if i not in set(self.skip_layers)]

    def forward_train(self, feats: Features, input_ids: torch.Tensor) -> TrainOutput:
        raise NotImplementedError("layer skip has nothing to train: train.py runs its skip-set search (calibrate)")

    def expected_tau(self, accept: torch.Tensor) -> torch.Tensor:
        """Chain of gamma drafts each accepted with α: Σ_{i≤γ} α^i = (1 − α^{γ+1}) / (1 − α) (docs/sampler.md §4)."""
        return torch.stack([accept[0] ** i for i in range(self.gamma + 1)]).sum()

    # -- sampling: embeddings -> the executed layers on the base's own store -> final norm -> lm_head ---------
    def observe(self, state, ctx: DraftContext, feats: Features, tokens, n_new, next_token) -> None:
        pass  # the verify forward (or the prefill) wrote every layer's keys at the committed positions

    def expand(self, state, ctx: DraftContext, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
               nodes: torch.Tensor) -> torch.Tensor:
        h = self.base.embed_tokens(tokens)  # [B, N, H]
        if self._frozen["layers"]:
            h = ctx.run_layers(self._frozen["layers"], h, store="base")
        return self.project(self.base.norm(h))  # [B, N, V_d]

    # -- the skip-set search -------------------------------------------------------------------------------------
    def calibrate(self, blocks: Iterable[torch.Tensor], log: Callable[[dict[str, float], int], None],
                  probe=None) -> tuple[dict[str, float], dict[str, Any]]:
        """Search the skip set maximising the predicted speedup, keep it (set_skip), and return its metrics and the
        record of every skip set tried; `probe` (specdec.calibration.SamplerProbe) measures through the sampler. A
        drafter built with skip_layers is only measured (e.g. a uniform set).

        Why Optuna's TPE, called here rather than through the Hydra Optuna sweeper or `bayes_opt`: a trial is a few
        seconds of decoding, so every trial shares one loaded base, one set of calibration prompts and ONE
        measurement of the costs (a sweeper job per trial would reload the base and re-time the machine, mixing
        timing noise into the ranking); TPE models the 0/1 skip choices as categorical parameters natively, where
        bayes_opt's Gaussian process works on a continuous box and has to round (as Draft & Verify did); and
        Optuna is already installed with the sweeper plugin."""
        if probe is None:
            raise ValueError("layer_skip: calibrate needs a SamplerProbe (train.py hands it one)")
        s, n, g = self.search, self.base.num_layers, self.gamma
        prompts = _prompts(blocks, s.prompts, s.prompt_len)
        t = probe.verify_times([1, g + 1], len(prompts[0]), s.cost_reps)
        verify = t[g + 1] / t[1]  # v(γ+1)
        cost = self.draft_costs(probe, prompts[0], t[1])  # c by executed-layer count
        seen: dict[tuple[int, ...], dict[str, Any]] = {}

        def evaluate(skip: tuple[int, ...]) -> dict[str, Any]:
            if skip not in seen:
                alpha, tau = self._acceptance(probe, skip, prompts)
                tau_pred = sum(alpha**i for i in range(g + 1))
                c = cost[n - len(skip)]
                seen[skip] = {"skip_layers": list(skip), "alpha": alpha, "expected_tau": tau_pred,
                              "measured_tau": tau, "draft_cost": c, "verify_cost": verify,
                              "predicted_speedup": tau_pred / (verify + g * c)}
            return seen[skip]

        trials: list[dict[str, Any]] = []

        def record(skip: tuple[int, ...]) -> float:
            m = evaluate(skip)
            trials.append(m)
            log({f"search/{k}": float(v) for k, v in m.items() if k != "skip_layers"} | {"search/skipped": len(skip)},
                len(trials) - 1)
            return m["predicted_speedup"]

        if self.fixed:
            record(tuple(self.skip_layers))
        elif 2**n <= s.trials:  # few layers: every skip set, exactly
            for bits in itertools.product((False, True), repeat=n):
                record(tuple(i for i in range(n) if bits[i]))
        else:
            self._tpe(record, n)
        best = max(seen.values(), key=lambda m: m["predicted_speedup"])
        # The same number of layers skipped at evenly spaced depths: what the search has to beat.
        uniform = evaluate(uniform_skip(n, len(best["skip_layers"])))
        self.set_skip(best["skip_layers"])
        metrics = {f"val/{k}": float(best[k]) for k in ("predicted_speedup", "alpha", "expected_tau", "measured_tau",
                                                        "draft_cost", "verify_cost")}
        metrics |= {"val/skipped_layers": float(len(best["skip_layers"])),
                    "val/uniform_predicted_speedup": float(uniform["predicted_speedup"]),
                    "val/uniform_alpha": float(uniform["alpha"])}
        detail = {"best": best, "uniform": uniform, "gamma": g, "verify_cost": verify, "t1_s": t[1],
                   "draft_cost_by_executed_layers": cost, "prompts": len(prompts), "trials": trials}
        return metrics, detail

    def _tpe(self, objective: Callable[[tuple[int, ...]], float], n: int) -> None:
        logging.getLogger("alembic").setLevel(logging.WARNING)  # importing optuna's storages logs a page at INFO
        import optuna

        s = self.search
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial otherwise
        try:
            with warnings.catch_warnings():  # multivariate TPE and enqueue_trial are "experimental" in optuna 2
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                # multivariate: which layers can go depends on which others already went
                sampler = optuna.samplers.TPESampler(seed=s.seed, n_startup_trials=s.startup_trials,
                                                     multivariate=True)
                study = optuna.create_study(direction="maximize", sampler=sampler)
                # Random skip sets drop about half the layers, where a small base accepts almost nothing and the
                # objective only rewards a cheaper draft (more skips). Uniform sets at a few ratios go first, so
                # the model sees the high-acceptance end of the trade-off too.
                for count in sorted({max(1, round(n * r)) for r in UNIFORM_SEEDS}):
                    study.enqueue_trial({f"skip{i}": i in uniform_skip(n, count) for i in range(n)})
            study.optimize(lambda trial: objective(tuple(
                i for i in range(n) if trial.suggest_categorical(f"skip{i}", [False, True]))), n_trials=s.trials)
        finally:
            optuna.logging.set_verbosity(verbosity)

    @torch.no_grad()
    def _acceptance(self, probe, skip: tuple[int, ...], prompts: list[list[int]]) -> tuple[float, float]:
        """α (accepted / drafted) and measured τ of the sampler drafting with `skip` on the calibration prompts."""
        self.set_skip(skip)
        s = self.search
        accepted, drafted = probe.acceptance(self, prompts, self.gamma, s.max_new_tokens, s.temperature, s.seed)
        return sum(accepted) / max(drafted, 1), (sum(accepted) + len(accepted)) / max(len(accepted), 1)

    def draft_costs(self, probe, prompt: list[int], t1: float) -> dict[int, float]:
        """c(k) for k = 0..L executed layers: the seconds of one chain draft of γ tokens by the sampler's own drafting
        code after `prompt`, per depth, in units of T_1 (one base forward over one token). All layers have one
        shape, so the cost depends on k only; timing each k once (interleaved, so drift hits every k alike) means two
        skip sets of one size are never ranked by timing noise."""
        n, g, kept = self.base.num_layers, self.gamma, list(self.skip_layers)
        # k executed layers: which ones does not change the cost
        settings = {k: (lambda k=k: self.set_skip(range(k, n))) for k in range(n + 1)}
        times = probe.draft_times(self, prompt, g, settings, self.search.cost_reps)
        self.set_skip(kept)
        return {k: statistics.median(ts) / g / t1 for k, ts in times.items()}


UNIFORM_SEEDS = (1 / 16, 1 / 8, 1 / 4, 1 / 2)  # skip ratios of the uniform sets the TPE search starts from


def uniform_skip(num_layers: int, count: int) -> tuple[int, ...]:
    """`count` layers spread evenly over the depth (the centres of `count` equal bins)."""
    return tuple(sorted({int((i + 0.5) * num_layers / count) for i in range(count)})) if count else ()


def _prompts(blocks: Iterable[torch.Tensor], count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `count` blocks (rows of [T] or [B, T] token tensors)."""
    out: list[list[int]] = []
    for block in blocks:
        for row in block.reshape(-1, block.shape[-1]):
            out.append(row[:length].tolist())
            if len(out) == count:
                return out
    if not out:
        raise ValueError("no calibration prompts: the data has no validation blocks")
    return out


