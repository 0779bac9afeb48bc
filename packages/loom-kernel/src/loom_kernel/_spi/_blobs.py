"""Large payloads as content-addressed blobs, beside the journal.

A store with a blob store (`JournalStore.use_blobs`) writes a record whose payload is
over its `blob_threshold` as a blob first, named `sha256:<hex>` of the blob's bytes,
and journals a small reference in its place; a read gives the blob's bytes back in
the record, so nothing above the store sees the difference. A payload that is JSON is
kept as its canonical JSON (`stable_stringify`), so its name is its `stable_hash` and
equal values share one blob; any other payload is kept as its bytes.

A blob is deleted only by `collect_blobs`: when no record of the store refers to it
(the seed's gc walk, `reachable`, from every record that names a blob) and it is
older than a grace period, so a writer racing the collector (blob written, record not
yet appended) never loses its blob. A writer also looks for its blob again once its
record landed, and writes it again if a collector took it meanwhile.
"""

from __future__ import annotations

import abc
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Final

from loom_kernel._core import (
    CanonicalJSONError,
    InvalidIdError,
    NotFoundError,
    Record,
    StoreUnavailableError,
    stable_stringify,
)

__all__ = [
    "BLOB_MARK",
    "DEFAULT_BLOB_THRESHOLD",
    "BlobNotFoundError",
    "BlobStore",
    "MemoryBlobs",
    "blob_content",
    "blob_of",
    "reference",
    "resolved",
    "validate_blob_key",
]

#: Payloads above this many bytes go to the blob store, by default (64 KiB).
DEFAULT_BLOB_THRESHOLD: Final = 64 * 1024
#: What a journaled reference to a blob starts with (no JSON payload can: a NUL).
BLOB_MARK: Final = b"\x00loom.blob\x00"
_KEY: Final = re.compile(r"sha256:[0-9a-f]{64}")


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


class BlobStore(abc.ABC):
    """Where a journal store keeps its large payloads: bytes by their sha256 name.

    `put` of a key that exists writes it again (its time is then now): a writer about
    to refer to a blob refreshes it, so a collector's grace counts from then.
    """

    def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key` (its sha256), replacing (refreshing) any copy."""
        self._put(validate_blob_key(key), data)

    def get(self, key: str) -> bytes:
        """The blob's bytes, checked against its name.

        Raises:
            BlobNotFoundError: there is no such blob.
            StoreUnavailableError: the bytes read are not the blob's (a torn copy).
        """
        data = self._get(validate_blob_key(key))
        if "sha256:" + hashlib.sha256(data).hexdigest() != key:
            raise StoreUnavailableError(f"blob {key} read back other bytes than its name says")
        return data

    def exists(self, key: str) -> bool:
        """Whether the blob is there."""
        return self._modified(validate_blob_key(key)) is not None

    def delete(self, key: str) -> None:
        """Delete a blob (deleting one that is not there is allowed)."""
        self._delete(validate_blob_key(key))

    def modified(self, key: str) -> float | None:
        """When the blob was last written (epoch seconds), None when it is not there."""
        return self._modified(validate_blob_key(key))

    @abc.abstractmethod
    def entries(self) -> Iterator[tuple[str, float]]:
        """Every blob: (its key, when it was last written)."""

    @abc.abstractmethod
    def _put(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def _get(self, key: str) -> bytes:
        """Raises BlobNotFoundError when the blob is not there."""

    @abc.abstractmethod
    def _delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def _modified(self, key: str) -> float | None: ...


class MemoryBlobs(BlobStore):
    """Blobs in this process's memory (tests, `memory://` stores)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._blobs: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()

    def entries(self) -> Iterator[tuple[str, float]]:
        with self._lock:
            found = [(key, at) for key, (_data, at) in self._blobs.items()]
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


def blob_content(payload: bytes) -> tuple[str, bytes]:
    """(the blob's key, its bytes) for a payload: its canonical JSON when it is JSON
    that has one, else the payload itself."""
    try:
        content = stable_stringify(json.loads(payload)).encode("utf-8")
    except (ValueError, RecursionError, CanonicalJSONError):
        content = payload
    return "sha256:" + hashlib.sha256(content).hexdigest(), content


def blob_of(payload: bytes) -> str | None:
    """The key a journaled reference names, or None for a payload that is not one.

    Raises:
        InvalidIdError: a reference with a malformed key (a damaged record).
    """
    if not payload.startswith(BLOB_MARK):
        return None
    return validate_blob_key(payload[len(BLOB_MARK) :].decode("ascii", "replace"))


def reference(key: str) -> bytes:
    """The payload journaled in place of a blob."""
    return BLOB_MARK + key.encode("ascii")


def resolved(blobs: BlobStore | None, records: list[Record]) -> list[Record]:
    """`records` with every blob reference replaced by its blob's bytes.

    Raises:
        BlobNotFoundError: a referenced blob is not there (or no blob store is set).
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
