"""Large payloads as content-addressed blobs, beside the journal.

A store with a blob store (`JournalStore.use_blobs`) writes a record whose payload is
over its `blob_threshold` as a blob first, named `sha256:<hex>` of the payload's bytes
(for a payload that is canonical JSON, its `stable_hash`), and journals a short
reference in its place; a read gives the blob's bytes back in the record, exactly as
written, so nothing above the store sees the difference. Equal payloads share a blob.

A blob is deleted in two steps, each only when no record names it (the seed's gc
walk, `reachable`, over every record) and a grace period has passed: `collect_blobs`
first moves a blob written longer than the grace ago to the trash, then, at a
collection at least a grace later, deletes it from the trash. A read of a blob in the
trash brings it back (a record may have come to name it meanwhile: a writer that
stalled past a grace between its blob and its record), and a writer looks for its
blob once its record landed and brings it back, or writes it again.
"""

from __future__ import annotations

import abc
import hashlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Final

from loom_kernel._core import (
    InvalidArgumentError,
    InvalidIdError,
    NotFoundError,
    Record,
    SchemaError,
)

__all__ = [
    "BLOB_MARK",
    "DEFAULT_BLOB_THRESHOLD",
    "BlobNotFoundError",
    "BlobStore",
    "MemoryBlobs",
    "blob_key",
    "blob_of",
    "check_not_a_reference",
    "reference",
    "resolved",
    "validate_blob_key",
]

#: Payloads above this many bytes go to the blob store, by default (64 KiB).
DEFAULT_BLOB_THRESHOLD: Final = 64 * 1024
#: What a journaled reference to a blob starts with; a payload that does is refused.
BLOB_MARK: Final = b"\x00loom.blob\x00"
_KEY: Final = re.compile(r"sha256:[0-9a-f]{64}")
_REFERENCE_LENGTH: Final = len(BLOB_MARK) + len("sha256:") + 64


class BlobNotFoundError(NotFoundError):
    """A record names a blob its store does not hold (deleted by other means, or a
    store opened with another blob store than the one it was written with)."""


def validate_blob_key(key: object) -> str:
    """A blob's name: `sha256:` and 64 lowercase hex digits.

    Raises:
        InvalidIdError: it is not one (before it becomes a path or an object key).
    """
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        raise InvalidIdError(key, "a blob key is 'sha256:' and 64 lowercase hex digits")
    return key


