"""Where schedules live: one stream each, `schedules/<name>`, whose last record is the
schedule's whole state. A change is an append at the head it was decided on, so of
two processes deciding at once one wins and the other decides again; the stream is
trimmed below its last record now and then (every record holds everything).

Beside them, one stream of notices, `schedule-notices`: each change made through the
API (create, update, pause, unpause, delete, trigger, backfill) appends the name it
changed, so a worker learns of a change made elsewhere by reading that stream past
the last notice it saw (one request on S3 when nothing changed) instead of listing
every schedule. A decision appends no notice: it moves no other worker's due time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Final

from loom_kernel import ConflictError, LoomError, StoreUnavailableError
from loom_kernel.spi import JournalStore, NewRecord, TrimmedError

from loom_orchestration._schedules._state import ScheduleState, decode_state, encode_state

__all__ = [
    "KIND",
    "NOTICES",
    "PREFIX",
    "TOMBSTONE_KIND",
    "bury",
    "names",
    "notice",
    "notices_after",
    "read",
    "stream_of",
    "write",
]

logger = logging.getLogger("loom")

PREFIX: Final = "schedules/"
KIND: Final = "loom.schedule"
#: A schedule deleted whose last state could not be read: its name may be used again.
TOMBSTONE_KIND: Final = "loom.schedule_deleted"
#: Trim a schedule's stream below its last record once its head is a multiple of this.
_TRIM_EVERY: Final = 32
_PAGE: Final = 1000
_READ_ATTEMPTS: Final = 8
NOTICES: Final = "schedule-notices"
NOTICE_KIND: Final = "loom.schedule_changed"
#: The notices stream keeps at least this many notices below its head (a worker
#: further behind lists every schedule again); it is trimmed every `_KEEP` notices.
_KEEP: Final = 256
_NOTICE_ATTEMPTS: Final = 16


def stream_of(name: str) -> str:
    """The stream of a schedule."""
    return PREFIX + name


def read(store: JournalStore, name: str) -> tuple[int, ScheduleState | None]:
    """A schedule's head and state (0 and None when it was never created).

    Raises:
        SchemaError: its last record is damaged.
        StoreUnavailableError: the store could not be read.
    """
    stream = stream_of(name)
    for _ in range(_READ_ATTEMPTS):
        head = store.head(stream)
        if head == 0:
            return 0, None
        try:
            records = store.read(stream, head - 1)
        except TrimmedError:  # trimmed past that head since: its newer head is there
            continue
        last = records[-1]
        if last.kind == TOMBSTONE_KIND:
            return last.position, None
        return last.position, decode_state(last.payload, f"{stream} at {last.position}")
    raise StoreUnavailableError(
        f"{stream} was trimmed past its head at each of {_READ_ATTEMPTS} reads; read it again"
    )


def write(store: JournalStore, name: str, expected: int, state: ScheduleState) -> int:
    """Append a schedule's next state at `expected`; its new head.

    Raises:
        ConflictError: another process changed it first (read it again).
        InvalidArgumentError: the state has no JSON form (the input, say).
    """
    stream = stream_of(name)
    head = store.append(stream, expected, [NewRecord(KIND, encode_state(state), state.updated_at)])
    if head % _TRIM_EVERY == 0:
        try:
            store.trim(stream, head)
        except LoomError as exc:  # a later write trims it
            logger.debug("loom: schedule %s not trimmed: %s", name, exc)
    return head


def names(store: JournalStore) -> Iterator[str]:
    """Every schedule's name, deleted ones included (their state says so), sorted."""
    after: str | None = None
    while True:
        page = store.streams(PREFIX, after=after, limit=_PAGE)
        for stream in page:
            yield stream[len(PREFIX) :]
        if len(page) < _PAGE:
            return
        after = page[-1]


def notice(store: JournalStore, name: str, at: float) -> None:
    """Note that schedule `name` changed, for the workers that did not change it. A
    notice that cannot be appended is logged: workers still see the change at their
    next full listing (see `SchedulePoller`)."""
    payload = name.encode()
    try:
        for _ in range(_NOTICE_ATTEMPTS):
            head = store.head(NOTICES)
            try:
                head = store.append(NOTICES, head, [NewRecord(NOTICE_KIND, payload, at)])
            except ConflictError:
                continue
            if head % _KEEP == 0 and head > _KEEP:
                store.trim(NOTICES, head - _KEEP)
            return
        logger.warning("loom: no notice of schedule %s: the notices stream kept moving", name)
    except LoomError as exc:
        logger.warning("loom: no notice of schedule %s: %s: %s", name, type(exc).__name__, exc)


def notices_after(store: JournalStore, position: int) -> tuple[int, set[str]] | None:
    """The notices' head and the names changed after `position`; None when the
    notices from there were trimmed (list every schedule instead).

    Raises:
        StoreUnavailableError: the store could not be read.
    """
    try:
        records = store.read(NOTICES, position)
    except TrimmedError:
        return None
    if not records:
        return position, set()
    return records[-1].position, {record.payload.decode(errors="replace") for record in records}


def bury(store: JournalStore, name: str, at: float) -> None:
    """Delete a schedule whose state cannot be read (a damaged record): a tombstone
    after its last record, whatever that holds.

    Raises:
        ConflictError: the schedule kept changing under every attempt.
    """
    stream = stream_of(name)
    for _ in range(_READ_ATTEMPTS):
        head = store.head(stream)
        try:
            store.append(stream, head, [NewRecord(TOMBSTONE_KIND, b"{}", at)])
        except ConflictError:
            continue
        notice(store, name, at)
        return
    raise ConflictError(stream, head, head + 1)
