"""The journal protocol: the abstract store every backend implements."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Final

from loom_kernel._core import (
    InvalidArgumentError,
    NewRecord,
    Record,
    validate_prefix,
    validate_stream_id,
)
from loom_kernel._spi._blobs import (
    DEFAULT_BLOB_THRESHOLD,
    blob_key,
    check_not_a_reference,
    reference,
    resolved,
)

if TYPE_CHECKING:
    from loom_kernel._spi._blobs import BlobStore

__all__ = ["APPENDS", "JournalStore"]


class AppendCount:
    """How many appends this process has asked of its stores (counted as each call
    begins, landed or not), in `asked`. A drive compares it before and after its own
    append: when it moved by exactly one, no other code of the process appended in
    between. An attribute, not a function: a step reads it three times."""

    __slots__ = ("asked",)

    def __init__(self) -> None:
        self.asked = 0


#: The process's one count (`JournalStore.append` bumps it).
APPENDS: Final = AppendCount()


def _check_position(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{name} must be an int >= 0, not {value!r}")
    return value


def _check_limit(limit: object) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidArgumentError(f"limit must be None or an int >= 1, not {limit!r}")
    return limit


class JournalStore(abc.ABC):
    """A store of named streams of gapless, numbered records: the storage SPI.

    The public methods check their arguments (ids, positions, limits, records) and
    then call the protected hooks a store implements. docs/spi.md is the contract:
    what each hook must do, which errors it raises and how it handles an ambiguous
    failure. Every store must pass the conformance kit in loom_kernel.testing.

    Attributes:
        head_is_cheap: whether `head()` costs about as little as a local read. The
            engine looks at the head before each new step, to stop early when a
            cancel or another worker has moved the run on; a store whose head is a
            network round trip (S3) sets this False, and the engine then learns of
            such a move at its next append, which the conflict rule refuses anyway.
    """

    head_is_cheap: ClassVar[bool] = True
    #: The largest payload one record may have, in bytes, or None for no limit: each
    #: store states its own (SQLite's string and blob limit, S3's largest single PUT).
    #: `append` refuses a larger record with InvalidArgumentError, writing nothing.
    max_record_bytes: int | None = None
    #: Where payloads over `blob_threshold` bytes go (`use_blobs`), or None: kept in
    #: the journal (up to `max_record_bytes`).
    blobs: BlobStore | None = None
    blob_threshold: int = DEFAULT_BLOB_THRESHOLD

    def use_blobs(self, blobs: BlobStore | None, threshold: int = DEFAULT_BLOB_THRESHOLD) -> None:
        """Keep payloads over `threshold` bytes in `blobs`, each journaled as a small
        reference to it (see docs/retention.md); None keeps them in the journal.

        Raises:
            InvalidArgumentError: `threshold` is not a whole number of bytes >= 1.
        """
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise InvalidArgumentError(
                f"a blob threshold is a whole number >= 1, not {threshold!r}"
            )
        self.blobs, self.blob_threshold = blobs, threshold

    def append(
        self, stream: str, expected: int, records: Sequence[NewRecord], *, sync: bool = True
    ) -> int:
        """Append records atomically where the stream's head is exactly `expected`.

        Args:
            stream: the stream id.
            expected: the head the caller saw; 0 means the stream must not exist yet.
            records: one or more records; they land together or not at all.
            sync: False: the store need not make this append durable on its own before
                it returns, only no later than the next append it syncs (a store whose
                every write is durable, or that keeps them in order on disk, as a WAL
                does, gives that for nothing). A crash of the process loses nothing
                either way; a power loss may lose an unsynced append together with
                what was appended after it and not synced, never on its own. For
                bookkeeping whose loss a later synced record makes good (a run
                index's hint, written just before the run's synced start).

        Returns:
            The new head: `expected + len(records)`.

        Raises:
            ConflictError: the head is not `expected`; nothing was written.
            StreamDeletedError: the stream was deleted; nothing was written.
            StoreUnavailableError: a transient fault; the write did not land or
                could not be confirmed (re-read before retrying).
            InvalidIdError, InvalidArgumentError: bad arguments (a record over the
                store's `max_record_bytes`, say); nothing was written.
        """
        APPENDS.asked += 1
        validate_stream_id(stream)
        if type(expected) is not int or expected < 0:  # the common case without a call
            _check_position("expected", expected)
        batch = tuple(records)
        if not batch:
            raise InvalidArgumentError("append needs at least one record")
        for record in batch:
            if not isinstance(record, NewRecord):
                raise InvalidArgumentError(
                    f"append takes NewRecord instances, not {type(record).__name__}"
                )
            if record.payload[:1] == b"\x00":
                check_not_a_reference(record.payload)
        blobs = self.blobs
        written: dict[str, bytes] = {}
        if blobs is not None:
            batch = tuple(self._blobbed(blobs, record, written) for record in batch)
        limit = self.max_record_bytes
        for record in batch:
            if limit is not None and len(record.payload) > limit:
                raise InvalidArgumentError(
                    f"a {record.kind} record of {len(record.payload):,} bytes is over "
                    f"{type(self).__name__}'s limit of {limit:,} bytes a record: nothing was "
                    "written, and no retry can take it (keep payloads that large out of "
                    "the journal)"
                )
        write = self._append if sync else self._append_unsynced
        if blobs is None or not written:
            return write(stream, expected, batch)
        try:
            return write(stream, expected, batch)
        finally:  # landed or not, or not known (an ambiguous write)
            for key, content in written.items():
                # A writer that stalled past a collector's grace between its blob and
                # its record may find the blob in the trash, or gone: it brings it back.
                if not blobs.exists(key) and not blobs.restore(key):
                    blobs.put(key, content)

    def _blobbed(self, blobs: BlobStore, record: NewRecord, written: dict[str, bytes]) -> NewRecord:
        """The record as journaled: for a payload over the threshold, a reference to
        its blob, written first (and noted in `written`)."""
        payload = record.payload
        if len(payload) <= self.blob_threshold:
            return record
        key = blob_key(payload)
        blobs.put(key, payload)
        written[key] = payload
        return NewRecord(record.kind, reference(key), record.timestamp)

    @property
    def largest_payload(self) -> int | None:
        """The largest payload a record may have here: `max_record_bytes`, or None with
        a blob store (a larger payload goes there)."""
        return None if self.blobs is not None else self.max_record_bytes

    def raw_read(self, stream: str, after: int = 0, limit: int | None = None) -> list[Record]:
        """`read`, with blob references left as they are journaled (the blob collector
        reads them so)."""
        validate_stream_id(stream)
        _check_position("after", after)
        return self._read(stream, after, _check_limit(limit))

    def read(self, stream: str, after: int = 0, limit: int | None = None) -> list[Record]:
        """Return the records after position `after`, in order and gapless.

        A stream that does not exist reads as empty.

        Raises:
            TrimmedError: `after` is below the stream's trim floor.
            StreamDeletedError: the stream was deleted.
        """
        validate_stream_id(stream)
        _check_position("after", after)
        records = self._read(stream, after, _check_limit(limit))
        if self.blobs is None:
            return records
        return resolved(self.blobs, records)

    def head(self, stream: str) -> int:
        """Return the stream's last position, 0 for a stream that does not exist.

        Raises:
            StreamDeletedError: the stream was deleted.
        """
        validate_stream_id(stream)
        return self._head(stream)

    def streams(
        self, prefix: str = "", after: str | None = None, limit: int | None = None
    ) -> list[str]:
        """Return stream names starting with `prefix`, sorted, strictly after `after`.

        Deleted streams are not listed. Page by passing the last name of a page as
        the next call's `after`.
        """
        validate_prefix(prefix)
        if after is not None:
            validate_prefix(after)
        return self._streams(prefix, after, _check_limit(limit))

    def trim(self, stream: str, before: int) -> None:
        """Drop the records below position `before` (compaction). The head never moves.

        Trimming at or below the current floor is a no-op.

        Raises:
            InvalidArgumentError: `before` is beyond head + 1.
            StreamDeletedError: the stream was deleted.
        """
        validate_stream_id(stream)
        _check_position("before", before)
        self._trim(stream, before)

    def delete(self, stream: str) -> None:
        """Delete a stream: drop its records and retire its name, so no position is reused.

        Deleting a deleted (or never created) stream is allowed; afterwards every
        operation but listing and delete raises StreamDeletedError for that name.
        """
        validate_stream_id(stream)
        self._delete(stream)

    @staticmethod
    def _check_trim(stream: str, before: int, head: int) -> None:
        """For a store's `_trim`: refuse a trim beyond head + 1 (the SPI's one rule for it).

        Raises:
            InvalidArgumentError: `before` is beyond `head` + 1.
        """
        if before > head + 1:
            raise InvalidArgumentError(
                f"cannot trim {stream!r} below {before}: its head is {head}, so the most "
                f"a trim can drop is everything, trim({stream!r}, {head + 1})"
            )

    def close(self) -> None:  # noqa: B027 - most stores have nothing to release
        """Release the store's resources. Stores that hold none need not override it."""

    def __enter__(self) -> JournalStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @abc.abstractmethod
    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int: ...

    def _append_unsynced(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        """`append(..., sync=False)`: a store that can leave an append's sync to the
        next synced one overrides it; by default, an append like any other."""
        return self._append(stream, expected, records)

    @abc.abstractmethod
    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]: ...

    @abc.abstractmethod
    def _head(self, stream: str) -> int: ...

    @abc.abstractmethod
    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]: ...

    @abc.abstractmethod
    def _trim(self, stream: str, before: int) -> None: ...

    @abc.abstractmethod
    def _delete(self, stream: str) -> None: ...
