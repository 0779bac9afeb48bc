"""A clock that moves only when a test moves it."""

from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    """Pass as `Engine(..., clock=FakeClock())`; `advance` moves time, so timers fire
    without any test waiting for real time.

    Args:
        start: the initial time, in epoch seconds.
    """

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by `seconds`."""
        self.now += seconds