def blob_key(data: bytes) -> str:
    """The name of a blob holding `data`."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


class BlobStore(abc.ABC):
    """Where a journal store keeps its large payloads: bytes by their sha256 name, and a
    trash that a read of a blob brings it back from (see the module's docstring).

    `put` of a key that exists writes it again (its time is then now): a writer about
    to name a blob refreshes it, so a collector's grace counts from then.
    """

    def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key` (its sha256), replacing (refreshing) any copy."""
        self._put(validate_blob_key(key), data)

    def get(self, key: str) -> bytes:
        """The blob's bytes, checked against its name; a blob in the trash is brought
        back first.

        Raises:
            BlobNotFoundError: there is no such blob, live or in the trash.
            SchemaError: the bytes held are not the blob's (damaged).
        """
        validate_blob_key(key)
        try:
            data = self._get(key)
        except BlobNotFoundError:
            if not self._restore(key):
                raise
            data = self._get(key)
        if blob_key(data) != key:
            raise SchemaError(f"blob {key} holds other bytes than its name says: damaged")
        return data

    def exists(self, key: str) -> bool:
        """Whether the blob is there (live, not in the trash)."""
        return self._modified(validate_blob_key(key)) is not None

    def modified(self, key: str) -> float | None:
        """When the blob was last written (epoch seconds), None when it is not live."""
        return self._modified(validate_blob_key(key))

    def delete(self, key: str) -> None:
        """Delete a live blob at once, by-passing the trash (absent is allowed)."""
        self._delete(validate_blob_key(key))

    def discard(self, key: str) -> None:
        """Move a live blob to the trash, stamped with the time (absent is allowed)."""
        self._discard(validate_blob_key(key))

    def restore(self, key: str) -> bool:
        """Bring a blob back from the trash; whether it was there."""
        return self._restore(validate_blob_key(key))

    def purge(self, key: str) -> None:
        """Delete a blob from the trash (absent is allowed)."""
        self._purge(validate_blob_key(key))

    def remove_leftovers(self, before: float) -> int:
        """Remove what writers that died left half written before `before` (a blob
        store that writes through a temporary name); how many."""
        return 0

    @abc.abstractmethod
    def entries(self) -> Iterator[tuple[str, float]]:
        """Every live blob: (its key, when it was last written)."""

    @abc.abstractmethod
    def trashed(self) -> Iterator[tuple[str, float]]:
        """Every blob in the trash: (its key, when it was moved there)."""

    @abc.abstractmethod
    def _put(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def _get(self, key: str) -> bytes:
        """Raises BlobNotFoundError when the blob is not live."""

    @abc.abstractmethod
    def _delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def _modified(self, key: str) -> float | None: ...

    @abc.abstractmethod
    def _discard(self, key: str) -> None: ...

    @abc.abstractmethod
    def _restore(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _purge(self, key: str) -> None: ...


class MemoryBlobs(BlobStore):
    """Blobs in this process's memory (tests, `memory://` stores)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._blobs: dict[str, tuple[bytes, float]] = {}
        self._trash: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()

    def entries(self) -> Iterator[tuple[str, float]]:
        with self._lock:
            found = [(key, at) for key, (_data, at) in self._blobs.items()]
        yield from sorted(found)

    def trashed(self) -> Iterator[tuple[str, float]]:
        with self._lock:
            found = [(key, at) for key, (_data, at) in self._trash.items()]
        yield from sorted(found)

    def _put(self, key: str, data: bytes) -> None:
        with self._lock:
            self._blobs[key] = (bytes(data), self._clock())

    def _get(self, key: str) -> bytes:
        with self._lock:
            found = self._blobs.get(key)
        if found is None:
            raise BlobNotFoundError(f"no blob {key}")
        return found[0]

    def _delete(self, key: str) -> None:
        with self._lock:
            self._blobs.pop(key, None)

    def _modified(self, key: str) -> float | None:
        with self._lock:
            found = self._blobs.get(key)
        return None if found is None else found[1]

    def _discard(self, key: str) -> None:
        with self._lock:
            found = self._blobs.pop(key, None)
            if found is not None:
                self._trash[key] = (found[0], self._clock())

    def _restore(self, key: str) -> bool:
        with self._lock:
            found = self._trash.pop(key, None)
            if found is not None:
                self._blobs[key] = (found[0], self._clock())
        return found is not None

    def _purge(self, key: str) -> None:
        with self._lock:
            self._trash.pop(key, None)


def check_not_a_reference(payload: bytes) -> None:
    """Refuse a payload that begins as a blob reference does (at any size, blobs on or
    not: read back, it would be taken for one).

    Raises:
        InvalidArgumentError: it does.
    """
    if payload.startswith(BLOB_MARK):
        raise InvalidArgumentError(
            f"a payload may not begin with {BLOB_MARK!r}: that is how a blob reference begins"
        )


def blob_of(payload: bytes) -> str | None:
    """The key a journaled reference names, or None for a payload that is not one.

    Raises:
        InvalidIdError: a reference with a malformed key (a damaged record).
    """
    if len(payload) != _REFERENCE_LENGTH or not payload.startswith(BLOB_MARK):
        return None
    return validate_blob_key(payload[len(BLOB_MARK) :].decode("ascii", "replace"))


def reference(key: str) -> bytes:
    """The payload journaled in place of a blob."""
    return BLOB_MARK + key.encode("ascii")


def resolved(blobs: BlobStore | None, records: list[Record]) -> list[Record]:
    """`records` with every blob reference replaced by its blob's bytes.

    Raises:
        BlobNotFoundError: a referenced blob is not there (or no blob store is set).
        SchemaError: a blob is damaged.
    """
    out = records
    for index, record in enumerate(records):
        key = blob_of(record.payload)
        if key is None:
            continue
        if blobs is None:
            raise BlobNotFoundError(
                f"record {record.position} refers to blob {key}, but the store has no blob "
                "store set (open it with the blob store it was written with)"
            )
        if out is records:
            out = list(records)
        out[index] = Record(record.position, record.kind, blobs.get(key), record.timestamp)
    return out
