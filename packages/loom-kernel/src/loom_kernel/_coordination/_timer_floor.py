"""The timer index's floor: the first minute bucket a poll still has to list.

A retired minute bucket is deleted, but a store may keep a trace of it (S3 keeps a
tombstone key per deleted stream, so its positions are never reused), and a listing
of `timers/` from the start would page through every minute ever handled. The floor
lets a poll list from where work can still be instead.

The stream `timers-floor` holds marks `{"origin": O, "floor": F}`:

- **origin** (fixed when the stream is created, at the creating poll's minute): a
  writer that knows it never creates a bucket below it; such a hint goes to the
  overdue stream. A writer that does not know it yet (the stream did not exist when
  it looked) writes its bucket, then looks again, and copies its hint to the overdue
  stream too if its minute turned out to be below the origin.
- **floor**: every minute bucket below it is retired, or lies below the origin and
  held nothing when a poll listed everything after the origin existed. None until
  such a poll finished: until then a poll lists every bucket.

A poll moves the floor over a past minute only once that minute is retired: a
minute that held hints is sealed and deleted by the poll that handled them; an
empty minute at or above the origin is sealed now, by appending a seal at position
0 (which fails if a writer created the bucket meanwhile) and deleting it. A writer
aiming at a sealed or deleted minute sends its hint to the overdue stream, as it
always did, so no hint is ever left below the floor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Final

import attrs

from loom_kernel._coordination._streams import latest
from loom_kernel._core import ConflictError, NewRecord, Record, SchemaError
from loom_kernel._spi import JournalStore

FLOOR_STREAM: Final = "timers-floor"
FLOOR_KIND: Final = "loom.timer.floor"
#: At most this many empty minutes are sealed per poll (a store left without a poll
#: for a month catches up over many polls instead of in one long one).
SEALS_PER_POLL: Final = 60
_TRIM_EVERY: Final = 64


@attrs.frozen
class FloorMark:
    """The floor stream's latest mark."""

    origin: int
    floor: int | None


def _parse(record: Record) -> FloorMark:
    try:
        data = json.loads(record.payload)
        origin, floor = data["origin"], data["floor"]
    except (ValueError, TypeError, KeyError) as exc:
        raise SchemaError(
            "damaged timer floor mark", kind=record.kind, stream=FLOOR_STREAM
        ) from exc
    if (
        record.kind != FLOOR_KIND
        or type(origin) is not int
        or origin < 0
        or not (floor is None or (type(floor) is int and floor >= 0))
    ):
        raise SchemaError("damaged timer floor mark", kind=record.kind, stream=FLOOR_STREAM)
    return FloorMark(origin, floor)


class TimerFloor:
    """Reads and moves one store's timer floor (see the module's docstring)."""

    def __init__(
        self,
        store: JournalStore,
        clock: Callable[[], float],
        seal: Callable[[int], bool],
    ) -> None:
        """
        Args:
            store: the journal store.
            clock: the time a mark records.
            seal: retires an empty minute bucket: True when it is retired (by this
                call or earlier), False when a writer created it first.
        """
        self._store = store
        self._clock = clock
        self._seal = seal
        self._mark: FloorMark | None = None
        self._head = 0  # the floor stream's head as this index last saw it

    def origin(self) -> int | None:
        """The origin, read once it exists (it never changes); None while it does not."""
        if self._mark is None:
            self.read()
        return None if self._mark is None else self._mark.origin

    def known(self) -> FloorMark | None:
        """The mark as this index last saw it (a floor can only be older than the truth)."""
        return self._mark

    def read(self) -> FloorMark | None:
        """The latest mark in the store (None when there is none yet), remembered.

        Raises:
            SchemaError: the latest mark is damaged.
            LoomError: the store failed.
        """
        last = latest(self._store, FLOOR_STREAM)
        if last is None:
            return None
        self._remember(last.position, _parse(last))
        return self._mark

    def create(self, now_minute: int) -> FloorMark:
        """The mark, creating the stream with origin `now_minute` if it has none yet."""
        mark = self.read()
        if mark is not None:
            return mark
        created = FloorMark(now_minute, None)
        try:
            self._append(0, created)
        except ConflictError:
            mark = self.read()  # another poll created it first
            if mark is None:  # pragma: no cover - created, so a mark is there
                raise
            return mark
        return created

    def advance(
        self,
        *,
        listed: Collection[int],
        live: Collection[int],
        end: int,
    ) -> int | None:
        """Move the floor as far toward `end` as retired minutes allow.

        Args:
            listed: the minute buckets this poll's listing found (from the floor on,
                or every one when the floor was None).
            live: those still live after the poll (they hold hints not yet handled).
            end: the first minute not wholly in the past.

        Returns:
            The floor now recorded (or None when there is no mark to move).
        """
        mark = self._mark
        if mark is None:
            return None
        start = mark.floor
        if start is None:
            start = min([mark.origin, *listed])
        floor = self._walk(start, mark.origin, set(listed), sorted(live), end)
        if mark.floor is not None and floor <= mark.floor:
            return mark.floor
        while True:
            try:
                self._append(self._head, FloorMark(mark.origin, floor))
                return floor
            except ConflictError:
                other = self.read()
                if other is None:  # pragma: no cover - a mark was there before
                    return None
                if other.floor is not None and other.floor >= floor:
                    return other.floor
                mark = other

    def _walk(self, start: int, origin: int, listed: set[int], live: list[int], end: int) -> int:
        """The first minute from `start` that is not known retired, sealing empty ones."""
        blocked = min((minute for minute in live if minute >= start), default=end)
        stop = min(blocked, end)
        minute = start
        if minute < origin:  # below the origin only listed buckets can exist
            minute = min(origin, stop)
        seals = 0
        while minute < stop:
            if minute not in listed:
                if seals == SEALS_PER_POLL or not self._seal(minute):
                    return minute
                seals += 1
            minute += 1
        return minute

    def _append(self, head: int, mark: FloorMark) -> None:
        payload = json.dumps({"origin": mark.origin, "floor": mark.floor}).encode()
        new_head = self._store.append(
            FLOOR_STREAM, head, [NewRecord(FLOOR_KIND, payload, self._clock())]
        )
        self._remember(new_head, mark)
        if new_head % _TRIM_EVERY == 0:
            self._store.trim(FLOOR_STREAM, new_head)

    def _remember(self, head: int, mark: FloorMark) -> None:
        if head >= self._head:
            self._head, self._mark = head, mark
