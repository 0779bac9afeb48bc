"""The due-timer index: a hint, written before the suspend it points at, verified on firing.

Timers live in per-minute bucket streams `timers/<minute>`; each record names an
execution, a gate and a wake time. The execution's journal is the truth: firing
checks that the run is still parked at that gate before it resumes it, so a stale,
doubled or orphaned hint wakes nothing by mistake.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

import attrs

from loom_kernel._errors import ConflictError, StreamDeletedError, TrimmedError
from loom_kernel._journal import JournalStore, NewRecord, Record

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["TimerEntry", "TimerIndex"]

TIMER_KIND: Final = "loom.timer"
PREFIX: Final = "timers/"
BUCKET_SECONDS: Final = 60
#: Fully handled buckets older than this are deleted; younger ones are only trimmed,
#: so a writer whose clock runs late never meets a retired bucket name.
DELETE_AFTER: Final = 86_400


@attrs.frozen
class TimerEntry:
    """One hint: wake `execution_id` at gate `gate` at `wake_at`."""

    execution_id: str
    gate: int
    wake_at: float


def _bucket_of(moment: float) -> int:
    return int(moment // BUCKET_SECONDS)


def _stream(bucket: int) -> str:
    return f"{PREFIX}{bucket:012d}"


class TimerIndex:
    """Reads and writes the due-timer buckets of one store."""

    def __init__(self, store: JournalStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock

    def add(self, execution_id: str, gate: int, wake_at: float) -> None:
        """Record a hint (retrying on a racing writer of the same bucket)."""
        payload = json.dumps({"id": execution_id, "gate": gate, "wake_at": wake_at}).encode()
        record = NewRecord(TIMER_KIND, payload, self._clock())
        stream = _stream(_bucket_of(wake_at))
        while True:
            try:
                head = self._store.head(stream)
                self._store.append(stream, head, [record])
                return
            except ConflictError:
                continue
            except StreamDeletedError:
                # The bucket was handled and retired: this wake time is long past,
                # so the bucket of the present minute serves (it is due at once).
                stream = _stream(_bucket_of(self._clock()))

    def due_buckets(self, now: float) -> Iterator[tuple[str, int, list[TimerEntry]]]:
        """Yield (stream, head, entries) for every bucket that holds anything due at `now`."""
        last = _stream(_bucket_of(now))
        after: str | None = None
        while True:
            names = self._store.streams(PREFIX, after, 100)
            if not names:
                return
            for name in names:
                if name > last:
                    return
                try:
                    head = self._store.head(name)
                    records = self._retained(name)
                except StreamDeletedError:
                    continue
                entries = []
                for record in records:
                    data = json.loads(record.payload)
                    entries.append(
                        TimerEntry(data["id"], int(data["gate"]), float(data["wake_at"]))
                    )
                yield name, head, entries
            after = names[-1]

    def _retained(self, stream: str) -> list[Record]:
        """A bucket's records not yet trimmed away (buckets are trimmed once handled)."""
        try:
            return self._store.read(stream)
        except TrimmedError as exc:
            return self._store.read(stream, exc.floor)

    def settle(self, stream: str, head: int, now: float) -> None:
        """Drop a bucket's handled hints: trim it, or delete it once it is old."""
        bucket_end = (int(stream.removeprefix(PREFIX)) + 1) * BUCKET_SECONDS
        try:
            if bucket_end + DELETE_AFTER <= now and self._store.head(stream) == head:
                self._store.delete(stream)
            else:
                self._store.trim(stream, head + 1)
        except StreamDeletedError:
            pass
