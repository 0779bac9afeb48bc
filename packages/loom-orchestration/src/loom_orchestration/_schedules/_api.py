"""The schedule API: create, change, pause, trigger, backfill, delete, and read them.

Every function takes the engine whose store holds the schedules and whose clock
says what time it is; a schedule's runs start on that engine (or, when it has no
code of the schedule's flow, wait for a worker that has it).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import attrs
from loom_kernel import (
    Engine,
    Flow,
    InvalidArgumentError,
    LoomError,
    NotFoundError,
    SchemaError,
)

from loom_orchestration._schedules import _book
from loom_orchestration._schedules._decide import ticks_between
from loom_orchestration._schedules._firing import change, fire_schedule, trigger
from loom_orchestration._schedules._spec import (
    DEFAULT_CATCHUP_WINDOW,
    MAX_SECONDS,
    MIN_CATCHUP_WINDOW,
    OVERLAP_POLICIES,
    ScheduleSpec,
    check_name,
    seconds,
)
from loom_orchestration._schedules._state import (
    RECENT,
    Action,
    Backfill,
    Counts,
    Pending,
    ScheduleState,
)

__all__ = [
    "ScheduleExistsError",
    "ScheduleInfo",
    "ScheduleNotFoundError",
    "backfill_schedule",
    "create_schedule",
    "delete_schedule",
    "get_schedule",
    "list_schedules",
    "pause_schedule",
    "scan_schedules",
    "trigger_schedule",
    "unpause_schedule",
    "update_schedule",
]

logger = logging.getLogger("loom")

#: How many next ticks `get_schedule` lists.
NEXT_TICKS: Final = 5
#: The most ticks counted as having come while a schedule was paused.
_MOST_PAUSED_TICKS: Final = 10_000_000
_UNSET: Final[Any] = object()


class ScheduleNotFoundError(NotFoundError):
    """No schedule of that name exists (or it was deleted)."""


class ScheduleExistsError(LoomError):
    """A schedule of that name exists already (delete it first, or change it)."""


@attrs.frozen
class ScheduleInfo:
    """A schedule as `get_schedule` and `list_schedules` show it.

    Attributes:
        name: its name.
        flow: the flow each tick starts.
        cron: its cron expression, read in `timezone`.
        input: what each run receives as `input["input"]`.
        overlap: what a tick does while the last run still runs.
        catchup_window: how late a tick may be fired and still start.
        jitter: the most a tick is delayed by.
        timezone: the IANA zone of `cron`.
        paused: whether its ticks are held; `note` says why, if anyone said.
        next_ticks: its next ticks (nominal, in UTC), none while paused.
        last_run: the id of the run it started last; `last_tick` that run's tick.
        counts: started, skipped, missed, buffered, cancelled, terminated, paused
            and already-ran ticks since it was created.
        buffered: the ids of the runs waiting for the last run to end.
        backfills: how many backfills are still going on.
        recent: its last actions, newest last.
        created_at: when it was created; `updated_at` when it last changed.
    """

    name: str
    flow: str
    cron: str
    input: Any
    overlap: str
    catchup_window: timedelta
    jitter: timedelta
    timezone: str
    paused: bool
    note: str | None
    next_ticks: tuple[datetime, ...]
    last_run: str | None
    last_tick: datetime | None
    counts: Counts
    buffered: tuple[str, ...]
    backfills: int
    recent: tuple[Action, ...]
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, name: str, state: ScheduleState) -> ScheduleInfo:
        """The view of a schedule's state."""
        spec, moment = state.spec, _moment
        upcoming: list[datetime] = []
        if not state.paused:
            for tick in spec.ticks_after(state.cursor):
                upcoming.append(moment(tick))
                if len(upcoming) == NEXT_TICKS:
                    break
        return cls(
            name=name,
            flow=spec.flow,
            cron=spec.cron,
            input=spec.input,
            overlap=spec.overlap,
            catchup_window=timedelta(seconds=spec.catchup_window),
            jitter=timedelta(seconds=spec.jitter),
            timezone=spec.timezone,
            paused=state.paused,
            note=state.note,
            next_ticks=tuple(upcoming),
            last_run=state.last_run,
            last_tick=None if state.last_tick is None else moment(state.last_tick),
            counts=state.counts,
            buffered=tuple(waiting.run_id for waiting in state.buffer),
            backfills=len(state.backfills),
            recent=state.recent,
            created_at=moment(state.created_at),
            updated_at=moment(state.updated_at),
        )


