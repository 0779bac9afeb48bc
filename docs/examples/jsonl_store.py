"""A journal store in a directory of JSON-lines files: an example written from docs/spi.md alone.

One file per stream, named by the percent-quoted stream id (so '/' needs no
directories); a `.floor` line records how far the stream was trimmed and a
`.deleted` file retires a deleted name. A lock file (fcntl) serialises writers
across processes, and a threading lock across threads. Good for a demo and for
the conformance kit; not fast, and a crash mid-write can leave a torn last line,
which this store refuses to read rather than guess at.

    from loom_kernel import open_store
    from loom_kernel.spi import register_store
    register_store("jsonl", open_jsonl_store)
    store = open_store("jsonl:///var/lib/loom-journal")
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from loom_kernel.spi import (
    ConflictError,
    InvalidArgumentError,
    JournalStore,
    NewRecord,
    Record,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
)


class JsonlStore(JournalStore):
    """Streams as JSON-lines files in one directory."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._dir = Path(directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._thread_lock = threading.Lock()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock, open(self._dir / ".lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _path(self, stream: str, suffix: str = ".jsonl") -> Path:
        return self._dir / (quote(stream, safe="") + suffix)

    def _load(self, stream: str) -> tuple[int, list[Record]]:
        """Return (floor, retained records) of a live stream; raise if it was deleted."""
        tomb = self._path(stream, ".deleted")
        if tomb.exists():
            raise StreamDeletedError(stream, int(tomb.read_text()))
        path = self._path(stream)
        if not path.exists():
            return 0, []
        floor, found = 0, []
        try:
            with open(path, encoding="utf-8") as handle:
                for line in handle:
                    row: dict[str, Any] = json.loads(line)
                    if "floor" in row:
                        floor = row["floor"]
                        continue
                    found.append(Record(row["p"], row["k"], base64.b64decode(row["b"]), row["t"]))
        except (ValueError, KeyError) as exc:
            raise StoreUnavailableError(f"stream file {path} is damaged: {exc}") from exc
        return floor, found

    @staticmethod
    def _line(record: Record) -> str:
        body = base64.b64encode(record.payload).decode()
        return json.dumps(
            {"p": record.position, "k": record.kind, "b": body, "t": record.timestamp}
        )

    def _rewrite(self, stream: str, floor: int, kept: list[Record]) -> None:
        path = self._path(stream)
        scratch = path.with_suffix(".tmp")
        with open(scratch, "w", encoding="utf-8") as handle:
            handle.write(json.dumps({"floor": floor}) + "\n")
            handle.writelines(self._line(record) + "\n" for record in kept)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(scratch, path)

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        with self._locked():
            floor, found = self._load(stream)
            head = floor + len(found)
            if head != expected:
                raise ConflictError(stream, expected, head)
            lines = "".join(
                self._line(Record(expected + i, r.kind, r.payload, float(r.timestamp))) + "\n"
                for i, r in enumerate(records, start=1)
            )
            with open(self._path(stream), "a", encoding="utf-8") as handle:
                handle.write(lines)  # one write: the batch lands whole or the file is torn
                handle.flush()
                os.fsync(handle.fileno())
            return expected + len(records)

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        with self._locked():
            floor, found = self._load(stream)
        if after < floor:
            raise TrimmedError(stream, after, floor)
        start = after - floor
        return found[start : None if limit is None else start + limit]

    def _head(self, stream: str) -> int:
        with self._locked():
            floor, found = self._load(stream)
        return floor + len(found)

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        with self._locked():
            names = sorted(
                unquote(entry.name[: -len(".jsonl")])
                for entry in self._dir.iterdir()
                if entry.name.endswith(".jsonl")
            )
        chosen = [n for n in names if n.startswith(prefix) and (after is None or n > after)]
        return chosen[:limit] if limit is not None else chosen

    def _trim(self, stream: str, before: int) -> None:
        with self._locked():
            floor, found = self._load(stream)
            head = floor + len(found)
            if before > head + 1:
                raise InvalidArgumentError(f"cannot trim {stream!r} below {before}: head is {head}")
            if before - 1 > floor:
                self._rewrite(stream, before - 1, found[before - 1 - floor :])

    def _delete(self, stream: str) -> None:
        with self._locked():
            try:
                floor, found = self._load(stream)
            except StreamDeletedError:
                return
            self._path(stream, ".deleted").write_text(str(floor + len(found)))
            self._path(stream).unlink(missing_ok=True)


def open_jsonl_store(url: str) -> JsonlStore:
    """Open `jsonl:///absolute/directory`."""
    parts = urlsplit(url)
    if parts.scheme != "jsonl" or not parts.path:
        raise InvalidArgumentError(f"a jsonl store URL is jsonl:///directory, not {url!r}")
    return JsonlStore(parts.path)
