"""The queue book: reads and writes the partitions of an engine's queues (see
`_queues` for the records and their fold), each partition a stream folded through
`StreamFolds`: adds wherever the head is, takes and dones at the exact head of the
fold they were picked from, a checkpoint once a partition holds more records past its
last one than a checkpoint would, and a rewrite that trims a damaged record off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Final

from loom_kernel._coordination._queues import (
    ADD_KIND,
    CHECKPOINT_KIND,
    DONE_KIND,
    QUEUES_PREFIX,
    TAKE_KIND,
    Queue,
    QueueFold,
    QueueView,
    checkpoint_data,
    dump,
    fold_record,
)
from loom_kernel._coordination._streams import StreamFolds, retained
from loom_kernel._core import InvalidArgumentError, LoomError, NewRecord, QueuePlace, SchemaError
from loom_kernel._spi import JournalStore

__all__ = ["QueueBook"]

#: Records a partition holds past its checkpoint before a taker compacts it.
_COMPACT_AT: Final = 64
#: Rewrites of a damaged partition other writers may cut short, before giving up.
_REWRITE_ATTEMPTS: Final = 8

_log = logging.getLogger("loom")


class QueueBook:
    """Reads and writes the queues of one engine, on its store."""

    def __init__(
        self, store: JournalStore, clock: Callable[[], float], queues: Iterable[Queue]
    ) -> None:
        self._store = store
        self._clock = clock
        self.queues: dict[str, Queue] = {}
        if isinstance(queues, Queue) or not isinstance(queues, Iterable):
            raise InvalidArgumentError(f"queues is a list of Queue objects, not {queues!r}")
        for queue in queues:
            if not isinstance(queue, Queue):
                raise InvalidArgumentError(f"queues holds Queue objects, not {queue!r}")
            if queue.name in self.queues:
                raise InvalidArgumentError(f"two queues are named {queue.name!r}")
            self.queues[queue.name] = queue
        self._folds = StreamFolds(store, self._empty, fold_record)

    def queue(self, name: str) -> Queue:
        """The queue of that name.

        Raises:
            InvalidArgumentError: this engine has no such queue.
        """
        queue = self.queues.get(name) if isinstance(name, str) else None
        if queue is None:
            raise InvalidArgumentError(
                f"no queue named {name!r} on this engine (Engine(..., queues=[Queue(...)]); "
                f"known: {sorted(self.queues)})"
            )
        return queue

    @staticmethod
    def stream(name: str, partition: int) -> str:
        return f"{QUEUES_PREFIX}{name}/{partition}"

    def _empty(self, stream: str, head: int) -> QueueFold:
        """A partition's fold of nothing, with its queue's rate window."""
        queue = self.queues.get(stream.removeprefix(QUEUES_PREFIX).rsplit("/", 1)[0])
        window = None if queue is None or queue.rate is None else queue.rate.per
        return QueueFold(stream, head, window=window)

    # -- writing --------------------------------------------------------------

    def add(self, place: QueuePlace, execution_id: str, flow: str, code: str) -> None:
        """Have a run wait on its queue (a second add of a run waiting or driven is
        folded away; one of a run being driven has it wait again once done); `code` is
        the hash of the code it is pinned to, so workers without it leave it alone."""
        data = {
            "id": execution_id,
            "flow": flow,
            "priority": place.priority,
            "key": place.key,
            "code": code,
        }
        record = NewRecord(ADD_KIND, dump(data), self._clock())
        self._add(self.stream(place.name, place.partition), record)

    def done(
        self,
        name: str,
        partition: int,
        execution_id: str,
        take: int,
        *,
        requeue: bool,
        unused: bool = False,
    ) -> None:
        """Say that the run the take at `take` admitted is no longer driven (appended
        wherever the head is); see `done_record`."""
        record = self.done_record(execution_id, take, requeue=requeue, unused=unused)
        self._add(self.stream(name, partition), record)

    def done_record(
        self, execution_id: str, take: int, *, requeue: bool, unused: bool = False
    ) -> NewRecord:
        """The record that says the run the take at `take` admitted is no longer driven;
        with `requeue`, it waits again at its old place (its driver let it go running);
        with `unused`, it was never driven, and its admission counts for no rate."""
        data = {"id": execution_id, "take": take, "requeue": requeue, "unused": unused}
        return NewRecord(DONE_KIND, dump(data), self._clock())

    def take_record(self, ids: Sequence[str], by: str) -> NewRecord:
        """The record that admits `ids` for worker `by`."""
        return NewRecord(TAKE_KIND, dump({"ids": list(ids), "by": by}), self._clock())

    def take(self, name: str, partition: int, fold: QueueFold, ids: Sequence[str], by: str) -> int:
        """Admit `ids` for worker `by`, at the exact head of `fold`; the take's position
        (see `append_at`).

        Raises:
            ConflictError: the partition moved since `fold` was read: fold again.
        """
        return self.append_at(name, partition, fold, [self.take_record(ids, by)])

    def append_at(
        self, name: str, partition: int, fold: QueueFold, records: Sequence[NewRecord]
    ) -> int:
        """Append `records` at the exact head of `fold`, and fold them into it; the last
        one's position. Compacts the partition once it holds more records past its
        checkpoint than a checkpoint would (and at least _COMPACT_AT), so a checkpoint
        costs O(1) a record.

        Raises:
            ConflictError: the partition moved since `fold` was read: fold again.
        """
        stream = self.stream(name, partition)
        with self._folds.holding(stream):
            position = self._folds.append_at(stream, fold, records)
            held = len(fold.waiting) + len(fold.active)
            if fold.since_checkpoint >= max(_COMPACT_AT, held):
                self._compact(name, partition)
        return position

    def _add(self, stream: str, record: NewRecord) -> None:
        """Append one record wherever the stream's head is now (held, so this book's own
        takes never conflict with its adds)."""
        with self._folds.holding(stream):
            self._folds.append(stream, [record])

    def _compact(self, name: str, partition: int) -> None:
        """Checkpoint the fold at the exact head read, then trim below it (a partition
        that moved meanwhile is compacted by a later take)."""
        try:
            with self.holding(name, partition):
                fold = self.refresh(name, partition)
                record = NewRecord(CHECKPOINT_KIND, dump(checkpoint_data(fold)), self._clock())
                self._folds.checkpoint(fold.stream, fold, record)
        except LoomError as exc:  # it stays as it was; a later take compacts it
            _log.warning("loom: queue %s/%d not compacted: %s", name, partition, exc)

    # -- reading --------------------------------------------------------------

    @contextmanager
    def holding(self, name: str, partition: int) -> Iterator[None]:
        """Hold a partition: this book's other calls on it (from other threads) wait
        until the block ends, so `refresh`'s fold stays as it is but for what the block
        appends itself (its own takes never conflict with this process's)."""
        with self._folds.holding(self.stream(name, partition)):
            yield

    def refresh(self, name: str, partition: int) -> QueueFold:
        """The partition as it is now, live (call it inside `holding`, and use it there
        only): see `StreamFolds.refresh`.

        Raises:
            SchemaError: a record is damaged (`rewrite` mends it).
            StoreUnavailableError: other takers kept compacting it while it was read.
        """
        return self._folds.refresh(self.stream(name, partition))

    def read(self, name: str, partition: int) -> QueueFold:
        """A copy of the partition as it is now (see `refresh`), to keep.

        Raises:
            SchemaError: a record is damaged (`rewrite` mends it).
        """
        return self._folds.read(self.stream(name, partition))

    def rewrite(self, name: str, partition: int) -> None:
        """Mend a partition with a damaged record: fold its readable records and
        checkpoint that at the exact head read, which trims the damage off."""
        stream = self.stream(name, partition)
        with self.holding(name, partition):
            self._folds.forget(stream)
            for _ in range(_REWRITE_ATTEMPTS):
                fold = self._empty(stream, 0)
                for record in retained(self._store, stream) or []:
                    try:
                        fold_record(fold, record)
                    except SchemaError as exc:
                        _log.warning("loom: dropping a damaged queue record: %s", exc)
                    fold.head = record.position
                mark = NewRecord(CHECKPOINT_KIND, dump(checkpoint_data(fold)), self._clock())
                if self._folds.checkpoint(stream, fold, mark):
                    self._folds.forget(stream)  # read afresh, from the checkpoint
                    return

    def view(self, name: str) -> QueueView:
        """What waits on a queue and what is driven, now.

        Raises:
            InvalidArgumentError: this engine has no such queue.
            SchemaError: a partition holds a damaged record.
        """
        queue = self.queue(name)
        waiting: list[str] = []
        active: list[str] = []
        for partition in range(queue.partitions):
            with self.holding(name, partition):
                fold = self.refresh(name, partition)
                waiting.extend(item.execution_id for item in fold.in_order())
                active.extend(fold.active)
        return QueueView(name, waiting, active)
