"""Appending to a stream that many writers add to, wherever its head is now."""

from __future__ import annotations

from collections.abc import Sequence

from loom_kernel._core import ConflictError, NewRecord
from loom_kernel._spi import JournalStore

__all__ = ["append_anywhere"]


def append_anywhere(
    store: JournalStore, stream: str, records: Sequence[NewRecord], head: int = 0
) -> int:
    """Append `records` at the stream's head, whatever it is; the last one's position.

    For streams whose records need no place of their own (an index, an inbox, a
    queue's adds): `head` is a guess (where this writer last left the stream, so a
    quiet stream costs one request), and a conflict names the head to try next.
    """
    while True:
        try:
            return store.append(stream, head, records)
        except ConflictError as exc:
            head = exc.actual if exc.actual != head else store.head(stream)
