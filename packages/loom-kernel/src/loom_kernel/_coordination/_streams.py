"""The one helper every coordination stream is read and written through.

A coordination stream (a run index partition, a queue partition, an inbox, a run's
published values) is a stream many writers append to and a reader folds: its state
is a fold of its records, from its latest checkpoint on. `StreamFolds` keeps each
stream's fold and brings it up to date by reading only what was appended since this
reader last read it (one read, no head first: on S3 each is a request), starts over
from the trim floor when a checkpoint trimmed what it would read, appends where the
head is (guessed from this reader's last append, so a quiet stream costs one
request) or at the exact head of the fold (a take, a checkpoint), and writes a
checkpoint at the exact head it folded, then trims below it. `latest` and
`retained` read a stream's last record, and all it retains, through the same trims.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Final, Generic, Protocol, Self, TypeVar

from loom_kernel._core import (
    ConflictError,
    LoomError,
    NewRecord,
    Record,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
)
from loom_kernel._spi import JournalStore

__all__ = ["Fold", "StreamFolds", "latest", "retained"]

#: Reads that a trim by another reader may cut short, before giving up.
_READ_ATTEMPTS: Final = 8


class Fold(Protocol):
    """A stream's state, folded from its records up to `head`."""

    head: int

    def copy(self) -> Self: ...


F = TypeVar("F", bound=Fold)


class _Hold:
    """A stream's lock, and how many callers hold or wait for it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.users = 0


class StreamFolds(Generic[F]):
    """The folds of one kind of coordination stream, on one store.

    Args:
        store: the store.
        start: a fold of nothing, as a stream read from position `head` on starts it
            (a stream trimmed up to `head` starts from its checkpoint there).
        apply: folds one record in place; raises SchemaError for a damaged record.
        kept: how many streams' folds to keep (the least recently used go first);
            None keeps every one (the few partitions of an index or a queue).
        checkpointed: whether the streams are compacted by checkpoints, so a fold may
            start over from a stream's trim floor (which a checkpoint holds), and a
            deleted stream folds as empty. A run's inbox is not: a trim or a deletion
            of one is an error the reader must see (TrimmedError, StreamDeletedError),
            never messages silently gone.
        deleted_is_empty: with `checkpointed`, whether a deleted stream folds as
            empty (the coordination streams) or is an error (a run's published
            values, compacted by checkpoints but never deleted but with the run).
    """

    def __init__(
        self,
        store: JournalStore,
        start: Callable[[str, int], F],
        apply: Callable[[F, Record], None],
        *,
        kept: int | None = None,
        checkpointed: bool = True,
        deleted_is_empty: bool = True,
    ) -> None:
        self._store = store
        self._start = start
        self._apply = apply
        self._kept = kept
        self._checkpointed = checkpointed
        self._deleted_is_empty = checkpointed and deleted_is_empty
        self._folds: OrderedDict[str, F] = OrderedDict()
        self._heads: OrderedDict[str, int] = OrderedDict()  # after this reader's last append
        self._holds: dict[str, _Hold] = {}  # of the streams kept, or held now
        self._lock = threading.Lock()  # over the three above

    @contextmanager
    def holding(self, stream: str) -> Iterator[None]:
        """Hold a stream: this reader's other calls on it (from other threads) wait
        until the block ends, so a fold `refresh` returned stays as it is but for what
        the block appends itself."""
        with self._lock:
            hold = self._holds.get(stream)
            if hold is None:
                hold = self._holds[stream] = _Hold()
            hold.users += 1
        try:
            with hold.lock:
                yield
        finally:
            with self._lock:
                hold.users -= 1
                if hold.users == 0 and stream not in self._folds:
                    self._holds.pop(stream, None)  # its fold was let go meanwhile

    def refresh(self, stream: str) -> F:
        """The stream's fold as it is now, live (call it inside `holding`, and use it
        there only): what was appended since this reader last read the stream is read
        (one read) and folded in place; a read that meets a trim reads again from the
        new floor; a deleted stream folds as empty.

        Raises:
            SchemaError: a record is damaged (the fold kept is dropped: the next read
                starts afresh).
            StoreUnavailableError: other readers kept trimming it while it was read.
            TrimmedError, StreamDeletedError: a stream that is not `checkpointed` was
                trimmed, or one not `deleted_is_empty` deleted.
        """
        with self._lock:
            fold = self._folds.get(stream)
        after = 0
        for _ in range(_READ_ATTEMPTS):
            start = fold.head if fold is not None else after
            try:
                records = self._store.read(stream, start)
            except TrimmedError as exc:
                if not self._checkpointed:
                    raise
                after, fold = exc.floor, None
                continue
            except StreamDeletedError:
                if not self._deleted_is_empty:
                    raise
                fold = self._start(stream, 0)
                self._keep(stream, fold)
                return fold
            if fold is None:
                fold = self._start(stream, start)
            self._fold_in(stream, fold, records)
            self._keep(stream, fold)
            return fold
        raise StoreUnavailableError(f"{stream}: other writers kept compacting it while it was read")

    def read(self, stream: str) -> F:
        """A copy of the stream's fold as it is now (see `refresh`), to keep."""
        with self.holding(stream):
            return self.refresh(stream).copy()

    def append(self, stream: str, records: Sequence[NewRecord], *, sync: bool = True) -> int:
        """Append `records` wherever the stream's head is now; the last one's position.

        For records that need no place of their own (an index's hint, a message, a
        queue's add): the head guessed is where this reader last left the stream, and
        a conflict names the head to try next. `sync` as `JournalStore.append`'s.
        """
        with self._lock:
            head = max(self._heads.get(stream, 0), self._folded(stream))
        while True:
            try:
                head = self._store.append(stream, head, records, sync=sync)
                break
            except ConflictError as exc:
                head = exc.actual if exc.actual != head else self._store.head(stream)
        self._note_head(stream, head)
        return head

    def append_at(self, stream: str, fold: F, records: Sequence[NewRecord]) -> int:
        """Append `records` at the exact head of `fold` (live, held), and fold them in;
        the last one's position.

        Raises:
            ConflictError: the stream moved since `fold` was read: refresh and again.
        """
        first = fold.head + 1
        position = self._store.append(stream, fold.head, records)
        self._note_head(stream, position)
        stored = [
            Record(first + offset, record.kind, record.payload, record.timestamp)
            for offset, record in enumerate(records)
        ]
        self._fold_in(stream, fold, stored)
        return position

    def _fold_in(self, stream: str, fold: F, records: Sequence[Record]) -> None:
        """Fold `records` into `fold`; a fold cut short (a damaged record, an
        interrupt between two of its changes) is dropped: the next read starts afresh,
        never from a fold that holds half a record."""
        try:
            for record in records:
                self._apply(fold, record)
                fold.head = record.position
        except BaseException:
            self.forget(stream)
            raise

    def checkpoint(self, stream: str, fold: F, record: NewRecord) -> bool:
        """Append `record`, a checkpoint of `fold` (live, held), at its exact head, then
        trim the stream below it; False when the stream moved meanwhile (a later
        checkpoint is made from a newer fold)."""
        try:
            head = self.append_at(stream, fold, [record])
        except ConflictError:
            return False
        self._store.trim(stream, head)
        return True

    def kept(self) -> list[str]:
        """The streams whose folds are kept, the least recently used first."""
        with self._lock:
            return list(self._folds)

    def forget(self, stream: str) -> None:
        """Drop the fold kept of a stream (its next read starts afresh)."""
        with self._lock:
            self._folds.pop(stream, None)

    def _folded(self, stream: str) -> int:
        fold = self._folds.get(stream)
        return 0 if fold is None else fold.head

    def _keep(self, stream: str, fold: F) -> None:
        with self._lock:
            kept = self._folds.get(stream)
            if kept is None or kept is fold or kept.head <= fold.head:
                self._folds[stream] = fold
            self._folds.move_to_end(stream)
            if self._kept is not None:
                while len(self._folds) > self._kept:
                    gone, _ = self._folds.popitem(last=False)
                    self._heads.pop(gone, None)
                    hold = self._holds.get(gone)
                    if hold is not None and hold.users == 0:  # one held goes when let go
                        self._holds.pop(gone)

    def _note_head(self, stream: str, head: int) -> None:
        with self._lock:
            self._heads[stream] = head
            self._heads.move_to_end(stream)
            if self._kept is not None:
                while len(self._heads) > self._kept:
                    self._heads.popitem(last=False)


