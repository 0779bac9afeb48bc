"""Firing schedules: read a schedule, do what its last decision owes, decide what is
due, append that decision at the head it was read at, then do what it owes.

Exactly once per tick, however many processes fire: a decision is an append at the
exact head (one process wins, the others read again and find nothing left to
decide), and what it owes is done by its writer and again by whoever reads it next,
each action happening once whatever the repeats (a start is by the tick's id, K9;
a cancel of a cancelled run changes nothing). A record is only ever superseded by a
writer that did what it owed first, so a crash between a decision and its actions
loses nothing: the next reader does them.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, Final

import attrs
from loom_kernel import (
    ConflictError,
    Engine,
    Execution,
    ExecutionNotFoundError,
    LoomError,
    StreamDeletedError,
)

from loom_orchestration._schedules import _book
from loom_orchestration._schedules._decide import Decider, advance
from loom_orchestration._schedules._spec import check_name, run_id, schedule_of
from loom_orchestration._schedules._state import Pending, ScheduleState, Waiting

__all__ = [
    "change",
    "do_pending",
    "fire_due_schedules",
    "fire_schedule",
    "on_run_settled",
    "running",
    "trigger",
]

logger = logging.getLogger("loom")

#: The most decisions one fire of one schedule makes where no bound is given: each
#: moves the schedule on, so this is only a guard against a bug that would not.
_MOST_DECISIONS: Final = 10_000_000
#: How often a change is tried again when another process changed the schedule first.
_CHANGE_ATTEMPTS: Final = 32
#: The runs started by the outermost fire of this flow of control: a run started inline
#: ends, and its listener fires the schedule again (the next buffered tick, say)
#: inside the first fire's call.
_STARTED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "loom_schedule_starts", default=None
)
#: The schedules whose fire, in this flow of control, is starting runs now.
_FIRING: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "loom_schedules_firing", default=frozenset()
)


@contextmanager
def _firing(name: str) -> Iterator[None]:
    """While a fire of `name` starts its runs: a run that ends inline in the start
    is seen by the fire's next decision, so the listener need not fire it again."""
    token = _FIRING.set(_FIRING.get() | {name})
    try:
        yield
    finally:
        _FIRING.reset(token)


@contextmanager
def collecting() -> Iterator[list[str]]:
    """The runs the fires inside started: this call's own and its listeners'."""
    outer = _STARTED.get()
    if outer is not None:
        yield outer
        return
    started: list[str] = []
    token = _STARTED.set(started)
    try:
        yield started
    finally:
        _STARTED.reset(token)


def run_input(name: str, waiting: Waiting, value: Any) -> dict[str, Any]:
    """What a scheduled run receives: its schedule, its nominal tick as its id names
    it (never the jittered time it was started at) and the schedule's input."""
    return {"schedule": name, "tick": waiting.run_id.rpartition("@")[2], "input": value}


def do_pending(engine: Engine, name: str, state: ScheduleState) -> None:
    """Do what a decision owes: cancel the runs it ends, then start the runs it starts
    (by their ids: a run that exists is not started again)."""
    pending = state.pending
    for execution_id, reason in pending.cancels:
        try:
            engine.cancel(execution_id, reason)
        except ExecutionNotFoundError:  # deleted since (retention): nothing to end
            continue
    exists = _exists(engine)
    for waiting in pending.starts:
        if exists(waiting.run_id):
            continue  # started (by a decision redone after a crash), maybe deleted since
        try:
            engine.dispatch(
                state.spec.flow, run_input(name, waiting, state.spec.input), key=waiting.run_id
            )
        except ExecutionNotFoundError:  # it ran, and was deleted since (retention)
            continue


def running(engine: Engine, execution_id: str) -> bool:
    """Whether a schedule's last run still runs (parked counts: it has not ended)."""
    try:
        return not engine.get(execution_id).status.finished
    except ExecutionNotFoundError:
        return False


def _exists(engine: Engine) -> Callable[[str], bool]:
    def exists(execution_id: str) -> bool:
        try:
            return engine.store.head(engine.stream_of(execution_id)) > 0
        except StreamDeletedError:  # it ran, and retention deleted it
            return True

    return exists


def fire_schedule(
    engine: Engine, name: str, most: int | None = None, budget: float | None = None
) -> tuple[list[str], ScheduleState | None]:
    """Decide and start what one schedule has due by the engine's clock (in at most
    `most` decisions: a worker's poll leaves the rest to its next); the ids of the
    runs started by this call (inline runs that ended let the next start in the same
    call, through the listener), and the schedule's state after it, with nothing
    owed (None for one that does not exist or was deleted).

    Raises:
        LoomError: the store failed, or the schedule's record is damaged; what was
            appended before stays decided, and what it owes is done at the next fire.
    """
    with collecting() as started:
        until = None if budget is None else time.monotonic() + budget
        state = _decide(engine, name, started, _MOST_DECISIONS if most is None else most, until)
        if state is not None:
            state = attrs.evolve(state, pending=Pending())  # this call did what it owed
        return list(started), state


