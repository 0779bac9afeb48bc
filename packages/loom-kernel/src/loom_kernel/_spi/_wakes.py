"""Wake-ups: what a store whose backend can push changes (PostgreSQL's LISTEN/NOTIFY)
offers a worker, so that work written by another process is taken at once rather
than at the worker's next poll."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Protocol, runtime_checkable

__all__ = ["WAKE_PREFIXES", "SupportsWakeups"]

#: The streams whose appends have work for a worker: the run index's open partitions
#: (a start, a message's nudge, a release), queues' admissions, and timers.
WAKE_PREFIXES: Final = ("runs/open/", "queues/", "timers/")


@runtime_checkable
class SupportsWakeups(Protocol):
    """A store that calls back when an append to a stream under `WAKE_PREFIXES` lands,
    from whichever process made it. A wake is a hint to look now: a store may send one
    with nothing behind it, and may lose one (a worker's poll finds the work then)."""

    def subscribe_wakes(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake()` (from any thread) at such appends until the returned function
        is called."""
