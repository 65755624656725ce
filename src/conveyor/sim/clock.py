"""VirtualClock: the simulator's time, read by the Scheduler exactly where it would read wall time."""

from __future__ import annotations


class VirtualClock:
    """A callable clock (``Scheduler(clock=VirtualClock())``) that only moves when told to."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds!r})")
        self.now += seconds

    def advance_to(self, t: float) -> None:
        """Jump forward to ``t`` (idle time); never moves back."""
        if t > self.now:
            self.now = t
