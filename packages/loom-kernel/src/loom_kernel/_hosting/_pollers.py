"""Pollers: work a worker does on each poll beside its own (due timers, open runs,
queues), published by other distributions in the `loom.pollers` entry-point group
(loom-orchestration's schedules are one).

An entry point names a factory, called once per worker with its engine; what it
returns is called at every poll, on the worker's polling thread (so it must be cheap
when it has nothing to do), and answers in how many seconds it next has work: the
worker wakes then, however long its idle pace (0 or less: poll again at once; None:
it does not know, and the worker's idle pace decides). A poller must hand long work
to the engine (`dispatch`, `enqueue`) rather than do it in the call: the poll waits
for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Final

from loom_kernel._engine import Engine
from loom_kernel._hosting._slots import WorkerStats

__all__ = ["POLLER_GROUP", "Poll", "PollerFactory", "Pollers", "installed_pollers"]

logger = logging.getLogger("loom")

POLLER_GROUP: Final = "loom.pollers"
#: Does a poller's due work; the seconds until it next has work, or None.
Poll = Callable[[], float | None]
#: Makes a worker's poller, given the worker's engine.
PollerFactory = Callable[[Engine], Poll]
_installed: list[PollerFactory] | None = None


def installed_pollers() -> list[PollerFactory]:
    """The poller factories published in the `loom.pollers` entry-point group (loaded
    once per process; one that fails to load is logged and left out)."""
    global _installed  # noqa: PLW0603 - a process-wide cache of installed plugins
    if _installed is None:
        loaded: list[PollerFactory] = []
        from importlib.metadata import entry_points  # noqa: PLC0415 (costly to import)

        for point in entry_points(group=POLLER_GROUP):
            try:
                loaded.append(point.load())
            except Exception as exc:  # a broken plugin never stops a worker
                logger.warning(
                    "loom: poller %s not loaded: %s: %s", point.name, type(exc).__name__, exc
                )
        _installed = loaded
    return list(_installed)


class Pollers:
    """A worker's pollers, and when the soonest of them next has work."""

    def __init__(
        self, engine: Engine, factories: Iterable[PollerFactory], stats: WorkerStats
    ) -> None:
        self._polls = [make(engine) for make in factories]
        self._stats = stats
        # By time.monotonic(): when each said it next has work, which wakes the
        # worker (never, for one that did not say).
        self._wake_at = [float("inf")] * len(self._polls)

    def __bool__(self) -> bool:
        return bool(self._polls)

    def poll(self) -> int:
        """Call every poller; how many of them said they have more work now. One that
        raises is counted as a failure, logged, and polled again at the next poll."""
        busy = 0
        for index, poll in enumerate(self._polls):
            try:
                after = poll()
            except Exception as exc:
                self._stats.failures += 1
                logger.warning("loom: a poller failed: %s: %s", type(exc).__name__, exc)
                after = None
            now = time.monotonic()
            if after is None:
                self._wake_at[index] = float("inf")
                continue
            if after <= 0:
                busy += 1
            self._wake_at[index] = now + max(after, 0.0)
        return busy

    def until_due(self) -> float:
        """Seconds until a poller said it next has work (inf when none said)."""
        return max(0.0, min(self._wake_at, default=float("inf")) - time.monotonic())