def latest(store: JournalStore, stream: str, *, raw: bool = False) -> Record | None:
    """A stream's last record; None when it has none. A trim between reading the head
    and reading the record means newer records: the head is read again. With `raw`, a
    payload kept as a blob is left a reference (for a caller that reads only the
    record's kind and time).

    Raises:
        StoreUnavailableError: it kept being trimmed while it was read.
        StreamDeletedError: the stream was deleted.
    """
    for _ in range(_READ_ATTEMPTS):
        head = store.head(stream)
        if head == 0:
            return None
        try:
            read = store.raw_read if raw else store.read
            records = read(stream, head - 1, 1)
        except TrimmedError:
            continue
        if records:
            return records[-1]
    raise StoreUnavailableError(
        f"{stream}: its last record kept changing (trimmed as it was read); try again"
    )


def retained(store: JournalStore, stream: str, after: int = 0) -> list[Record] | None:
    """Every record a stream retains after `after` (from its trim floor, when that is
    higher); None when it was deleted, or kept being trimmed while it was read."""
    for _ in range(_READ_ATTEMPTS):
        try:
            return store.read(stream, after)
        except TrimmedError as exc:
            after = exc.floor
        except StreamDeletedError:
            return None
    return None


def first_timestamp(store: JournalStore, stream: str) -> float | None:
    """When a stream's first record was written; None when it has none, its first
    record was trimmed off, or it cannot be read now."""
    try:
        records = store.raw_read(stream, 0, 1)
    except LoomError:
        return None
    return records[0].timestamp if records else None
