"""The memory:// store: the reference implementation of the journal protocol."""

from __future__ import annotations

import bisect
import threading
import uuid
from urllib.parse import urlsplit

import attrs

from loom_kernel._core import (
    ConflictError,
    InvalidArgumentError,
    NewRecord,
    Record,
    StreamDeletedError,
    TrimmedError,
)
from loom_kernel._spi._faults import AmbiguousWriteError, FaultInjection
from loom_kernel._spi._journal import JournalStore

__all__ = ["MemoryStore", "open_memory_store"]


@attrs.define
class _Stream:
    records: list[Record] = attrs.Factory(list)
    commits: list[str] = attrs.Factory(list)  # the commit id of each retained record
    floor: int = 0
    deleted: bool = False

    @property
    def head(self) -> int:
        return self.floor + len(self.records)


@attrs.define
class _State:
    lock: threading.Lock = attrs.Factory(threading.Lock)
    streams: dict[str, _Stream] = attrs.Factory(dict)
    live_names: list[str] = attrs.Factory(list)  # sorted names of streams not deleted


_NAMED: dict[str, _State] = {}
_NAMED_LOCK = threading.Lock()


class MemoryStore(FaultInjection, JournalStore):
    """Streams in process memory, thread-safe; the model the conformance kit compares against.

    `memory://` gives a new, private store. `memory://NAME` gives a store over the
    process-wide state named NAME, so opening the same URL again sees the same streams
    (the kit uses it to close and reopen, and to open a second instance).

    Attributes:
        name: the shared state's name; None for a private store.
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        if name is None:
            self._state = _State()
        else:
            with _NAMED_LOCK:
                self._state = _NAMED.setdefault(name, _State())

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        lose_reply = self._next_fault(stream)
        commit = uuid.uuid4().hex
        try:
            return self._write(stream, expected, records, commit, lose_reply=lose_reply)
        except AmbiguousWriteError:
            return self._confirm(stream, expected, len(records), commit)

    def _write(
        self,
        stream: str,
        expected: int,
        records: tuple[NewRecord, ...],
        commit: str,
        *,
        lose_reply: bool,
    ) -> int:
        state = self._state
        with state.lock:
            entry = state.streams.get(stream)
            if entry is not None and entry.deleted:
                raise StreamDeletedError(stream, entry.head)
            head = entry.head if entry is not None else 0
            if head != expected:
                raise ConflictError(stream, expected, head)
            if entry is None:
                entry = state.streams[stream] = _Stream()
                bisect.insort(state.live_names, stream)
            for offset, record in enumerate(records, start=1):
                entry.records.append(
                    Record(expected + offset, record.kind, record.payload, float(record.timestamp))
                )
                entry.commits.append(commit)
            new_head = entry.head
        if lose_reply:
            raise AmbiguousWriteError
        return new_head

    def _confirm(self, stream: str, expected: int, count: int, commit: str) -> int:
        """Resolve an ambiguous append: the record after `expected` tells whose write landed."""
        state = self._state
        with state.lock:
            entry = state.streams.get(stream)
            if entry is None:
                raise ConflictError(stream, expected, 0)
            index = expected - entry.floor
            if 0 <= index < len(entry.commits) and entry.commits[index] == commit:
                return expected + count
            raise ConflictError(stream, expected, entry.head)

    def _live(self, stream: str) -> _Stream | None:
        entry = self._state.streams.get(stream)
        if entry is not None and entry.deleted:
            raise StreamDeletedError(stream, entry.head)
        return entry

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        with self._state.lock:
            entry = self._live(stream)
            if entry is None:
                return []
            if after < entry.floor:
                raise TrimmedError(stream, after, entry.floor)
            start = after - entry.floor
            stop = None if limit is None else start + limit
            return entry.records[start:stop]

    def _head(self, stream: str) -> int:
        with self._state.lock:
            entry = self._live(stream)
            return 0 if entry is None else entry.head

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        with self._state.lock:
            names = self._state.live_names
            start = bisect.bisect_left(names, prefix)
            if after is not None and after >= prefix:
                start = bisect.bisect_right(names, after)
            found: list[str] = []
            for name in names[start:]:
                if not name.startswith(prefix) or (limit is not None and len(found) >= limit):
                    break
                found.append(name)
            return found

    def _trim(self, stream: str, before: int) -> None:
        with self._state.lock:
            entry = self._live(stream)
            self._check_trim(stream, before, 0 if entry is None else entry.head)
            if entry is None or before - 1 <= entry.floor:
                return
            drop = before - 1 - entry.floor
            del entry.records[:drop]
            del entry.commits[:drop]
            entry.floor = before - 1

    def _delete(self, stream: str) -> None:
        state = self._state
        with state.lock:
            entry = state.streams.get(stream)
            if entry is None:
                state.streams[stream] = _Stream(deleted=True)
                return
            if entry.deleted:
                return
            entry.floor = entry.head
            entry.records.clear()
            entry.commits.clear()
            entry.deleted = True
            index = bisect.bisect_left(state.live_names, stream)
            del state.live_names[index]


def open_memory_store(url: str) -> MemoryStore:
    """Open `memory://` (a new private store) or `memory://NAME` (a named, shared one)."""
    parts = urlsplit(url)
    if parts.scheme != "memory" or parts.path not in ("", "/") or parts.query:
        raise InvalidArgumentError(f"a memory store URL is memory:// or memory://NAME, not {url!r}")
    return MemoryStore(parts.netloc or None)
