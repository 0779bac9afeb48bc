"""Where an execution lives in a store: its journal, its snapshot, and how both are read.

An execution's journal is the stream `ex/<id>`; compaction (K10.4) writes a snapshot
of its folded state to `snap/<id>` and then trims the journal below it. Two rules
keep every load whole, however many engines compact at once:

- a snapshot never goes backwards: it is appended only at the head where the latest
  snapshot covers less, so the latest snapshot always covers the most;
- the journal is trimmed only up to a position some snapshot covers, so the latest
  snapshot always reaches at least the journal's trim floor.

A load reads the latest snapshot, then the journal after it. When a compaction
between those two reads moved both on, the journal read meets the new floor and the
load starts again from the newer snapshot.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

from loom_kernel._coordination._inbox import INBOX_PREFIX
from loom_kernel._coordination._published import EVENTS_PREFIX
from loom_kernel._core._errors import (
    ConflictError,
    ExecutionNotFoundError,
    InvalidIdError,
    SchemaError,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
)
from loom_kernel._core._ids import MAX_ID_LENGTH, validate_stream_id
from loom_kernel._core._state import ExecutionState, fold_records
from loom_kernel._spi._journal import JournalStore, NewRecord, Record

__all__ = [
    "EXECUTION_PREFIX",
    "SNAPSHOT_KIND",
    "SNAPSHOT_PREFIX",
    "compact",
    "execution_ids",
    "fresh_execution_id",
    "load",
    "new_execution_id",
    "stream_of",
]

EXECUTION_PREFIX: Final = "ex/"
SNAPSHOT_PREFIX: Final = "snap/"
#: The longest execution id every stream of its run can be named by.
MAX_EXECUTION_ID_LENGTH: Final = MAX_ID_LENGTH - max(
    len(prefix) for prefix in (EXECUTION_PREFIX, SNAPSHOT_PREFIX, INBOX_PREFIX, EVENTS_PREFIX)
)
SNAPSHOT_KIND: Final = "loom.snapshot"
#: Loads restarted because a compaction moved the journal on meanwhile, before giving up.
_LOAD_ATTEMPTS: Final = 16


def stream_of(execution_id: object) -> str:
    """The journal stream of an execution.

    Raises:
        InvalidIdError: the id is not a str, or not a valid stream id.
    """
    if not isinstance(execution_id, str):
        raise InvalidIdError(execution_id, "an execution id is a str")
    try:
        return validate_stream_id(EXECUTION_PREFIX + execution_id)
    except InvalidIdError as exc:
        raise InvalidIdError(execution_id, exc.reason) from None


def fresh_execution_id() -> str:
    """The id of a run started without a key: a version 7 UUID's 32 hex digits (RFC
    9562: the Unix time in milliseconds, then 74 random bits).

    Ids made later sort after earlier ones (within a millisecond, at random), so the
    journals of new runs land side by side in a store that keeps streams in name
    order (SQLite's clustered records b-tree) instead of at random places all over
    it. Nothing relies on that order: a clock that jumps back only costs locality (a
    clock before 1970 counts as 1970).
    """
    millis = max(time.time_ns() // 1_000_000, 0) & _MILLIS
    value = millis << 80 | int.from_bytes(os.urandom(10))
    return f"{value & _UUID7_CLEAR | _UUID7_SET:032x}"


#: The 48 bits of milliseconds a version 7 UUID holds.
_MILLIS: Final = (1 << 48) - 1
#: Where the version (7) and the variant (0b10) go, cleared, then set.
_UUID7_CLEAR: Final = ~((0xF << 76) | (0x3 << 62)) & ((1 << 128) - 1)
_UUID7_SET: Final = (0x7 << 76) | (0x2 << 62)


def new_execution_id(execution_id: str) -> str:
    """An id for a new run: a valid execution id whose other streams (inbox, events,
    snapshot) can be named too. (Runs started before this check with longer ids are
    still read: only their messages and events cannot be.)

    Raises:
        InvalidIdError: the id is not a valid id, or is too long for those streams.
    """
    stream_of(execution_id)
    if len(execution_id) > MAX_EXECUTION_ID_LENGTH:
        raise InvalidIdError(
            execution_id,
            f"an execution id is at most {MAX_EXECUTION_ID_LENGTH} characters (its inbox, "
            "events and snapshot streams are named by it too)",
        )
    return execution_id


def _snapshot_stream(execution_id: str) -> str:
    return validate_stream_id(SNAPSHOT_PREFIX + execution_id)


def execution_ids(store: JournalStore, prefix: str = "", page: int = 500) -> Iterator[str]:
    """The ids of the executions in a store whose ids start with `prefix`, in order.

    Raises:
        InvalidIdError: the prefix breaks the id rules.
    """
    if not isinstance(prefix, str):
        raise InvalidIdError(prefix, "an execution id prefix is a str")
    after: str | None = None
    while names := store.streams(EXECUTION_PREFIX + prefix, after, page):
        for name in names:
            yield name.removeprefix(EXECUTION_PREFIX)
        after = names[-1]


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic collector while a journal is decoded and folded.

    A load allocates a few objects per record and frees none, so the collector runs
    again and again over a growing heap for nothing (measured with
    bench/bench_replay.py: a third of a 10,000-record cold load, and most of its
    variance). Whatever state the collector was in is restored.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def load(store: JournalStore, execution_id: str, cached: ExecutionState | None) -> ExecutionState:
    """The execution's current state: `cached` brought up to date, or a fresh fold.

    `cached` is folded into in place, so the caller must own it. A finished run's
    journal never changes, so a finished `cached` state is returned as it is.

    Raises:
        ExecutionNotFoundError: no such execution, or it was deleted.
        SchemaError: the journal cannot be folded (a damaged record, a gap).
    """
    if cached is not None and cached.status.finished:
        return cached
    stream = stream_of(execution_id)
    try:
        with _gc_paused():
            state = _load(store, execution_id, stream, cached)
    except StreamDeletedError:
        raise ExecutionNotFoundError(f"execution {execution_id!r} was deleted") from None
    if state.position == 0:
        raise ExecutionNotFoundError(f"no execution with id {execution_id!r}")
    return state


def _load(
    store: JournalStore, execution_id: str, stream: str, cached: ExecutionState | None
) -> ExecutionState:
    if cached is not None:
        try:
            fold_records(cached, store.read(stream, cached.position), stream)
        except TrimmedError:
            pass  # compacted past what this copy holds: start from the snapshot
        else:
            return cached
    previous: tuple[int, int] | None = None  # (snapshot head, its position) last tried
    for _ in range(_LOAD_ATTEMPTS):
        found = _latest_snapshot(store, execution_id)
        state = ExecutionState(id=execution_id) if found is None else found[1]
        try:
            records = store.read(stream, state.position)
        except TrimmedError as exc:
            mark = (0, 0) if found is None else (found[0], state.position)
            if mark == previous:
                raise _lost(stream, state.position, exc.floor) from None
            previous = mark
            continue  # a compaction moved the snapshot and the floor on: read again
        fold_records(state, records, stream)
        return state
    raise StoreUnavailableError(
        f"execution {execution_id!r} kept being compacted while it was loaded; try again"
    )


def _lost(stream: str, covered: int, floor: int) -> SchemaError:
    return SchemaError(
        f"the latest snapshot covers position {covered} but the journal is trimmed up to "
        f"{floor}: records {covered + 1} to {floor} are lost (a snapshot older than the "
        "trim floor; Loom never writes one, so the store was changed by other means)",
        stream=stream,
        position=covered + 1,
    )


def _latest_snapshot(store: JournalStore, execution_id: str) -> tuple[int, ExecutionState] | None:
    """(snapshot stream head, the state it holds), or None when never compacted."""
    try:
        stream = _snapshot_stream(execution_id)
    except InvalidIdError:
        return None  # an id an older Loom allowed, too long to name one: never compacted
    for _ in range(_LOAD_ATTEMPTS):
        head = store.head(stream)
        if head == 0:
            return None
        try:
            records = store.read(stream, head - 1, 1)
        except TrimmedError:
            continue  # a newer snapshot trimmed this one away meanwhile
        if records:
            return head, ExecutionState.from_snapshot(_snapshot_data(records[0], stream))
    raise StoreUnavailableError(f"snapshots of {execution_id!r} kept changing; try again")


def _snapshot_data(record: Record, stream: str) -> dict[str, Any]:
    try:
        data = json.loads(record.payload)
    except ValueError as exc:
        raise SchemaError(
            f"snapshot is not JSON: {exc}", stream=stream, position=record.position
        ) from exc
    if not isinstance(data, dict):
        raise SchemaError("snapshot is not an object", stream=stream, position=record.position)
    return data


def _covered(record: Record, stream: str) -> int:
    """The journal position a snapshot record covers."""
    try:
        position = _snapshot_data(record, stream)["state"]["position"]
    except (KeyError, TypeError):
        position = None
    if isinstance(position, bool) or not isinstance(position, int):
        raise SchemaError(
            "snapshot names no position", stream=stream, position=record.position
        ) from None
    return position


def compact(store: JournalStore, state: ExecutionState, clock: Callable[[], float]) -> int:
    """Snapshot `state`, then trim the journal below the latest snapshot.

    The snapshot is written first, so a crash between the two writes loses nothing.
    When a snapshot covering as much or more is already there (another engine
    compacted meanwhile), none is written and the journal is trimmed to that one.

    Returns:
        The journal position the latest snapshot covers.
    """
    stream = _snapshot_stream(state.id)
    payload = json.dumps(state.to_snapshot(), separators=(",", ":")).encode()
    while True:
        head = store.head(stream)
        if head:
            try:
                latest = store.read(stream, head - 1, 1)
            except TrimmedError:
                continue
            covered = _covered(latest[0], stream)
            if covered >= state.position:
                break
        try:
            store.append(stream, head, [NewRecord(SNAPSHOT_KIND, payload, clock())])
        except ConflictError:
            continue  # another snapshot landed first: compare with it
        store.trim(stream, head + 1)  # older snapshots are never read again
        covered = state.position
        break
    # The last covered record stays: its time tells when the run was last written
    # (a takeover's sighting of its owner); a load reads after the snapshot anyway.
    store.trim(stream_of(state.id), covered)
    return covered
