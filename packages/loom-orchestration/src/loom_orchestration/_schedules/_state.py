"""A schedule's state: its spec, where its ticks are decided up to, its last run, the
ticks waiting in its buffer, its backfills, the actions its last decision still owes
(runs to start, runs to cancel), its counts and its recent actions.

Every record of a schedule's stream holds the whole state, so reading the last
record is reading the schedule, and the stream can be trimmed below it at any time.
"""

from __future__ import annotations

import json
from typing import Any, Final

import attrs
import cattrs
from loom_kernel import InvalidArgumentError, SchemaError
from loom_kernel.events import stable_stringify

from loom_orchestration._schedules._spec import ScheduleSpec

__all__ = [
    "RECENT",
    "Action",
    "Backfill",
    "Counts",
    "Pending",
    "ScheduleState",
    "Waiting",
    "decode_state",
    "encode_state",
]

#: How many recent actions a schedule keeps for `describe`.
RECENT: Final = 20
_FORMAT: Final = 1


@attrs.frozen
class Counts:
    """What a schedule's ticks came to, since it was created.

    Attributes:
        started: runs started (ticks, buffered ticks, triggers, backfills).
        skipped: ticks not started because of the overlap policy (or a full buffer).
        missed: ticks that came due longer ago than the catch-up window when fired.
        buffered: ticks that waited in the buffer for the last run to end.
        cancelled: runs cancelled by a later tick (`cancel_other`).
        terminated: runs terminated by a later tick (`terminate_other`).
        paused: ticks that came while the schedule was paused.
        already_ran: backfilled ticks whose run existed already (not started again).
    """

    started: int = 0
    skipped: int = 0
    missed: int = 0
    buffered: int = 0
    cancelled: int = 0
    terminated: int = 0
    paused: int = 0
    already_ran: int = 0


@attrs.frozen
class Waiting:
    """A tick and the id of its run: waiting in the buffer, or owed a start."""

    run_id: str
    tick: float


@attrs.frozen
class Backfill:
    """A backfill still running: the ticks of `[start, end)` after `cursor`, started
    as `overlap` says (with `buffer_all`, each once the run before it ended)."""

    start: float
    end: float
    overlap: str
    cursor: float
    last_run: str | None = None  # the run it started last (`buffer_all` waits for it)


@attrs.frozen
class Action:
    """One thing a schedule did, for `describe`: `did` is started, skipped, buffered,
    missed (with `count` ticks), cancelled, terminated, already_ran, paused."""

    at: float
    did: str
    tick: float | None = None
    run_id: str | None = None
    count: int = 1


@attrs.frozen
class Pending:
    """What the last decision still owes, done by whoever reads it next (again, if
    it was done already: a start by its id and a cancel both happen once)."""

    starts: tuple[Waiting, ...] = ()
    cancels: tuple[tuple[str, str], ...] = ()  # (run id, reason)


@attrs.frozen
class ScheduleState:
    """A schedule, as its last record says.

    Attributes:
        spec: what it starts and when.
        created_at: when it was created (the engine's clock).
        updated_at: when its last record was written.
        cursor: the last tick decided (started, skipped, buffered or missed); its
            creation time before its first.
        paused: whether its ticks are held; `note` says why, if anyone said.
        deleted: a deleted schedule's last record (its name may be used again).
        last_run: the run it started last, which its overlap policy looks at.
        last_tick: that run's tick.
        buffer: the ticks waiting for the last run to end, oldest first.
        backfills: the backfills not done yet, oldest first.
        pending: what its last decision still owes.
        counts: what its ticks came to.
        recent: its last actions, newest last.
    """

    spec: ScheduleSpec
    created_at: float
    updated_at: float
    cursor: float
    paused: bool = False
    note: str | None = None
    deleted: bool = False
    last_run: str | None = None
    last_tick: float | None = None
    buffer: tuple[Waiting, ...] = ()
    backfills: tuple[Backfill, ...] = ()
    pending: Pending = Pending()
    counts: Counts = Counts()
    recent: tuple[Action, ...] = ()


_converter = cattrs.Converter(forbid_extra_keys=True)


def encode_state(state: ScheduleState) -> bytes:
    """The record payload of a state: canonical JSON.

    Raises:
        InvalidArgumentError: the schedule's input has no JSON form.
    """
    data = {"format": _FORMAT, "state": _converter.unstructure(state)}
    try:
        return stable_stringify(data).encode()
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"a schedule's input and note must be JSON: {exc}") from None


def decode_state(payload: bytes, where: str) -> ScheduleState:
    """The state a record holds.

    Raises:
        SchemaError: the record is not a schedule state this version reads.
    """
    try:
        data: Any = json.loads(payload)
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"not a schedule record of format {_FORMAT}")
        return _converter.structure(data["state"], ScheduleState)
    except cattrs.BaseValidationError as exc:
        reasons = "; ".join(cattrs.transform_error(exc, path="state"))
        raise SchemaError(f"{where}: a damaged schedule record: {reasons}") from None
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise SchemaError(f"{where}: a damaged schedule record: {exc}") from None
