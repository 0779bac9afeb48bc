"""Records: what a journal holds, and the gapless rule every read of one keeps.

A store gives each `NewRecord` its position in its stream (1, 2, 3, ...) and returns
it as a `Record`. Stores never parse payloads: the kernel encodes and decodes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import isfinite
from typing import Final, NamedTuple

import attrs

from loom_kernel._core._errors import InvalidArgumentError, SchemaError
from loom_kernel._core._numbers import finite_number

__all__ = ["MAX_KIND_LENGTH", "NewRecord", "Record", "check_gapless"]

MAX_KIND_LENGTH: Final = 64

_KINDS_KEPT: Final = 256
_kinds_seen: set[str] = set()  # record kinds that passed the check


@attrs.frozen
class NewRecord:
    """A record to append: the store gives it its position.

    Attributes:
        kind: what the record is (printable ASCII, at most 64 characters).
        payload: opaque bytes; stores never parse them.
        timestamp: seconds since the epoch, from the kernel's injected clock; a
            finite number (NaN and infinities are refused: no store could keep them
            exactly, and no clock gives them).
    """

    kind: str
    payload: bytes
    timestamp: float

    def __attrs_post_init__(self) -> None:
        # One check after init rather than a validator call per field: the kernel
        # makes one of these for every journaled step.
        kind, payload, timestamp = self.kind, self.payload, self.timestamp
        if type(kind) is not str or kind not in _kinds_seen:
            if (
                not isinstance(kind, str)
                or not kind
                or len(kind) > MAX_KIND_LENGTH
                or not kind.isascii()
                or not kind.isprintable()
            ):
                raise InvalidArgumentError(
                    f"a record kind must be 1 to {MAX_KIND_LENGTH} printable ASCII "
                    f"characters, not {kind!r}"
                )
            if type(kind) is str and len(_kinds_seen) < _KINDS_KEPT:
                _kinds_seen.add(kind)  # a store's few kinds, checked once each
        if not isinstance(payload, bytes):
            raise InvalidArgumentError(
                f"a record payload must be bytes, not {type(payload).__name__}"
            )
        # A float from a clock is the common case: one type test and one isfinite.
        if not (type(timestamp) is float and isfinite(timestamp)) and not finite_number(timestamp):
            raise InvalidArgumentError(
                f"a record timestamp must be a finite number, not {timestamp!r}"
            )


class Record(NamedTuple):
    """A stored record: a NewRecord with the position the store gave it (1, 2, 3, ...).

    A named tuple, so a store can build one straight from a database row
    (`Record._make(row)`) on the read path, where it is made once per record.
    """

    position: int
    kind: str
    payload: bytes
    timestamp: float


def check_gapless(records: Sequence[Record], after: int, stream: str) -> None:
    """Check that `records` are exactly positions after+1, after+2, ... of `stream`.

    A store returns records in strictly increasing order, so the two ends decide; only
    a failure looks at every record, to name the first one out of place.

    Raises:
        SchemaError: a record is missing (a gap), or out of place; naming the stream
            and the position where the journal breaks.
    """
    if not records:
        return
    if records[0][0] == after + 1 and records[-1][0] == after + len(records):
        return
    for expected, record in enumerate(records, start=after + 1):
        if record[0] != expected:
            found = record[0]
            break
    else:  # pragma: no cover - the ends above disagree, so some record is out of place
        expected, found = after + len(records), records[-1][0]
    what = f"record {expected} is missing" if found > expected else f"found record {found} again"
    raise SchemaError(
        f"the journal has a gap: {what} (the store lost or reordered a record; the run "
        "cannot be folded without it)",
        stream=stream,
        position=expected,
    )
