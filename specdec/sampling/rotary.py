"""The base's rotary (cos, sin) for one decode, looked up instead of recomputed.

Every forward of a decode (the verify, each draft depth, each `observe`) needs the rotary cos/sin at its query
positions: the model's rotary module makes them in ~10 small ops and `lean_rope` turns them into the lean layers'
form in 3 more, paid 5-6 times a round, each op microseconds of dispatch on a CPU. A decode never holds more than max_len
positions, so both forms are made once for all of them and each forward indexes its rows.

Only where the lookup gives the module's own numbers bit for bit: a rotary whose values depend on the call (dynamic
scaling reads the longest position asked; a vectorised sin may round its tail differently from its body) would not.
So the table is compared with the module's own calls at a few positions when it is made, and where they differ the
module runs itself on every forward, as before."""

from __future__ import annotations

import torch
from torch import nn


def lean_rope(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary (cos, sin) [B, n, d] as LeanLayer takes them, made once per forward for every layer:
    [B, 1, n, d] each, the sine's first half negated. Then rotate_half(x)·sin = roll(x, d/2)·sin' exactly (the
    halves swap, the sign moves to sin), so the rotation is 3 ops on q and k at once instead of 7 on each."""
    half = sin.shape[-1] // 2
    return cos[:, None], torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, None]

MARGIN = 8  # positions below 0 the table holds: drafters may shift theirs (the prophet's entries sit at t - 1)


class RotaryTable:
    def __init__(self, rotary: nn.Module, like: torch.Tensor, max_len: int):
        """rotary: the base's rotary module, (x, position_ids [B, n]) -> (cos, sin) [B, n, d] in x's dtype; like: a
        tensor of the forwards' dtype and device; positions [-MARGIN, max_len) are held."""
        self.rotary, self.max_len = rotary, max_len
        pos = torch.arange(-MARGIN, max_len, device=like.device)[None]  # [1, P]
        cos, sin = rotary(like, pos)  # [1, P, d]
        self.cos, self.sin = cos[0], sin[0]  # [P, d]
        lean_cos, lean_sin = lean_rope(cos, sin)  # [1, 1, P, d]
        self.lean_cos, self.lean_sin = lean_cos[0, 0], lean_sin[0, 0]  # [P, d]
        self.exact = self._agrees(like)

    def _agrees(self, like: torch.Tensor) -> bool:
        """Whether the module's own calls, one position or a few at a time as decoding makes them, give the table's
        rows bitwise."""
        last, half = self.max_len - 1, self.max_len // 2
        for run in ([0], [last], [p for p in (-1, 0, 1, 2, 3) if p <= last], list(range(half, min(half + 7, last)))):
            if not run:
                continue
            pos = torch.tensor([run], device=like.device)  # [1, n]
            cos, sin = self.rotary(like, pos)
            rows = pos[0] + MARGIN
            if not (torch.equal(cos[0], self.cos[rows]) and torch.equal(sin[0], self.sin[rows])):
                return False
        return True

    def covers(self, lowest: int, highest: int) -> bool:
        """Whether a forward whose positions lie in [lowest, highest] can be looked up."""
        return self.exact and lowest >= -MARGIN and highest < self.max_len

    def __call__(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [B, n] -> the module's (cos, sin) [B, n, d]."""
        rows = pos + MARGIN
        return self.cos[rows], self.sin[rows]

    def lean(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [B, n] -> `lean_rope` of the module's (cos, sin): [B, 1, n, d] each."""
        rows = pos + MARGIN
        return self.lean_cos[rows][:, None], self.lean_sin[rows][:, None]

    def lean_run(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`lean` of one row at positions start .. start + n - 1, as views of the table: [1, 1, n, d] each (read only)."""
        rows = slice(start + MARGIN, start + MARGIN + n)
        return self.lean_cos[rows][None, None], self.lean_sin[rows][None, None]