def _decide(
    engine: Engine, name: str, started: list[str], most: int, until: float | None
) -> ScheduleState | None:
    store = engine.store
    done: int | None = None  # the head whose owed actions this call did
    state: ScheduleState | None = None
    for _ in range(most):
        if done is None or state is None:
            head, state = _book.read(store, name)
            if state is None or state.deleted:
                return None
            if head != done:
                do_pending(engine, name, state)
        else:
            # What this call appended last, and did: the head it knows. If another
            # process appended since, the append below conflicts and it reads again.
            head = done
        decided = advance(
            name,
            state,
            engine.clock(),
            running=partial(running, engine),
            exists=_exists(engine),
        )
        if decided is None:
            return state
        try:
            done = _book.write(store, name, head, decided)
        except ConflictError:
            done = state = None
            continue  # another process decided first: read what it decided
        missed = decided.counts.missed - state.counts.missed
        if missed:
            logger.warning(
                "loom: schedule %s: %d tick(s) missed, due longer ago than its catch-up "
                "window (%g s); decided up to %s",
                name,
                missed,
                decided.spec.catchup_window,
                run_id(name, decided.cursor).rpartition("@")[2],
            )
        state = decided
        started.extend(waiting.run_id for waiting in decided.pending.starts)
        with _firing(name):
            do_pending(engine, name, decided)
        if until is not None and time.monotonic() >= until:
            break  # the rest at the next fire
    return state


def change(
    engine: Engine, name: str, make: Callable[[ScheduleState | None], ScheduleState]
) -> ScheduleState:
    """Append `make(state)` as a schedule's next state, after doing what its current
    state owes; tried again (read afresh) while other processes change it first.

    Raises:
        LoomError: what `make` raises (the schedule does not exist, say), or the
            store failed.
    """
    store = engine.store
    for _ in range(_CHANGE_ATTEMPTS):
        head, state = _book.read(store, name)
        if state is not None and not state.deleted:
            do_pending(engine, name, state)
        made = make(state)
        try:
            _book.write(store, name, head, made)
        except ConflictError:
            continue
        _book.notice(store, name, made.updated_at)
        do_pending(engine, name, made)
        return made
    raise ConflictError(_book.stream_of(name), head, head + 1)


def trigger(
    engine: Engine,
    name: str,
    overlap: str | None,
    state_of: Callable[[ScheduleState | None], ScheduleState],
) -> str | None:
    """Start one run of a schedule now, as `overlap` (or its own policy) says; the
    run's id, or None when the policy skipped or buffered it."""
    outcome: list[str | None] = [None]

    def make(state: ScheduleState | None) -> ScheduleState:
        state = state_of(state)
        now = engine.clock()
        tick = round(now, 3)
        taken = {w.run_id for w in (*state.buffer, *state.pending.starts)}
        exists = _exists(engine)
        while run_id(name, tick, trigger=True) in taken or exists(run_id(name, tick, trigger=True)):
            tick = round(tick + 0.001, 3)  # two triggers in one millisecond: two runs
        decider = Decider(name, state, now, partial(running, engine))
        waiting = Waiting(run_id(name, tick, trigger=True), tick)
        decider.arrive(waiting, overlap or state.spec.overlap)
        made = decider.state()
        outcome[0] = made.pending.starts[0].run_id if made.pending.starts else None
        return made

    change(engine, name, make)
    return outcome[0]


def fire_due_schedules(engine: Engine) -> list[str]:
    """Fire every schedule in the engine's store: start what each has due by the
    engine's clock (as every worker does on its polls; call this where no worker
    runs). Returns the ids of the runs it started.

    A schedule that cannot be fired (a damaged record, a store fault, a bug) is
    logged and the others are fired; the first such error is raised after them all.
    """
    failures: list[Exception] = []
    with collecting() as started:
        for name in _book.names(engine.store):
            try:
                fire_schedule(engine, name)
            except Exception as exc:  # one schedule never stops the others
                logger.warning("loom: schedule %s not fired: %s: %s", name, type(exc).__name__, exc)
                failures.append(exc)
        if failures:
            raise failures[0]
        return list(started)


def on_run_settled(engine: Engine, execution: Execution) -> None:
    """The listener: a scheduled run that ended may let a buffered tick (or the next
    tick of a backfill) start at once, rather than at the next poll."""
    if not execution.status.finished:
        return
    name = schedule_of(execution.id)
    if name is None or name in _FIRING.get():
        return
    try:
        check_name(name)
        fire_schedule(engine, name)
    except LoomError as exc:  # the next poll fires it
        logger.warning("loom: schedule %s not fired after %s ended: %s", name, execution.id, exc)
