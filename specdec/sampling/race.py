"""Which of two ways to compute the same thing is faster on this machine, timed where it runs."""

from __future__ import annotations

import statistics


class Race:
    """Two ways of one step (the first: a native or fused call; the second: the plain one): the first ROUNDS calls of
    each, alternating from the first way, are timed by the caller (`record`); then the faster by median is kept for the
    rest of the process. A call where the first way declined (it cannot take that call) is not recorded."""

    ROUNDS = 3

    def __init__(self):
        self.times: tuple[list[float], list[float]] = ([], [])  # seconds a call: the second way, the first
        self.winner: bool | None = None  # True: the first way

    def first(self) -> bool:
        """Whether to try the first way now."""
        if self.winner is not None:
            return self.winner
        return len(self.times[1]) <= len(self.times[0])

    def record(self, first: bool, seconds: float) -> None:
        if self.winner is not None:
            return
        self.times[first].append(seconds)
        if min(map(len, self.times)) >= self.ROUNDS:
            self.winner = statistics.median(self.times[1]) <= statistics.median(self.times[0])
