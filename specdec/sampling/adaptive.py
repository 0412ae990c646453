"""An adaptive draft length for chains (Draft & Verify's draft-exiting)."""

from __future__ import annotations

import torch

from specdec.sampling.config import SamplerConfig


class DraftLength:
    """Adaptive draft length for chains (Draft & Verify's adaptive draft-exiting): each row's chain ends after its
    first draft token whose top-1 probability is < threshold; with a target, the threshold follows the recent
    acceptance rate.
    Only the drafter's own numbers and past rounds decide how many tokens are proposed, never the base's
    distribution at the proposed positions, so verification stays lossless."""

    def __init__(self, cfg: SamplerConfig):
        self.threshold, self.target = cfg.adaptive_threshold, cfg.adaptive_target
        self.step, self.decay = cfg.adaptive_step, cfg.adaptive_decay
        self.rate = cfg.adaptive_target  # EMA of the acceptance rate; starts on target: no push either way
        self.active: torch.Tensor | None = None  # [B] bool, set every round: rows still decoding (finished rows
        # ride along in the shared chain but never keep it going)

    def keep_going(self, top1: torch.Tensor) -> torch.Tensor:
        """top1 [B] -> [B] bool: the rows whose chain goes on (confident and still decoding)."""
        confident = top1 >= self.threshold
        return confident if self.active is None else confident & self.active

    def update(self, accepted: int, drafted: int) -> None:
        """After a round: accepted / drafted draft tokens summed over the active rows."""
        if self.target is None or not drafted:
            return
        self.rate = self.decay * self.rate + (1 - self.decay) * accepted / drafted
        # Draft & Verify: θ ← θ + ε while acceptance is below target (stop earlier), θ − ε otherwise
        self.threshold = min(1.0, max(0.0, self.threshold + (self.step if self.rate < self.target else -self.step)))
