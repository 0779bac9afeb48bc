"""Queues with limits: named queues whose runs workers admit under a concurrency cap,
a per-key concurrency, a rate limit, and in order of priority.

A queue is kept on the journal SPI, as the run index is: each of its partitions is a
stream, `queues/<name>/<p>`, of records

- `add`: a run waits to be driven (appended after its start, or after a wake that was
  journaled with no owner);
- `take`: a worker admits runs to drive, appended at the exact head of the stream it
  folded, so two workers never admit past a limit: one append wins, the other folds
  again and picks again;
- `done`: a run admitted by the take at position `take` is no longer driven (it
  parked, ended, or its driver let it go: then it waits again, at its old place; or
  an add came while it was driven: then it waits again, at that add's place);
- `checkpoint`: the fold so far, appended at the exact head folded; the stream is
  trimmed below it.

Within a partition every limit is exact. A queue of P partitions gives each partition
its share of the concurrency cap and of the rate, so the queue as a whole never goes
past either, and keeps a key's runs in one partition, so the per-key limit stays
exact (see docs/queues.md). This module is the model: a queue, its limits, the fold of
a partition and the pick; `_queue_book` reads and writes the partitions.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Final

import attrs

from loom_kernel._core import (
    MAX_ID_LENGTH,
    InvalidArgumentError,
    QueuePlace,
    Record,
    SchemaError,
    finite_number,
    is_name,
    validate_stream_id,
)

__all__ = [
    "ADD_KIND",
    "CHECKPOINT_KIND",
    "DONE_KIND",
    "QUEUES_PREFIX",
    "TAKE_KIND",
    "Queue",
    "QueueFold",
    "QueueView",
    "Rate",
    "checkpoint_data",
    "dump",
    "fold_record",
    "pick",
    "rate_frees_at",
]

QUEUES_PREFIX: Final = "queues/"
ADD_KIND: Final = "loom.queue.add"
TAKE_KIND: Final = "loom.queue.take"
DONE_KIND: Final = "loom.queue.done"
CHECKPOINT_KIND: Final = "loom.queue.checkpoint"
#: The widest priority: a 32-bit signed int, as DBOS allows.
_PRIORITY_BOUND: Final = 2**31
_MAX_PARTITIONS: Final = 256
#: The pollers a checkpoint keeps, the latest first.
_POLLERS_KEPT: Final = 32


def _positive(name: str, value: object, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} is an int of 1 or more, not {value!r}")


def _check_rate_limit(_instance: Any, _attribute: Any, value: int) -> None:
    _positive("a rate's limit", value, optional=False)


def _check_period(_instance: Any, _attribute: Any, value: float) -> None:
    if not finite_number(value) or value <= 0:
        raise InvalidArgumentError(f"a rate's period is a number of seconds above 0, not {value!r}")


@attrs.frozen
class Rate:
    """At most `limit` runs admitted in any `per` seconds (a sliding window).

    Attributes:
        limit: how many admissions the window holds.
        per: the window, in seconds.
    """

    limit: int = attrs.field(validator=_check_rate_limit)
    per: float = attrs.field(validator=_check_period)


def _check_name(_instance: Any, _attribute: Any, value: str) -> None:
    if not isinstance(value, str) or not value or "/" in value:
        raise InvalidArgumentError(f"a queue's name is a non-empty str with no '/', not {value!r}")
    validate_stream_id(f"{QUEUES_PREFIX}{value}/0")


def _check_limit(_instance: Any, attribute: Any, value: object) -> None:
    _positive(attribute.name, value)


def _check_rate(_instance: Any, _attribute: Any, value: object) -> None:
    if value is not None and not isinstance(value, Rate):
        raise InvalidArgumentError(f"rate is a Rate(limit, per=seconds) or None, not {value!r}")


def _check_partitions(instance: Queue, _attribute: Any, value: object) -> None:
    _positive("partitions", value, optional=False)
    assert isinstance(value, int)
    if value > _MAX_PARTITIONS:
        raise InvalidArgumentError(f"partitions is at most {_MAX_PARTITIONS}, not {value}")
    last = f"{QUEUES_PREFIX}{instance.name}/{value - 1}"
    if len(last) > MAX_ID_LENGTH:
        raise InvalidArgumentError(
            f"queue {instance.name!r} with {value} partitions would have a stream id "
            f"longer than {MAX_ID_LENGTH} characters ({last!r}): shorten its name"
        )
    for name, limit in (
        ("concurrency", instance.concurrency),
        ("the rate's limit", None if instance.rate is None else instance.rate.limit),
    ):
        if limit is not None and limit < value:
            raise InvalidArgumentError(
                f"{name} ({limit}) is split among the {value} partitions: it must be at "
                "least the number of partitions"
            )


@attrs.frozen
class Queue:
    """A named queue: the runs `engine.enqueue(..., queue=name)` puts on it are driven
    only by workers, as its limits allow.

    Attributes:
        name: the queue's name (part of its streams' ids: no '/').
        concurrency: how many of its runs may be driven at once, by all workers
            together (parked runs do not count); None for no cap.
        per_key: how many runs of one key (`enqueue(..., queue_key=...)`) may be driven
            at once; None for no such limit. Runs enqueued with no key are not held
            by it.
        rate: at most `rate.limit` runs admitted in any `rate.per` seconds (a wake of a
            parked run is admitted again, and counts again); None for no rate limit.
        partitions: how many streams the queue is spread over. One (the default)
            makes every limit exact; more let more workers admit at once (on S3 each
            admission is a conditional PUT on one partition), each partition holding
            its share of the cap and of the rate (see docs/queues.md). Raising it
            later is safe, but for `per_key`, which is exact again once the runs
            added before are driven; lowering it strands the runs waiting in the
            partitions dropped.
    """

    name: str = attrs.field(validator=_check_name)
    concurrency: int | None = attrs.field(default=None, kw_only=True, validator=_check_limit)
    per_key: int | None = attrs.field(default=None, kw_only=True, validator=_check_limit)
    rate: Rate | None = attrs.field(default=None, kw_only=True, validator=_check_rate)
    partitions: int = attrs.field(default=1, kw_only=True, validator=_check_partitions)

    def share(self, partition: int) -> tuple[int | None, Rate | None]:
        """The cap and the rate one partition holds: its share of the queue's, so the
        shares add up to the whole (the first partitions take the remainder)."""

        def part(total: int) -> int:
            return total // self.partitions + (1 if partition < total % self.partitions else 0)

        cap = None if self.concurrency is None else part(self.concurrency)
        rate = None if self.rate is None else Rate(part(self.rate.limit), self.rate.per)
        return cap, rate

    def place(self, execution_id: str, priority: int, key: str | None) -> QueuePlace:
        """Where a run enqueued with `priority` and `key` waits (a key's runs all wait in
        one partition, so a per-key limit is exact).

        Raises:
            InvalidArgumentError: the priority is not an int of 32 bits, or the key is
                not a non-empty str of at most MAX_ID_LENGTH characters.
        """
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not -_PRIORITY_BOUND <= priority < _PRIORITY_BOUND
        ):
            raise InvalidArgumentError(
                "a priority is an int from -2**31 to 2**31 - 1 (lower runs first), "
                f"not {priority!r}"
            )
        if key is not None and not is_name(key):
            raise InvalidArgumentError(
                f"a queue key is a non-empty str of at most {MAX_ID_LENGTH} characters "
                f"(UTF-8, so no lone surrogate), not {key!r}"
            )
        spread = key if key is not None else execution_id
        digest = hashlib.blake2b(spread.encode(), digest_size=4).digest()
        partition = int.from_bytes(digest, "big") % self.partitions
        return QueuePlace(self.name, partition, priority, key)


@attrs.frozen
class _Waiting:
    execution_id: str
    flow: str
    priority: int
    seq: int  # its place in line: the position of the add that queued it first
    key: str | None
    code: str = ""  # the hash of the code it is pinned to ("": not said)

    @property
    def place(self) -> tuple[int, int, str]:
        """Its place in line: priority, then arrival."""
        return self.priority, self.seq, self.execution_id


@attrs.frozen
class _Active:
    waiting: _Waiting  # as it waited: where it goes back to when let go
    take: int  # the position of the take that admitted it
    by: str  # the worker that took it
    at: float  # when, by that worker's clock
    # Woken again while driven: where it waits once done (the first wake's place).
    again: _Waiting | None = None


@attrs.define
class QueueFold:
    """One partition of a queue, as folded from its stream.

    Attributes:
        stream: the partition's stream.
        head: the position folded up to.
        waiting: the runs waiting to be admitted, by id (change it through `wait` and
            `unwait`, which keep the line in order).
        active: the runs admitted and not done, by id.
        admitted: when the admissions still inside the rate's window happened (by the
            takers' clocks), in order.
        since_checkpoint: records folded past the last checkpoint.
        window: the rate's window in seconds (admissions older are forgotten), or
            None for a queue with no rate.
        pollers: each worker that took from the partition, or said it wanted to (a
            take of no run), with when it last did, by its clock: the workers the
            partition's runs are shared among (see `pick`).
    """

    stream: str
    head: int = 0
    waiting: dict[str, _Waiting] = attrs.Factory(dict)
    active: dict[str, _Active] = attrs.Factory(dict)
    admitted: list[float] = attrs.Factory(list)
    since_checkpoint: int = 0
    _line: list[tuple[int, int, str]] = attrs.Factory(list)  # the waiting runs' places, sorted
    window: float | None = None
    pollers: dict[str, float] = attrs.Factory(dict)

    def copy(self) -> QueueFold:
        return QueueFold(
            self.stream,
            self.head,
            dict(self.waiting),
            dict(self.active),
            list(self.admitted),
            self.since_checkpoint,
            list(self._line),
            self.window,
            dict(self.pollers),
        )

    def sharing(self, me: str, since: float, until: float) -> int:
        """How many workers share the partition's runs: this one, and the others that
        took from it, or said they wanted to, between `since` and `until` (by their
        clocks: a worker whose clock ran ahead of `until` is not counted, or it would
        look present for as long as its clock was ahead once it stopped)."""
        return 1 + sum(1 for by, at in self.pollers.items() if by != me and since <= at <= until)

    def wait(self, item: _Waiting) -> None:
        """Have a run wait at its place in line (no change when it waits already)."""
        if item.execution_id not in self.waiting:
            self.waiting[item.execution_id] = item
            bisect.insort(self._line, item.place)

    def unwait(self, execution_id: str) -> _Waiting | None:
        """Take a run out of the line; what it was, or None when it was not waiting."""
        item = self.waiting.pop(execution_id, None)
        if item is not None:
            index = bisect.bisect_left(self._line, item.place)
            del self._line[index]
        return item

    def in_order(self) -> Iterator[_Waiting]:
        """The waiting runs in the order they are admitted: priority, then arrival."""
        return (self.waiting[place[2]] for place in self._line)

    def line(self) -> list[_Waiting]:
        """`in_order`, as a list."""
        return list(self.in_order())


@attrs.frozen
class QueueView:
    """A queue as its partitions show it now.

    Attributes:
        name: the queue.
        waiting: the ids of the runs waiting, in the order each partition admits them
            (partition by partition).
        active: the ids of the runs admitted and being driven (or whose driver has
            not said yet that it stopped).
    """

    name: str
    waiting: list[str]
    active: list[str]


def pick(
    fold: QueueFold,
    *,
    cap: int | None,
    per_key: int | None,
    rate: Rate | None,
    now: float,
    free: int,
    hosts: Callable[[str, str], bool] = lambda _flow, _code: True,
    busy: Callable[[str], bool] = lambda _id: False,
    me: str | None = None,
    present_since: float | None = None,
) -> list[str]:
    """The runs a worker with `free` slots may admit now from one partition: in order
    of priority, then arrival; no more than the cap leaves room for (counting the runs
    admitted and not done), nor the rate's window (counting the admissions since
    `now - rate.per`); none whose key has `per_key` runs driven, nor of code the
    worker lacks (`hosts(flow, code hash)`): those do not hold back the runs behind
    them. A run the
    worker is busy with (a visit of it) stops the pick there, for the next poll, so
    the order holds.

    Given the worker's id (`me`), the runs are shared with the other workers present
    since `present_since` (`QueueFold.sharing`): among N of them, this one holds at
    most its share of the cap, ceil(cap / N) runs, and takes at most ceil(waiting /
    N) of the waiting runs at once, so a worker with many free slots leaves the others
    theirs instead of taking every run while they stand by."""
    room = free
    sharing = 1
    if me is not None and present_since is not None:
        sharing = fold.sharing(me, present_since, now + (now - present_since))
    if cap is not None:
        room = min(room, cap - len(fold.active))
        if sharing > 1:
            mine = sum(1 for item in fold.active.values() if item.by == me)
            room = min(room, -(-cap // sharing) - mine)
    if rate is not None:
        recent = len(fold.admitted) - bisect.bisect_right(fold.admitted, now - rate.per)
        room = min(room, rate.limit - recent)
    if sharing > 1:
        room = min(room, -(-len(fold.waiting) // sharing))
    if room <= 0 or not fold.waiting:
        return []
    keys = Counter(item.waiting.key for item in fold.active.values() if item.waiting.key)
    chosen: list[str] = []
    for item in fold.in_order():
        if len(chosen) >= room:
            break
        if item.key is not None and per_key is not None and keys[item.key] >= per_key:
            continue
        if not hosts(item.flow, item.code):
            continue
        if busy(item.execution_id):
            break
        if item.key is not None:
            keys[item.key] += 1
        chosen.append(item.execution_id)
    return chosen


def rate_frees_at(fold: QueueFold, rate: Rate | None, now: float) -> float | None:
    """When the rate's window next has room (by the takers' clocks), if it is full at
    `now`; None when it has room, or the queue has no rate."""
    if rate is None:
        return None
    start = bisect.bisect_right(fold.admitted, now - rate.per)
    recent = fold.admitted[start:]
    if len(recent) < rate.limit:
        return None
    return recent[len(recent) - rate.limit] + rate.per


def dump(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def _waiting_data(item: _Waiting) -> list[Any]:
    return [item.execution_id, item.flow, item.priority, item.seq, item.key, item.code]


def _waiting_of(data: Any) -> _Waiting:
    execution_id, flow, priority, seq, key, code = data
    if not (
        isinstance(execution_id, str)
        and isinstance(flow, str)
        and type(priority) is int
        and type(seq) is int
        and (key is None or isinstance(key, str))
        and isinstance(code, str)
    ):
        raise TypeError(f"a waiting run is [id, flow, priority, seq, key, code], not {data!r}")
    return _Waiting(execution_id, flow, priority, seq, key, code)


def fold_record(fold: QueueFold, record: Record) -> None:
    """Fold one record of a partition into `fold` (in place).

    Raises:
        SchemaError: the record is damaged.
    """
    window = fold.window
    try:
        data = json.loads(record.payload)
        if record.kind == ADD_KIND:
            execution_id = str(data["id"])
            active = fold.active.get(execution_id)
            code = data.get("code", "")
            place = [data["priority"], record.position, data["key"], code]
            waiting = _waiting_of([execution_id, data["flow"], *place])
            if active is not None:  # woken while driven: it waits again once done,
                # at the wake's place in line, as a wake of a parked run does
                if active.again is None:
                    fold.active[execution_id] = attrs.evolve(active, again=waiting)
            elif execution_id in fold.waiting:  # migrated while it waits: its place, new code
                fold.waiting[execution_id] = attrs.evolve(fold.waiting[execution_id], code=code)
            else:
                fold.wait(waiting)
        elif record.kind == TAKE_KIND:
            by = str(data["by"])
            fold.pollers[by] = max(fold.pollers.get(by, record.timestamp), record.timestamp)
            if window is not None and data["ids"]:
                # The window ends at an admission, by its taker's clock. A take of no
                # run (a worker saying it is there) admits nothing and moves no window:
                # a worker whose clock is ahead would empty it every time it said so.
                del fold.admitted[: bisect.bisect_right(fold.admitted, record.timestamp - window)]
            for execution_id in data["ids"]:
                taken = fold.unwait(str(execution_id))
                if taken is not None:
                    fold.active[taken.execution_id] = _Active(
                        taken, record.position, by, record.timestamp
                    )
                    if window is not None:
                        bisect.insort(fold.admitted, record.timestamp)
        elif record.kind == DONE_KIND:
            execution_id = str(data["id"])
            active = fold.active.get(execution_id)
            if active is not None and active.take == int(data["take"]):
                del fold.active[execution_id]
                if data.get("unused") is True:  # never driven: its admission is void
                    _forget(fold.admitted, active.at)
                if data["requeue"] is True:  # let go running: back to its old place
                    fold.wait(active.waiting)
                elif active.again is not None:
                    fold.wait(active.again)
        elif record.kind == CHECKPOINT_KIND:
            fold.waiting, fold._line = {}, []
            for waiting in map(_waiting_of, data["waiting"]):
                fold.wait(waiting)
            fold.active = {}
            for item in data["active"]:
                waiting, take, by, at, again = item
                held = _waiting_of(waiting)
                active = _Active(held, int(take), str(by), float(at), _woken(held, again))
                fold.active[active.waiting.execution_id] = active
            fold.admitted = [] if window is None else sorted(map(float, data["admitted"]))
            fold.pollers = {str(by): float(at) for by, at in data.get("pollers", {}).items()}
            fold.since_checkpoint = -1
        else:
            raise ValueError(f"unknown kind {record.kind!r}")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise SchemaError(
            f"damaged queue record ({type(exc).__name__}: {exc}); a worker rewrites the "
            "partition from its readable records",
            kind=record.kind,
            stream=fold.stream,
            position=record.position,
        ) from None
    finally:
        fold.head = record.position
        fold.since_checkpoint += 1


def _woken(held: _Waiting, again: Any) -> _Waiting | None:
    """A checkpoint's note of an admitted run's wake: where the run waits once done,
    or None. (A checkpoint from before a wake's place was kept says True: the run's
    old place.)"""
    if again is None or again is False:
        return None
    if again is True:
        return held
    return _waiting_of(again)


def _forget(admitted: list[float], at: float) -> None:
    """Drop one admission made at `at` from the window's sorted times, if there."""
    index = bisect.bisect_left(admitted, at)
    if index < len(admitted) and admitted[index] == at:
        del admitted[index]


def checkpoint_data(fold: QueueFold) -> dict[str, Any]:
    return {
        "waiting": [_waiting_data(item) for item in fold.waiting.values()],
        "active": [
            [
                _waiting_data(item.waiting),
                item.take,
                item.by,
                item.at,
                None if item.again is None else _waiting_data(item.again),
            ]
            for item in fold.active.values()
        ],
        "admitted": fold.admitted,
        # The latest pollers only: each worker restarted with a made-up id is another.
        "pollers": dict(sorted(fold.pollers.items(), key=lambda item: -item[1])[:_POLLERS_KEPT]),
    }
