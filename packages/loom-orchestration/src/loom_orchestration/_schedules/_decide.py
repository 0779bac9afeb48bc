"""A schedule's next decision, as a pure function of its state and the time: which
ticks are due, which are missed, and what the overlap policy makes of each (start,
skip, buffer, cancel or terminate the last run).

Nothing here reads or writes a store: `advance` returns the next state, whose
`pending` says what is owed (runs to start, runs to cancel), and the caller appends
it at the head it read (one decider wins a race) before it does what is owed.

Whether the last run still runs is asked of the store at each decision, so a
decision that starts or cancels a run under any policy but `allow_all` ends there:
the next decision, made once that is done, sees whether the run it started still
runs (a catch-up of many ticks is decided one start at a time, each judged against
the run before it as it is by then).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

import attrs

from loom_orchestration._schedules._spec import ScheduleSpec, run_id
from loom_orchestration._schedules._state import (
    RECENT,
    Action,
    Backfill,
    Counts,
    Pending,
    ScheduleState,
    Waiting,
)

__all__ = ["BUFFER_LIMIT", "Decider", "advance", "next_tick", "ticks_between"]

#: The most ticks a buffer holds (Temporal's limit too); a tick past it is skipped.
BUFFER_LIMIT: Final = 1000
#: The most runs one decision starts or cancels: the rest are the next decision's.
MAX_ACTIONS: Final = 100
#: The most ticks one decision looks at (missed ones are only counted).
MAX_TICKS: Final = 100_000
#: The most backfilled ticks one decision looks at (each costs a read: does it exist?).
MAX_BACKFILL_LOOKS: Final = 10_000


def next_tick(spec: ScheduleSpec, after: float) -> float | None:
    """The first tick strictly after `after`, or None if the expression has no more."""
    return next(spec.ticks_after(after), None)


def ticks_between(spec: ScheduleSpec, after: float, until: float, limit: int) -> tuple[int, float]:
    """How many ticks fall in `(after, until]` (at most `limit`), and the last counted
    (`after` when none)."""
    count, last = 0, after
    for tick in spec.ticks_after(after):
        if tick > until or count >= limit:
            break
        count, last = count + 1, tick
    return count, last


@attrs.define
class Decider:
    """One decision in the making: a copy of the state's moving parts, changed tick by
    tick, then frozen into the next state by `state()`."""

    name: str
    base: ScheduleState
    now: float
    #: Whether a run still runs: asked only when a policy needs it (each ask reads the
    #: run), then known (a run started in this decision runs).
    ask_running: Callable[[str], bool]
    known: dict[str, bool] = attrs.Factory(dict)
    cursor: float = 0.0
    last_run: str | None = None
    last_tick: float | None = None
    buffer: list[Waiting] = attrs.Factory(list)
    backfills: list[Backfill] = attrs.Factory(list)
    starts: list[Waiting] = attrs.Factory(list)
    cancels: list[tuple[str, str]] = attrs.Factory(list)
    counts: dict[str, int] = attrs.Factory(dict)
    recent: list[Action] = attrs.Factory(list)
    changed: bool = False
    halted: bool = False  # a run was started or cancelled under a policy that looks

    def __attrs_post_init__(self) -> None:
        base = self.base
        self.cursor, self.last_run, self.last_tick = base.cursor, base.last_run, base.last_tick
        self.buffer = list(base.buffer)
        self.backfills = list(base.backfills)
        self.counts = attrs.asdict(base.counts)
        self.recent = list(base.recent)

    @property
    def running(self) -> bool:
        """Whether the schedule's last run still runs."""
        return self.runs(self.last_run)

    def runs(self, execution_id: str | None) -> bool:
        """Whether a run still runs (False for none)."""
        if execution_id is None:
            return False
        if execution_id not in self.known:
            self.known[execution_id] = self.ask_running(execution_id)
        return self.known[execution_id]

    @property
    def busy(self) -> bool:
        """Whether this decision is done deciding: it owes as much as one may, or it
        started or cancelled a run that the next tick's policy must see the outcome of."""
        return self.halted or len(self.starts) + len(self.cancels) >= MAX_ACTIONS

    # -- what a tick can come to ---------------------------------------------------

    def start(self, waiting: Waiting, overlap: str) -> None:
        self.starts.append(waiting)
        self.last_run, self.last_tick = waiting.run_id, waiting.tick
        self.known[waiting.run_id] = True
        self.halted = self.halted or overlap != "allow_all"
        self._note("started", waiting)

    def skip(self, waiting: Waiting) -> None:
        self._note("skipped", waiting)

    def hold(self, waiting: Waiting) -> None:
        self.buffer.append(waiting)
        self._note("buffered", waiting)

    def end_last(self, how: str, overlap: str, by: Waiting) -> None:
        """Cancel (or terminate) the last run, for a tick that replaces it."""
        last = self.last_run
        if last is None or any(run == last for run, _ in self.cancels):
            return
        reason = f"schedule {self.name!r} ({overlap}): {how} by the tick of {by.run_id}"
        self.cancels.append((last, reason))
        self.halted = True
        self._note(how, Waiting(last, by.tick if self.last_tick is None else self.last_tick))

    def arrive(self, waiting: Waiting, overlap: str) -> None:
        """A tick (or a trigger, or a backfilled tick) to start, as `overlap` says."""
        if overlap == "allow_all" or not self.running:
            self.start(waiting, overlap)
        elif overlap == "skip":
            self.skip(waiting)
        elif overlap == "buffer_one":
            self.hold(waiting) if not self.buffer else self.skip(waiting)
        elif overlap == "buffer_all":
            self.hold(waiting) if len(self.buffer) < BUFFER_LIMIT else self.skip(waiting)
        elif overlap == "cancel_other":
            self.end_last("cancelled", overlap, waiting)
            for replaced in self.buffer:  # only the newest waits for the cancel
                self.skip(replaced)
            self.buffer = []
            self.hold(waiting)
        else:  # terminate_other: the new run does not wait for the old one to end
            self.end_last("terminated", overlap, waiting)
            self.start(waiting, overlap)

    def _note(self, did: str, waiting: Waiting, count: int = 1) -> None:
        self.counts[did] = self.counts.get(did, 0) + count
        self._remember(Action(self.now, did, waiting.tick, waiting.run_id, count))

    def _remember(self, action: Action) -> None:
        self.recent.append(action)
        if len(self.recent) > 2 * RECENT:  # a catch-up may skip a million ticks
            del self.recent[:-RECENT]
        self.changed = True

    def note_many(self, did: str, count: int, last_tick: float) -> None:
        """Ticks counted, not started one by one (missed ones, those that came while
        paused): one action for all."""
        if count:
            self.counts[did] = self.counts.get(did, 0) + count
            self._remember(Action(self.now, did, last_tick, None, count))

    # -- the sources of ticks -------------------------------------------------------

    def start_buffered(self) -> None:
        """The oldest buffered tick starts once the last run has ended; under
        `allow_all` (a policy changed while ticks waited) every one starts at once."""
        overlap = self.base.spec.overlap
        while self.buffer and not self.busy and (overlap == "allow_all" or not self.running):
            self.start(self.buffer.pop(0), overlap)

    def regular_ticks(self) -> None:
        """The ticks due by now: missed past the catch-up window, else arrived."""
        spec, name, now = self.base.spec, self.name, self.now
        ticks: Iterator[float] = spec.ticks_after(self.cursor)
        tick = next(ticks, None)
        missed, looked = 0, 0
        while tick is not None and looked < MAX_TICKS and not self.busy:
            following = next(ticks, None)
            due = spec.due_at(name, tick, tick if following is None else following)
            if due > now:
                break
            looked += 1
            if now - due > spec.catchup_window:
                missed += 1
            else:
                self.note_many("missed", missed, self.cursor)
                missed = 0
                self.arrive(Waiting(run_id(name, tick), tick), spec.overlap)
            self.cursor, tick = tick, following
            self.changed = True
        self.note_many("missed", missed, self.cursor)

    def backfill(self, exists: Callable[[str], bool]) -> None:
        """The backfills' ticks, oldest backfill first; with `buffer_all` a tick waits
        (unlooked at) until the run before it ended. A tick whose run exists is not
        started again."""
        kept: list[Backfill] = []
        for index, fill in enumerate(self.backfills):
            if self.busy:
                kept.extend(self.backfills[index:])
                break
            moved, done = self._fill(fill, exists)
            if moved != fill or done:
                self.changed = True
            if not done:
                kept.append(moved)
        self.backfills = kept

    def _fill(self, fill: Backfill, exists: Callable[[str], bool]) -> tuple[Backfill, bool]:
        """Go on with one backfill; where it is now, and whether it is done. With
        `buffer_all`, each tick waits for the run the backfill started before it."""
        cursor, last_run = fill.cursor, fill.last_run
        for looked, tick in enumerate(self.base.spec.ticks_after(fill.cursor)):
            if tick >= fill.end:
                return attrs.evolve(fill, cursor=cursor, last_run=last_run), True
            if self.busy or looked >= MAX_BACKFILL_LOOKS:
                break
            waiting = Waiting(run_id(self.name, tick), tick)
            if exists(waiting.run_id) or any(s.run_id == waiting.run_id for s in self.starts):
                self._note("already_ran", waiting)
            elif fill.overlap == "buffer_all":
                if self.runs(last_run):
                    break  # waits, unlooked at, for the run before it
                self.start(waiting, fill.overlap)
                last_run = waiting.run_id
            else:
                self.arrive(waiting, fill.overlap)
            cursor = tick
        return attrs.evolve(fill, cursor=cursor, last_run=last_run), False

    def state(self) -> ScheduleState:
        """The next state: what was decided, and what it owes."""
        return attrs.evolve(
            self.base,
            updated_at=self.now,
            cursor=self.cursor,
            last_run=self.last_run,
            last_tick=self.last_tick,
            buffer=tuple(self.buffer),
            backfills=tuple(self.backfills),
            pending=Pending(tuple(self.starts), tuple(self.cancels)),
            counts=Counts(**self.counts),
            recent=tuple(self.recent[-RECENT:]),
        )


def advance(
    name: str,
    state: ScheduleState,
    now: float,
    *,
    running: Callable[[str], bool],
    exists: Callable[[str], bool],
) -> ScheduleState | None:
    """The state after deciding what is due by `now`, or None when nothing is.

    Args:
        name: the schedule's name.
        state: its state, whose `pending` has been done.
        now: the time, by the deciding engine's clock.
        running: whether a run still runs (asked only where a policy needs it).
        exists: whether a run of that id exists (a backfilled tick that ran is not
            started again).
    """
    if state.deleted or state.paused:
        return None
    decider = Decider(name, state, now, running)
    decider.start_buffered()
    decider.regular_ticks()
    decider.backfill(exists)
    return decider.state() if decider.changed else None
