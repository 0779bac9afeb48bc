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
from collections.abc import Callable, Iterator
from typing import Any, Final

from loom_kernel._coordination._streams import latest
from loom_kernel._core import (
    EXECUTION_PREFIX,
    SNAPSHOT_PREFIX,
    ConflictError,
    ExecutionNotFoundError,
    ExecutionState,
    InvalidIdError,
    NewRecord,
    Record,
    SchemaError,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
    fold_records,
    stream_of,
    validate_stream_id,
)
from loom_kernel._spi import JournalStore

__all__ = ["SNAPSHOT_KIND", "compact", "execution_ids", "load", "snapshot"]

SNAPSHOT_KIND: Final = "loom.snapshot"
#: Loads restarted because a compaction moved the journal on meanwhile, before giving up.
_LOAD_ATTEMPTS: Final = 16


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


def load(
    store: JournalStore,
    execution_id: str,
    cached: ExecutionState | None,
    *,
    deleted: bool = False,
) -> ExecutionState:
    """The execution's current state: `cached` brought up to date, or a fresh fold.

    `cached` is folded into in place, so the caller must own it. A finished run's
    state is brought up to date too: retention may have deleted it since (and a
    start with its id begun the next run of the id).

    Args:
        deleted: return the state of a run retention deleted (`state.deleted`), with
            the generation a start with its id begins, instead of raising.

    Raises:
        ExecutionNotFoundError: no such execution, or it was deleted.
        SchemaError: the journal cannot be folded (a damaged record, a gap).
    """
    stream = stream_of(execution_id)
    try:
        with _gc_paused():
            state = _load(store, execution_id, stream, cached)
    except StreamDeletedError:
        raise ExecutionNotFoundError(f"execution {execution_id!r} was deleted") from None
    if state.position == 0:
        raise ExecutionNotFoundError(f"no execution with id {execution_id!r}")
    if state.deleted and not deleted:
        raise ExecutionNotFoundError(f"execution {execution_id!r} was deleted (by retention)")
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
    """(its position, the state it holds) of the latest snapshot, or None when the run
    was never compacted."""
    try:
        stream = _snapshot_stream(execution_id)
    except InvalidIdError:
        return None  # an id an older Loom allowed, too long to name one: never compacted
    record = latest(store, stream)
    if record is None:
        return None
    return record.position, ExecutionState.from_snapshot(_snapshot_data(record, stream))


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


def snapshot(store: JournalStore, state: ExecutionState, clock: Callable[[], float]) -> int:
    """Snapshot `state` (a committed state of the run), unless a snapshot covering as
    much or more is there already; the journal is left whole. A load then reads the
    snapshot and the records after it, not the whole journal.

    Returns:
        The journal position the latest snapshot covers.
    """
    stream = _snapshot_stream(state.id)
    payload = json.dumps(state.to_snapshot(), separators=(",", ":")).encode()
    while True:
        last = latest(store, stream)
        head = 0 if last is None else last.position
        if last is not None:
            covered = _covered(last, stream)
            if covered >= state.position:
                return covered
        try:
            store.append(stream, head, [NewRecord(SNAPSHOT_KIND, payload, clock())])
        except ConflictError:
            continue  # another snapshot landed first: compare with it
        store.trim(stream, head + 1)  # older snapshots are never read again
        return state.position


def compact(store: JournalStore, state: ExecutionState, clock: Callable[[], float]) -> int:
    """Snapshot `state`, then trim the journal below the latest snapshot.

    The snapshot is written first, so a crash between the two writes loses nothing.
    When a snapshot covering as much or more is already there (another engine
    compacted meanwhile), none is written and the journal is trimmed to that one.

    Returns:
        The journal position the latest snapshot covers.
    """
    covered = snapshot(store, state, clock)
    # The last covered record stays: its time tells when the run was last written
    # (a takeover's sighting of its owner); a load reads after the snapshot anyway.
    store.trim(stream_of(state.id), covered)
    return covered