def _moment(seconds_since_epoch: float) -> datetime:
    return datetime.fromtimestamp(seconds_since_epoch, UTC)


def _flow_name(flow: str | Flow) -> str:
    return flow.name if isinstance(flow, Flow) else flow


def _note(note: object) -> str | None:
    if note is not None and not isinstance(note, str):
        raise InvalidArgumentError(f"a note is a str, not {note!r}")
    return note


def _existing(name: str) -> Any:
    """`make` for a change of an existing schedule: its state, or the error."""

    def state_of(state: ScheduleState | None) -> ScheduleState:
        if state is None or state.deleted:
            raise ScheduleNotFoundError(f"no schedule {name!r}")
        return state

    return state_of


def create_schedule(
    engine: Engine,
    name: str,
    flow: str | Flow,
    *,
    cron: str,
    input: Any = None,
    overlap: str = "skip",
    catchup_window: timedelta | float = DEFAULT_CATCHUP_WINDOW,
    jitter: timedelta | float = 0,
    timezone: str = "UTC",
    paused: bool = False,
    note: str | None = None,
) -> ScheduleInfo:
    """Create a schedule: from now on, each tick of `cron` (read in `timezone`) starts
    a run of `flow` with id `sched/<name>@<tick in UTC, ISO 8601>`, which receives
    `{"schedule": name, "tick": <that tick>, "input": input}`.

    Args:
        engine: the engine whose store keeps the schedule and whose clock it runs by.
        name: the schedule's name (an id segment, no '/' or '@').
        flow: the flow (or its name; the engine need not have its code).
        cron: five fields (minute hour day month weekday), or six with seconds first;
            `L` and `#` as Debian cron.
        input: JSON, passed to every run.
        overlap: what a tick does while the last run still runs: `skip`, `buffer_one`,
            `buffer_all`, `cancel_other`, `terminate_other` or `allow_all`.
        catchup_window: how late a tick may be fired (no worker ran, say) and still
            start; later ones are counted as missed. At least one second.
        jitter: each tick is started up to this much late (never past the next tick),
            by the same amount in every process.
        timezone: the IANA zone the cron expression is read in.
        paused: create it paused.
        note: why (shown by `describe`).

    Raises:
        ScheduleExistsError: a schedule of that name exists.
        InvalidArgumentError, InvalidIdError: an argument is not valid.
    """
    name = check_name(name)
    spec = ScheduleSpec(
        flow=_flow_name(flow),
        cron=cron,
        input=input,
        overlap=overlap,
        catchup_window=seconds(catchup_window, "catchup_window", least=MIN_CATCHUP_WINDOW),
        jitter=seconds(jitter, "jitter"),
        timezone=timezone,
    )
    if not isinstance(paused, bool):
        raise InvalidArgumentError(f"paused is a bool, not {paused!r}")
    note = _note(note)

    def make(state: ScheduleState | None) -> ScheduleState:
        if state is not None and not state.deleted:
            raise ScheduleExistsError(f"a schedule {name!r} exists already")
        now = engine.clock()
        # A schedule of that name deleted before decided its ticks up to its cursor,
        # whose runs have the ids this one's would: never decide them again (another
        # engine's clock may be behind the deleting one's).
        cursor = now if state is None else max(now, state.cursor)
        return ScheduleState(spec, now, now, cursor, paused=paused, note=note)

    return ScheduleInfo.of(name, change(engine, name, make))


