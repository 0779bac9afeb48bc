"""What every worker does for schedules (the `loom.pollers` entry point): keep the
schedules' names and when each is next due, and fire each when it is.

An idle schedule costs nothing between its ticks: the worker wakes at its next due
time. At the first poll `refresh` seconds after the last look, the worker reads the
notices of changes made through the API since the last it saw (one read, one request
on S3 when nothing changed) and reads again the schedules they name: one created,
changed, paused or unpaused elsewhere is seen then (its ticks meanwhile caught up).
Every `FULL_EVERY` looks it lists every schedule and reads each, which also finds a
change whose notice a crash lost. A look never wakes a worker by itself: an idle
worker looks at its own idle pace. A pause or a delete needs neither: a fire reads
the state it decides on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from loom_kernel import Engine, LoomError

from loom_orchestration._schedules import _book
from loom_orchestration._schedules._decide import next_tick
from loom_orchestration._schedules._firing import fire_schedule
from loom_orchestration._schedules._state import ScheduleState

__all__ = ["SchedulePoller", "next_due", "schedule_poller"]

logger = logging.getLogger("loom")

#: The least seconds between listings of the schedules: on a store whose reads cost
#: nothing, and on one where each costs a request (S3: a worker's idle pace there).
REFRESH_CHEAP: Final = 5.0
REFRESH_COSTLY: Final = 60.0
#: Every this many looks, every schedule is listed and read again.
FULL_EVERY: Final = 60
#: The most decisions a poll makes for one schedule, and the longest it spends on
#: them (a catch-up goes on at the next poll).
_DECISIONS_A_POLL: Final = 64
_BUDGET: Final = 0.2


def next_due(name: str, state: ScheduleState | None, now: float, recheck: float) -> float | None:
    """When a schedule next has something to decide, by the engine's clock: its next
    tick's due time; `now + recheck` while ticks wait for its last run to end (the
    listener of the engine that ends it fires it sooner); None for none."""
    if state is None or state.deleted or state.paused:
        return None
    if state.pending.starts or state.pending.cancels:
        return now
    soonest: float | None = now + recheck if state.buffer or state.backfills else None
    tick = next_tick(state.spec, state.cursor)
    if tick is not None:
        following = next_tick(state.spec, tick)
        due = state.spec.due_at(name, tick, tick if following is None else following)
        soonest = due if soonest is None else min(soonest, due)
    return soonest


class SchedulePoller:
    """A worker's view of the schedules: fires each when it is due."""

    def __init__(
        self,
        engine: Engine,
        refresh: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._monotonic = monotonic
        cheap = engine.store.head_is_cheap
        self._refresh = (REFRESH_CHEAP if cheap else REFRESH_COSTLY) if refresh is None else refresh
        self._due: dict[str, float | None] = {}
        self._looked_at = float("-inf")  # by time.monotonic()
        self._looks = 0
        self._seen: int | None = None  # the last notice read

    def __call__(self) -> float | None:
        """Fire the schedules that are due; seconds until the next is due (None for
        none: the worker's idle pace decides when it polls again)."""
        if self._monotonic() - self._looked_at >= self._refresh:
            self._look()
        engine = self._engine
        for name, due in list(self._due.items()):
            now = engine.clock()
            if due is None or due > now:
                continue
            try:
                _started, state = fire_schedule(engine, name, _DECISIONS_A_POLL, _BUDGET)
            except Exception as exc:  # one schedule never stops the others; again later
                logger.warning("loom: schedule %s not fired: %s: %s", name, type(exc).__name__, exc)
                self._due[name] = now + self._refresh
                continue
            self._due[name] = next_due(name, state, engine.clock(), self._refresh)
        now = engine.clock()
        return min((due - now for due in self._due.values() if due is not None), default=None)

    def _look(self) -> None:
        """Learn of the schedules changed elsewhere: from the notices, or by a full
        listing (the first look, every FULL_EVERY looks, or notices trimmed away)."""
        store = self._engine.store
        self._looked_at = self._monotonic()
        full = self._seen is None or self._looks % FULL_EVERY == 0
        self._looks += 1
        try:
            if not full and self._seen is not None:
                found = _book.notices_after(store, self._seen)
                if found is not None:
                    self._seen, changed = found
                    for name in sorted(changed):
                        self._due[name] = self._read_due(name)
                    return
            seen = store.head(_book.NOTICES)  # a change after this is noticed next look
            names = list(_book.names(store))
        except LoomError as exc:
            logger.warning("loom: schedules not listed: %s: %s", type(exc).__name__, exc)
            return
        self._due = {name: self._read_due(name) for name in names}
        self._seen = seen

    def _read_due(self, name: str) -> float | None:
        engine = self._engine
        try:
            _head, state = _book.read(engine.store, name)
        except Exception as exc:  # a damaged record, a store fault: looked at again later
            logger.warning("loom: schedule %s not read: %s: %s", name, type(exc).__name__, exc)
            return engine.clock() + self._refresh
        return next_due(name, state, engine.clock(), self._refresh)


def schedule_poller(engine: Engine) -> SchedulePoller:
    """The `loom.pollers` entry point: a worker's schedule poller."""
    return SchedulePoller(engine)
