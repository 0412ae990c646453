"""What the speculative algorithm decides (SamplerConfig: the Hydra group `sampler`) and what one decode returns.
How its forwards run is the engine's (specdec/engines/config.py: the group `engine`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplerConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy verification
    top_k: int = 0  # 0 = off; applied to p and q alike
    top_p: float = 1.0
    tree: str = "chain"  # chain | static | dynamic
    gamma: int = 4  # chain length
    paths: list[list[int]] | None = None  # static tree: index paths into each depth's top-k
    dynamic_depth: int = 4
    dynamic_topk: int = 4  # nodes expanded per depth, and children proposed per expanded node
    dynamic_budget: int = 16  # draft nodes verified per round (with dynamic_by_cost: at most)
    # Per round, verify the number of best nodes that maximises the expected tokens per verify cost, from the drafter's
    # path probabilities and the verify-cost curve measured on this machine (cost.verify_costs, once per process):
    # trees as large as the machine verifies cheaply, whatever its kernels (trees.cost_budget).
    dynamic_by_cost: bool = False
    acceptance: str = "rejection"  # at T > 0: rejection (lossless) | typical (lossy, Medusa §3.3.1)
    typical_eps: float = 0.3
    typical_delta: float = 0.09
    eos_token_id: int | list[int] | None = None  # None: the base config's eos; [] never stops early
    # Adaptive draft length (chains; Draft & Verify's draft-exiting): a round's chain ends after a token whose top-1
    # draft probability is below the threshold (0 = off: always gamma). With a target acceptance rate the threshold
    # adapts every round: up by adaptive_step while the recent rate (EMA, decay adaptive_decay) is below it, else down.
    adaptive_threshold: float = 0.0
    adaptive_target: float | None = None  # None: the threshold stays fixed
    adaptive_step: float = 0.01
    adaptive_decay: float = 0.9
    # N-gram lookup (lookup.py): a round whose context's last min..max_ngram tokens occurred before proposes the
    # (up to lookup_tokens) tokens that followed them instead of running the drafter; 0 = off. With no drafter, the
    # rounds without a match are plain decoding steps.
    lookup_tokens: int = 0
    lookup_min_ngram: int = 2
    lookup_max_ngram: int = 3
    # Per lookup round, verify the prefix of the proposals that maximises the expected tokens per verify cost, from
    # how far earlier proposals of the same n-gram length matched and the verify-cost curve measured on this machine
    # (lookup.LookupLength; the curve once per process): all lookup_tokens where verifying is nearly free, fewer where
    # each verified token costs about a fifth of a step (a 2-core CPU). False: every proposal whole.
    lookup_by_cost: bool = True
    # Staged drafting (Spector & Ré 2023; trees._greedy_chain): n-gram lookup over the context and the chain so far
    # proposes up to stage_lookup of the drafter's next tokens, and the drafter checks them in one pass of its own,
    # keeping each while it equals its own greedy token: the same chain in fewer drafter passes (0 = off). Greedy
    # chains of a drafter whose expand reads only its nodes' path tokens (Drafter.drafts_from_tokens).
    stage_lookup: int = 0

    def __post_init__(self) -> None:
        """One-line errors for settings that would otherwise fail deep in a decode loop (or silently)."""
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.tree in ("chain", "static", "dynamic"), f"tree must be chain, static or dynamic, got {self.tree!r}"),
            (self.acceptance in ("rejection", "typical"), f"acceptance must be rejection or typical, got {self.acceptance!r}"),
            (self.tree != "chain" or self.gamma >= 1, f"gamma must be >= 1, got {self.gamma}"),
            (self.tree != "static" or bool(self.paths), "a static tree needs paths, e.g. [[0], [1], [0, 0]]"),
            (self.tree != "dynamic" or min(self.dynamic_depth, self.dynamic_topk, self.dynamic_budget) >= 1,
             "dynamic_depth, dynamic_topk and dynamic_budget must be >= 1"),
            (0 <= self.adaptive_threshold <= 1, f"adaptive_threshold must be in [0, 1], got {self.adaptive_threshold}"),
            (self.adaptive_target is None or 0 < self.adaptive_target < 1,
             f"adaptive_target must be in (0, 1) or null, got {self.adaptive_target}"),
            (self.adaptive_step > 0 and 0 <= self.adaptive_decay < 1, f"adaptive_step must be > 0 and adaptive_decay "
             f"in [0, 1), got {self.adaptive_step} and {self.adaptive_decay}"),
            (self.lookup_tokens >= 0 and 1 <= self.lookup_min_ngram <= self.lookup_max_ngram,
             f"lookup_tokens must be >= 0 and 1 <= lookup_min_ngram <= lookup_max_ngram, got {self.lookup_tokens}, "
             f"{self.lookup_min_ngram} and {self.lookup_max_ngram}"),
            (not self.adaptive or self.tree == "chain",
             f"adaptive draft length needs tree=chain (a {self.tree} tree's shape is fixed per round)"),
            (self.stage_lookup == 0 or (self.stage_lookup > 0 and self.tree == "chain" and self.temperature == 0
                                        and not self.adaptive),
             f"stage_lookup must be >= 0 and staged drafting needs tree=chain at temperature=0 without an adaptive "
             f"draft length (it checks proposals against the drafter's greedy tokens; a sampled chain is not staged), "
             f"got stage_lookup={self.stage_lookup}, tree={self.tree}, temperature={self.temperature}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"sampler: {message}")

    @property
    def lossless(self) -> bool:
        return self.temperature == 0 or self.acceptance == "rejection"

    @property
    def adaptive(self) -> bool:
        return self.adaptive_threshold > 0 or self.adaptive_target is not None


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [B, max_new_tokens], -1 after each row's end
    num_generated: list[int]  # per row
    accepted: list[list[int]]  # per row, per round it took part in: draft tokens accepted a_s
    drafted: list[list[int]]  # per row, per round: draft nodes verified (γ_s; N_s - 1 for trees)
    lossless: bool
    ttft_s: float  # prefill up to the first token of every row
    total_s: float
    step_draft_s: list[float] = field(default_factory=list)  # per round: drafting (expand + observe)
    step_verify_s: list[float] = field(default_factory=list)  # per round: the base verify forward
    step_overhead_s: list[float] = field(default_factory=list)  # per round: acceptance, rollback, bookkeeping
    lookup_rounds: int = 0  # rounds proposed by n-gram lookup instead of the drafter
    # per round: drafter passes (`expand` calls: one a depth but with stage_lookup); 0 for a lookup round, a plain step
    draft_passes: list[int] = field(default_factory=list)

    @property
    def decode_s(self) -> float:
        return self.total_s - self.ttft_s
