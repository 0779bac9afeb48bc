"""The due-timer index: a hint, written before the suspend it points at, verified on firing.

Timers live in per-minute bucket streams `timers/<minute>`; each record names an
execution, a gate and a wake time. The execution's journal is the truth: firing
checks that the run is still parked at that gate before it resumes it, so a stale,
doubled or orphaned hint wakes nothing by mistake.

Buckets are retired (deleted) once every hint in them is handled, so an idle poll
lists only the buckets that still hold work. Retiring must never lose a hint that a
writer is adding at the same moment, whatever the writers' clocks say:

- the firing side first *seals* the bucket: it appends a seal record at exactly the
  head it has handled, which fails if any hint arrived since, and only then deletes;
- a writer looks at a bucket's last record before it appends: a sealed or deleted
  bucket sends the hint to the overdue stream instead, which is never retired.

A writer and a sealer that race append at the same head, so exactly one wins: the
hint lands before the seal (and the sealer sees it next time) or after the writer
has seen the seal. No clock decides anything here, so a writer whose clock runs a
day late (or a year) still parks its run where a poll will find it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from math import isfinite
from typing import Final

import attrs

from loom_kernel._coordination._timer_floor import TimerFloor
from loom_kernel._core import (
    ConflictError,
    InvalidArgumentError,
    LoomError,
    NewRecord,
    NotSuspendedError,
    Record,
    SchemaError,
    StreamDeletedError,
    TrimmedError,
)
from loom_kernel._spi import JournalStore

__all__ = ["OVERDUE", "QUARANTINE", "TimerEntry", "TimerIndex"]

TIMER_KIND: Final = "loom.timer"
SEAL_KIND: Final = "loom.timer.sealed"
PREFIX: Final = "timers/"
#: Hints whose bucket was already retired. It sorts before every minute bucket
#: ('-' < '0'), is read on every poll, and is trimmed but never deleted.
OVERDUE: Final = PREFIX + "-overdue"
#: Hints that cannot be read (damaged records) are copied here, then dropped.
QUARANTINE: Final = "quarantine/timers"
BUCKET_SECONDS: Final = 60
_LAST_BUCKET: Final = 10**12 - 1  # bucket names have 12 digits
_PAGE: Final = 100
_READ_ATTEMPTS: Final = 8
_BY_NAME: Final = 16  # a poll reads this many minutes by name rather than list them
_UNREADABLE: Final = -1  # the floor's origin, when its mark cannot be read

_log = logging.getLogger("loom")


@attrs.frozen
class TimerEntry:
    """One hint: wake `execution_id` at gate `gate` at `wake_at`."""

    execution_id: str
    gate: int
    wake_at: float


@attrs.frozen
class _Hint:
    position: int
    entry: TimerEntry | None  # None: the record cannot be read
    record: Record


@attrs.frozen
class _Bucket:
    stream: str
    head: int
    hints: tuple[_Hint, ...]
    sealed: bool


def _bucket_of(moment: float) -> int:
    if not isfinite(moment):
        raise InvalidArgumentError(f"a wake time must be a finite number, not {moment!r}")
    return min(_LAST_BUCKET, max(0, int(moment // BUCKET_SECONDS)))


def _stream(bucket: int) -> str:
    return f"{PREFIX}{bucket:012d}"


def _bucket_number(stream: str) -> int | None:
    digits = stream.removeprefix(PREFIX)
    return int(digits) if len(digits) == 12 and digits.isdigit() else None


def _entry(record: Record) -> TimerEntry | None:
    """A hint record's entry; None when it is damaged."""
    if record.kind != TIMER_KIND:
        return None
    try:
        data = json.loads(record.payload)
        execution_id, gate, wake_at = data["id"], data["gate"], data["wake_at"]
    except (ValueError, TypeError, KeyError):
        return None
    if (
        not isinstance(execution_id, str)
        or isinstance(gate, bool)
        or not isinstance(gate, int)
        or gate < 0
        or isinstance(wake_at, bool)
        or not isinstance(wake_at, int | float)
    ):
        return None
    return TimerEntry(execution_id, gate, float(wake_at))


#: What firing one hint did: True woken, False nothing to do (obsolete), None not yet.
Wake = Callable[[TimerEntry], "bool | None"]