def update_schedule(
    engine: Engine,
    name: str,
    *,
    flow: str | Flow | None = None,
    cron: str | None = None,
    input: Any = _UNSET,
    overlap: str | None = None,
    catchup_window: timedelta | float | None = None,
    jitter: timedelta | float | None = None,
    timezone: str | None = None,
) -> ScheduleInfo:
    """Change what a schedule starts or when; what is not given stays. Ticks already
    decided stay decided; the next tick is the new expression's first after them.

    Raises:
        ScheduleNotFoundError: no schedule of that name.
        InvalidArgumentError: a new value is not valid.
    """
    name = check_name(name)
    changes: dict[str, Any] = {}
    if flow is not None:
        changes["flow"] = _flow_name(flow)
    for key, value in (("cron", cron), ("overlap", overlap), ("timezone", timezone)):
        if value is not None:
            changes[key] = value
    if input is not _UNSET:
        changes["input"] = input
    if catchup_window is not None:
        changes["catchup_window"] = seconds(
            catchup_window, "catchup_window", least=MIN_CATCHUP_WINDOW
        )
    if jitter is not None:
        changes["jitter"] = seconds(jitter, "jitter")
    state_of = _existing(name)

    def make(state: ScheduleState | None) -> ScheduleState:
        state = state_of(state)
        spec = attrs.evolve(state.spec, **changes)
        return attrs.evolve(state, spec=spec, pending=Pending(), updated_at=engine.clock())

    return ScheduleInfo.of(name, change(engine, name, make))


def pause_schedule(engine: Engine, name: str, note: str | None = None) -> ScheduleInfo:
    """Hold a schedule's ticks (and its buffered ticks and backfills) until it is
    unpaused; the ticks that come meanwhile are counted as `paused`, never started.

    Raises:
        ScheduleNotFoundError: no schedule of that name.
    """
    name, note = check_name(name), _note(note)
    state_of = _existing(name)

    def make(state: ScheduleState | None) -> ScheduleState:
        state = state_of(state)
        return attrs.evolve(
            state, paused=True, note=note, pending=Pending(), updated_at=engine.clock()
        )

    return ScheduleInfo.of(name, change(engine, name, make))


def unpause_schedule(engine: Engine, name: str, note: str | None = None) -> ScheduleInfo:
    """Let a paused schedule tick again, from its first tick after now (those that
    came while it was paused are counted as `paused`).

    Raises:
        ScheduleNotFoundError: no schedule of that name.
    """
    name, note = check_name(name), _note(note)
    state_of = _existing(name)

    def make(state: ScheduleState | None) -> ScheduleState:
        state = state_of(state)
        now = engine.clock()
        if not state.paused:
            return attrs.evolve(state, note=note, pending=Pending(), updated_at=now)
        held, _last = ticks_between(state.spec, state.cursor, now, _MOST_PAUSED_TICKS)
        counts = attrs.evolve(state.counts, paused=state.counts.paused + held)
        recent = state.recent
        if held:
            recent = (*recent, Action(now, "paused", now, None, held))[-RECENT:]
        return attrs.evolve(
            state,
            paused=False,
            note=note,
            cursor=max(state.cursor, now),
            counts=counts,
            recent=recent,
            pending=Pending(),
            updated_at=now,
        )

    return ScheduleInfo.of(name, change(engine, name, make))


def delete_schedule(engine: Engine, name: str) -> None:
    """Delete a schedule: no tick of it starts again (what its last decision owed is
    done first); the runs it started are left as they are. Its name may be used again.
    A schedule whose record is damaged is deleted too (what it owed is then lost).

    Raises:
        ScheduleNotFoundError: no schedule of that name.
    """
    name = check_name(name)
    state_of = _existing(name)

    def make(state: ScheduleState | None) -> ScheduleState:
        state = state_of(state)
        return attrs.evolve(state, deleted=True, pending=Pending(), updated_at=engine.clock())

    try:
        change(engine, name, make)
    except SchemaError as exc:
        logger.warning("loom: schedule %s is damaged (%s): deleted with a tombstone", name, exc)
        _book.bury(engine.store, name, engine.clock())


def get_schedule(engine: Engine, name: str) -> ScheduleInfo:
    """A schedule: its spec, next ticks, last run, counts and recent actions.

    Raises:
        ScheduleNotFoundError: no schedule of that name.
    """
    name = check_name(name)
    _head, state = _book.read(engine.store, name)
    return ScheduleInfo.of(name, _existing(name)(state))


