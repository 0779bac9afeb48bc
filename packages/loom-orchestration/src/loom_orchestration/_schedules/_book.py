"""Where schedules live: one stream each, `schedules/<name>`, whose last record is the
schedule's whole state. A change is an append at the head it was decided on, so of
two processes deciding at once one wins and the other decides again; the stream is
trimmed below its last record now and then (every record holds everything).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Final

from loom_kernel import LoomError, StoreUnavailableError
from loom_kernel.spi import JournalStore, NewRecord, TrimmedError

from loom_orchestration._schedules._state import ScheduleState, decode_state, encode_state

__all__ = ["KIND", "PREFIX", "names", "read", "stream_of", "write"]

logger = logging.getLogger("loom")

PREFIX: Final = "schedules/"
KIND: Final = "loom.schedule"
#: Trim a schedule's stream below its last record once its head is a multiple of this.
_TRIM_EVERY: Final = 32
_PAGE: Final = 1000
_READ_ATTEMPTS: Final = 8


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