class TimerIndex:
    """Reads and writes the due-timer buckets of one store."""

    def __init__(self, store: JournalStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        self._floor = TimerFloor(store, clock, self._seal_empty)
        self._overdue_after = 0  # OVERDUE is trimmed up to here by this index's polls

    # -- writing --------------------------------------------------------------

    def add(self, execution_id: str, gate: int, wake_at: float) -> None:
        """Record a hint, in its minute's bucket or, if that one is retired or lies
        below the floor's origin, in OVERDUE."""
        payload = json.dumps({"id": execution_id, "gate": gate, "wake_at": wake_at}).encode()
        record = NewRecord(TIMER_KIND, payload, self._clock())
        minute = _bucket_of(wake_at)
        origin = self._origin()
        if origin is not None and origin != _UNREADABLE:
            self._append_hint(OVERDUE if minute < origin else _stream(minute), record)
            return
        if self._append_hint(_stream(minute), record) == OVERDUE:
            return
        # The origin was not known when the bucket was chosen: a poll may have
        # created it since, above this minute, and would never list below it.
        later = self._origin()
        if later == _UNREADABLE or (later is not None and minute < later):
            self._append_hint(OVERDUE, record)

    def _origin(self) -> int | None:
        """The floor's origin; None while it does not exist, _UNREADABLE when it cannot
        be read."""
        try:
            return self._floor.origin()
        except LoomError as exc:
            _log.warning("timer floor: %s: %s", type(exc).__name__, exc)
            return _UNREADABLE

    def _append_hint(self, stream: str, record: NewRecord) -> str:
        """Append a hint to `stream`, or to OVERDUE if that one is retired; where it went."""
        while True:
            try:
                head = self._store.head(stream)
                if stream != OVERDUE and head and self._sealed(stream, head):
                    stream = OVERDUE
                    continue
                self._store.append(stream, head, [record])
                return stream
            except ConflictError:
                continue  # another hint or a seal landed first: look again
            except StreamDeletedError:
                if stream == OVERDUE:
                    raise  # never retired by Loom: the store was tampered with
                stream = OVERDUE

    def _sealed(self, stream: str, head: int) -> bool:
        try:
            last = self._store.read(stream, head - 1, 1)
        except TrimmedError:
            return False  # a seal is never trimmed away: the last record was a hint
        return bool(last) and last[0].kind == SEAL_KIND

    # -- firing ---------------------------------------------------------------

    def fire_due(self, now: float, wake: Wake) -> tuple[list[str], list[LoomError]]:
        """Offer every due hint to `wake`, then drop what is handled.

        A hint is handled when `wake` returns True or False; one it returns None for,
        or that meets ConflictError or NotSuspendedError (another worker is moving
        the run), stays for the next poll. Any other LoomError is logged, kept for
        the caller, and the hint stays too. A damaged hint is copied to QUARANTINE,
        reported as a SchemaError and dropped; it never stops the others.

        Returns:
            The ids woken, and the errors met, in order.
        """
        end = _bucket_of(now)  # a time that is not finite is refused before any read
        woken: list[str] = []
        failures: list[LoomError] = []
        floor = self._poll_floor(now, failures)
        listed: list[int] = []
        live: list[int] = []
        try:
            self._fire_buckets(now, floor, wake, (woken, failures, listed, live))
        except LoomError as exc:  # listing or reading a bucket: the rest waits for a poll
            _log.warning("timer buckets: %s: %s", type(exc).__name__, exc)
            failures.append(exc)
            return woken, failures  # the floor stays: it must not pass a bucket not read
        try:
            self._floor.advance(listed=listed, live=live, end=end)
        except LoomError as exc:  # the floor stays where it was; the next poll moves it
            _log.warning("timer floor: %s: %s", type(exc).__name__, exc)
            failures.append(exc)
        return woken, failures

    def _fire_buckets(
        self,
        now: float,
        floor: int | None,
        wake: Wake,
        found: tuple[list[str], list[LoomError], list[int], list[int]],
    ) -> None:
        """Offer the due buckets' hints to `wake` and settle each bucket; what was woken,
        the errors met, the buckets listed and those still live go to `found`.

        Raises:
            LoomError: a bucket could not be listed or read.
        """
        woken, failures, listed, live = found
        for bucket in self._due(now, floor):
            first_open: int | None = None
            for hint in bucket.hints:
                if hint.entry is None and first_open is not None:
                    continue  # quarantined once it can be dropped with what is before it
                if not self._handle(hint, bucket.stream, (now, wake), woken, failures):
                    first_open = hint.position if first_open is None else first_open
            retired = False
            try:
                retired = self._settle(bucket, first_open, now)
                if bucket.stream == OVERDUE:
                    self._overdue_after = bucket.head if first_open is None else first_open - 1
            except LoomError as exc:  # the hints stay; the next poll settles them
                _log.warning("timer bucket %r: %s: %s", bucket.stream, type(exc).__name__, exc)
                failures.append(exc)
            number = _bucket_number(bucket.stream)
            if number is not None:
                listed.append(number)
                if not retired:
                    live.append(number)

    def _poll_floor(self, now: float, failures: list[LoomError]) -> int | None:
        """Where this poll lists from: the floor, or None for every bucket (no floor
        yet, or it cannot be read: then it is reported and nothing is lost)."""
        mark = self._floor.known()
        if mark is None:
            try:
                mark = self._floor.create(_bucket_of(now))
            except LoomError as exc:
                _log.warning("timer floor: %s: %s", type(exc).__name__, exc)
                failures.append(exc)
                return None
        return mark.floor

    def _handle(
        self,
        hint: _Hint,
        stream: str,
        waking: tuple[float, Wake],
        woken: list[str],
        failures: list[LoomError],
    ) -> bool:
        """Offer one hint; True when it is handled and may be dropped."""
        now, wake = waking
        entry = hint.entry
        if entry is None:
            try:
                failures.append(self._quarantine(stream, hint.record))
            except LoomError as exc:  # kept where it is until it can be copied
                failures.append(exc)
                return False
            return True
        if entry.wake_at > now:
            return False
        try:
            outcome = wake(entry)
        except (ConflictError, NotSuspendedError):
            return False  # another worker moved the run: look again next time
        except LoomError as exc:
            _log.warning("timer of %r: %s: %s", entry.execution_id, type(exc).__name__, exc)
            failures.append(exc)
            return False
        if outcome:
            woken.append(entry.execution_id)
        return outcome is not None

    def _quarantine(self, stream: str, record: Record) -> SchemaError:
        error = SchemaError(
            f"damaged timer hint, copied to {QUARANTINE!r} and dropped",
            kind=record.kind,
            stream=stream,
            position=record.position,
        )
        _log.warning("%s", error)
        copy = NewRecord(
            "loom.timer.damaged",
            json.dumps(
                {
                    "stream": stream,
                    "position": record.position,
                    "kind": record.kind,
                    "payload": record.payload.decode("utf-8", "backslashreplace"),
                }
            ).encode(),
            self._clock(),
        )
        while True:
            try:
                self._store.append(QUARANTINE, self._store.head(QUARANTINE), [copy])
                return error
            except ConflictError:
                continue

    def _due(self, now: float, floor: int | None) -> Iterator[_Bucket]:
        """Every live bucket from `floor` (every one if None) up to the present minute,
        and OVERDUE first, as read now.

        With a floor a few minutes back (an idle poll's usual case), the minutes are
        read by name instead of listed: on S3 a missing stream costs one GET, a
        listing one LIST per shard.
        """
        last_minute = _bucket_of(now)
        after: str | None = None
        if floor is not None:
            overdue = self._read(OVERDUE, self._overdue_after)
            if overdue is not None and overdue.hints:
                yield overdue
            if last_minute - floor < _BY_NAME:
                for minute in range(floor, last_minute + 1):
                    bucket = self._read(_stream(minute))
                    if bucket is not None and bucket.head:
                        yield bucket
                return
            after = _stream(floor - 1) if floor > 0 else OVERDUE
        last = _stream(last_minute)
        while names := self._store.streams(PREFIX, after, _PAGE):
            for name in names:
                if name > last:
                    return
                bucket = self._read(name)
                if bucket is not None:
                    yield bucket
            after = names[-1]

    def _read(self, stream: str, after: int = 0) -> _Bucket | None:
        """A bucket's retained records after `after`, up to its head now; None if it
        was retired, or if other polls kept trimming it while it was read (they
        handle it). One read, no head first (on S3 each is a request)."""
        for _ in range(_READ_ATTEMPTS):
            try:
                records = self._store.read(stream, after)
            except TrimmedError as exc:
                after = exc.floor  # trimmed since: read from the new floor
                continue
            except StreamDeletedError:
                return None
            break
        else:
            return None
        head = records[-1].position if records else after
        sealed = bool(records) and records[-1].kind == SEAL_KIND
        hints = tuple(
            _Hint(record.position, _entry(record), record)
            for record in records
            if record.kind != SEAL_KIND
        )
        return _Bucket(stream, head, hints, sealed)

    def _settle(self, bucket: _Bucket, first_open: int | None, now: float) -> bool:
        """Drop a bucket's handled hints: trim them off, or retire a finished bucket.

        Returns:
            Whether the bucket is retired now.
        """
        store, stream = self._store, bucket.stream
        try:
            if bucket.sealed:
                store.delete(stream)  # sealed earlier, by a poll that stopped before this
                return True
            if first_open is not None:
                store.trim(stream, first_open)
            elif not self._may_retire(stream, now):
                store.trim(stream, bucket.head + 1)
            else:
                try:
                    store.append(stream, bucket.head, [NewRecord(SEAL_KIND, b"{}", self._clock())])
                except ConflictError:
                    store.trim(stream, bucket.head + 1)  # new hints: the next poll has them
                else:
                    store.delete(stream)
                    return True
        except StreamDeletedError:
            return True  # another poll retired it
        return False

    def _seal_empty(self, minute: int) -> bool:
        """Retire a past minute no listing found: seal it at position 0, then delete.

        Returns:
            True when it is retired; False when a writer created it first (or an
            earlier seal still waits for its delete): the next poll lists it.
        """
        stream = _stream(minute)
        try:
            self._store.append(stream, 0, [NewRecord(SEAL_KIND, b"{}", self._clock())])
            self._store.delete(stream)
        except ConflictError:
            return False
        except StreamDeletedError:
            pass  # retired already
        return True

    @staticmethod
    def _may_retire(stream: str, now: float) -> bool:
        """Only buckets wholly in the past: a writer of a later wake keeps its bucket."""
        number = _bucket_number(stream)
        return number is not None and (number + 1) * BUCKET_SECONDS <= now

    def buckets(self) -> list[str]:
        """The live bucket streams (OVERDUE included, if it exists), in order."""
        found: list[str] = []
        while names := self._store.streams(PREFIX, found[-1] if found else None, _PAGE):
            found.extend(names)
        return found
