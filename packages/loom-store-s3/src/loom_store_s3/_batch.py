"""One S3 object per batch: a JSON header line, then the payloads back to back.

    {"v":1,"commit":"…","start":7,"count":2,"kinds":[…],"ts":[…],"sizes":[…]}\\n<payload bytes>

A *stub* is a batch whose records were trimmed away ("state":"stub": no kinds,
timestamps or payloads, but its start and count stay, so the chain of batches still
gives the head). A *tombstone* is a batch of no records ("state":"tomb") that ends a
deleted stream and occupies the key of its next append.
"""

from __future__ import annotations

import json
from typing import Final, Literal

import attrs
from loom_kernel.spi import NewRecord, Record, SchemaError, StoreUnavailableError

from loom_store_s3._layout import FORMAT

__all__ = ["Batch", "decode_batch", "encode_batch", "encode_marker"]

State = Literal["live", "stub", "tomb"]
_STATES: Final = ("live", "stub", "tomb")


@attrs.frozen
class Batch:
    """A decoded batch object."""

    commit: str
    start: int
    count: int
    state: State
    records: tuple[Record, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.count


def _header(commit: str, start: int, count: int, state: State) -> dict[str, object]:
    return {"v": FORMAT, "commit": commit, "start": start, "count": count, "state": state}


def encode_batch(commit: str, start: int, records: tuple[NewRecord, ...]) -> bytes:
    header = _header(commit, start, len(records), "live")
    header["kinds"] = [record.kind for record in records]
    header["ts"] = [float(record.timestamp) for record in records]
    header["sizes"] = [len(record.payload) for record in records]
    line = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([line, b"\n", *(record.payload for record in records)])


def encode_marker(commit: str, start: int, count: int, state: State) -> bytes:
    """A stub (records trimmed, count kept) or a tombstone (count 0)."""
    return json.dumps(_header(commit, start, count, state), separators=(",", ":")).encode()


def _damaged(key: str, why: str) -> StoreUnavailableError:
    return StoreUnavailableError(f"damaged batch object {key!r}: {why}")


def decode_batch(key: str, body: bytes) -> Batch:
    """Parse a batch object, checking every field; a damaged one is StoreUnavailableError."""
    newline = body.find(b"\n")
    line, rest = (body, b"") if newline < 0 else (body[:newline], body[newline + 1 :])
    try:
        header = json.loads(line)
    except ValueError as exc:
        raise _damaged(key, f"unreadable header ({exc})") from None
    if not isinstance(header, dict):
        raise _damaged(key, "the header is not an object")
    version = header.get("v")
    if isinstance(version, int) and version > FORMAT:
        raise SchemaError(
            f"batch object {key!r} has format {version}, newer than this loom-store-s3 "
            f"(format {FORMAT}): upgrade loom-store-s3"
        )
    commit, start, count, state = (
        header.get(name) for name in ("commit", "start", "count", "state")
    )
    if (
        version != FORMAT
        or not isinstance(commit, str)
        or not _is_count(start)
        or not _is_count(count)
        or state not in _STATES
    ):
        raise _damaged(key, "bad header fields")
    assert isinstance(start, int)  # for mypy: checked above
    assert isinstance(count, int)
    if state != "live":
        return Batch(commit, start, count, state)
    kinds, stamps, sizes = header.get("kinds"), header.get("ts"), header.get("sizes")
    if not (
        isinstance(kinds, list)
        and isinstance(stamps, list)
        and isinstance(sizes, list)
        and len(kinds) == len(stamps) == len(sizes) == count
        and all(_is_count(size) for size in sizes)
        and sum(sizes) == len(rest)
    ):
        raise _damaged(key, "its record table does not match its payload bytes")
    records: list[Record] = []
    offset = 0
    for index, (kind, stamp, size) in enumerate(zip(kinds, stamps, sizes, strict=True)):
        if (
            not isinstance(kind, str)
            or isinstance(stamp, bool)
            or not isinstance(stamp, int | float)
        ):
            raise _damaged(key, f"record {start + index + 1} has a bad kind or timestamp")
        records.append(Record(start + index + 1, kind, rest[offset : offset + size], float(stamp)))
        offset += size
    return Batch(commit, start, count, "live", tuple(records))


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
