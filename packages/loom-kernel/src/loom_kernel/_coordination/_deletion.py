"""Deleting an ended run (retention), in an order that a crash at any point leaves
either the whole run or a deletion the next sweep (or a start with the id) finishes.

1. EXECUTION_DELETED is appended to the run's journal at the exact head its ended
   state was folded at: from here on the run is gone (a load says so), and a start
   with its id begins the id's next generation after this record. A run that moved
   on meanwhile (it cannot, once ended, but a racing deleter can) refuses the append.
2. `finish_deletion`: the deleted generation's inbox and published values are
   deleted (the SPI retires their names; the next generation has streams of its own),
   then a snapshot of the blank state is written at the deletion's position and the
   journal is trimmed below it, so only the deletion's record remains. Each write is
   safe to repeat.

Timer hints and queue entries are not touched: an ended run's are handled already
(a queue's `done`) or obsolete, and each is checked against the journal before it
acts (a hint wakes a gate only where the journal shows that gate due).
"""

from __future__ import annotations

from collections.abc import Callable

from loom_kernel._coordination._executions import compact
from loom_kernel._core import (
    ExecutionDeleted,
    ExecutionState,
    InvalidArgumentError,
    encode_event,
    events_stream,
    inbox_stream,
    stream_of,
)
from loom_kernel._spi import JournalStore

__all__ = ["delete_ended", "finish_deletion"]


def delete_ended(
    store: JournalStore,
    state: ExecutionState,
    clock: Callable[[], float],
    reason: str | None = "retention",
) -> ExecutionState:
    """Delete an ended run whose state was just folded from the store (`state` is
    folded on, in place, to the deletion).

    Raises:
        InvalidArgumentError: the run has not ended, or was deleted already.
        ConflictError: the journal moved past `state` (another deleter won).
    """
    if state.deleted or not state.status.finished:
        status = "deleted" if state.deleted else state.status.value
        raise InvalidArgumentError(f"{state.id} is {status}: only an ended run is deleted")
    event = ExecutionDeleted(state.generation + 1, reason)
    store.append(stream_of(state.id), state.position, [encode_event(event, clock())])
    state.apply(event)
    finish_deletion(store, state, clock)
    return state


def finish_deletion(
    store: JournalStore, state: ExecutionState, clock: Callable[[], float] = lambda: 0.0
) -> None:
    """Finish the deletion a deleted `state` ends at: the deleted generation's inbox and
    published values go, and the journal is compacted to the deletion's record."""
    deleted = state.generation - 1
    store.delete(inbox_stream(state.id, deleted))
    store.delete(events_stream(state.id, deleted))
    compact(store, state, clock)