def list_schedules(engine: Engine) -> list[ScheduleInfo]:
    """Every schedule in the engine's store, by name. One whose record is damaged is
    left out and logged (`get_schedule` raises its error; `delete_schedule` removes
    it); use `scan_schedules` to have the errors.

    Raises:
        LoomError: the store could not be listed.
    """
    found = []
    for name, info in scan_schedules(engine):
        if isinstance(info, LoomError):
            logger.warning("loom: schedule %s not listed: %s", name, info)
        else:
            found.append(info)
    return found


def scan_schedules(engine: Engine) -> list[tuple[str, ScheduleInfo | LoomError]]:
    """Every schedule in the engine's store, by name: its info, or the error that
    reading it raised (a damaged record)."""
    found: list[tuple[str, ScheduleInfo | LoomError]] = []
    for name in _book.names(engine.store):
        try:
            _head, state = _book.read(engine.store, name)
        except LoomError as exc:
            found.append((name, exc))
            continue
        if state is not None and not state.deleted:
            found.append((name, ScheduleInfo.of(name, state)))
    return found


def trigger_schedule(engine: Engine, name: str, *, overlap: str | None = None) -> str | None:
    """Start one run of a schedule now (its tick: the time now, to the millisecond), as
    `overlap` says (the schedule's own policy by default; `allow_all` to start it
    whatever runs). A paused schedule may be triggered.

    Returns:
        The run's id, or None when the policy skipped it (or buffered it: it starts
        once the last run ends).

    Raises:
        ScheduleNotFoundError: no schedule of that name.
        InvalidArgumentError: `overlap` is not a policy.
    """
    name = check_name(name)
    if overlap is not None and overlap not in OVERLAP_POLICIES:
        raise InvalidArgumentError(
            f"overlap is one of {', '.join(OVERLAP_POLICIES)}, not {overlap!r}"
        )
    return trigger(engine, name, overlap, _existing(name))


def _instant(value: object, what: str) -> float:
    """An instant given as an aware datetime or Unix seconds, within a century of 1970."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidArgumentError(f"{what} is an aware datetime (say its zone), not {value!r}")
        value = value.timestamp()
    elif isinstance(value, (timedelta, bool)):
        raise InvalidArgumentError(f"{what} is an aware datetime or Unix seconds, not {value!r}")
    try:
        return seconds(value, what, least=-MAX_SECONDS)
    except InvalidArgumentError:
        raise InvalidArgumentError(
            f"{what} is an aware datetime or Unix seconds within a century of 1970, not {value!r}"
        ) from None


def backfill_schedule(
    engine: Engine,
    name: str,
    start: datetime | float,
    end: datetime | float,
    overlap: str = "buffer_all",
) -> list[str]:
    """Run a schedule's ticks of `[start, end)` (up to now), whatever its catch-up
    window says, as `overlap` says: with `buffer_all` one after another, each once the
    run before it ended. A tick whose run exists (it ran, or an earlier backfill ran
    it) is not started again, so the same backfill twice starts nothing new.

    Returns:
        The ids of the runs this call started: with `buffer_all`, the first, and the
        ones after it whose turn came within the call (runs driven inline that ended).

    Raises:
        ScheduleNotFoundError: no schedule of that name.
        InvalidArgumentError: the range is empty, or an argument is not valid.
    """
    name = check_name(name)
    if overlap not in OVERLAP_POLICIES:
        raise InvalidArgumentError(
            f"overlap is one of {', '.join(OVERLAP_POLICIES)}, not {overlap!r}"
        )
    first, last = _instant(start, "start"), _instant(end, "end")
    last = min(last, engine.clock())
    if first >= last:
        raise InvalidArgumentError(
            f"a backfill needs start < end (and start before now): {start!r}, {end!r}"
        )
    state_of = _existing(name)

    def make(state: ScheduleState | None) -> ScheduleState:
        state = state_of(state)
        fill = Backfill(first, last, overlap, first - 0.001)
        return attrs.evolve(
            state, backfills=(*state.backfills, fill), pending=Pending(), updated_at=engine.clock()
        )

    change(engine, name, make)
    return fire_schedule(engine, name)[0]
