"""The timer floor: an idle poll lists from where work can still be, and no hint is
ever left below it, whatever writers and polls do at the same moment."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loom_kernel import (
    ConflictError,
    Context,
    Engine,
    InvalidArgumentError,
    MemoryStore,
    NotSuspendedError,
    Status,
    StoreUnavailableError,
    flow,
)
from loom_kernel._coordination import FLOOR_KIND, FLOOR_STREAM, OVERDUE, SEAL_KIND, TimerIndex
from loom_kernel.spi import JournalStore, NewRecord, SchemaError, TrimmedError
from loom_kernel.testing import FakeClock, Interleaving, sandbox

DAY = 86_400.0
BASE = 1_700_000_040.0  # the start of a minute


@flow
def nap(ctx: Context, seconds: float) -> str:
    ctx.sleep(seconds)
    return "rested"


def _engine(store: JournalStore, clock: FakeClock) -> Engine:
    return sandbox(nap, store=store, clock=clock, listeners=[]).engine


def _floor(store: JournalStore) -> dict[str, Any]:
    head = store.head(FLOOR_STREAM)
    (mark,) = store.read(FLOOR_STREAM, head - 1, 1)
    assert mark.kind == FLOOR_KIND
    parsed: dict[str, Any] = json.loads(mark.payload)
    return parsed


class ListingRecorder(MemoryStore):
    """Records where each listing of the timer buckets starts, and the buckets read."""

    def __init__(self) -> None:
        super().__init__()
        self.listed_after: list[str | None] = []
        self.reads: list[str] = []

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        if prefix == "timers/":
            self.listed_after.append(after)
        return super()._streams(prefix, after, limit)

    def _read(self, stream: str, after: int, limit: int | None) -> list[Any]:
        if stream.startswith("timers/"):
            self.reads.append(stream)
        return super()._read(stream, after, limit)


def test_an_idle_poll_reads_the_minutes_since_the_floor_by_name() -> None:
    store, clock = ListingRecorder(), FakeClock(BASE)
    engine = _engine(store, clock)
    ids = [engine.start("nap", 60 * minutes + 1).id for minutes in range(300)]
    for _ in range(310):
        clock.advance(60)
        engine.fire_due_timers()
    assert all(engine.get(run).status is Status.COMPLETED for run in ids)
    minute = int(clock.now // 60)
    assert _floor(store)["floor"] == minute, "every past minute is retired"
    store.listed_after.clear()
    store.reads.clear()
    assert _engine(store, clock).fire_due_timers() == []  # a new engine, as a new worker
    assert store.listed_after == [], "nothing listed"
    assert store.reads == [OVERDUE, f"timers/{minute:012d}"]


def test_a_poll_far_past_the_floor_lists_from_the_floor() -> None:
    store, clock = ListingRecorder(), FakeClock(BASE)
    engine = _engine(store, clock)
    engine.fire_due_timers()
    floor = _floor(store)["floor"]
    run = engine.start("nap", 600)
    clock.advance(40 * 60)
    store.listed_after.clear()
    assert engine.fire_due_timers() == [run.id]
    assert store.listed_after[0] == f"timers/{floor - 1:012d}"


def test_the_first_poll_lists_everything_then_sets_the_floor() -> None:
    store, clock = ListingRecorder(), FakeClock(BASE)
    old = [_engine(store, clock).start("nap", 30 + 60 * n).id for n in range(3)]
    clock.advance(DAY)  # the store had no poll for a day
    engine = _engine(store, clock)
    assert sorted(engine.fire_due_timers()) == sorted(old)
    assert store.listed_after[0] is None, "no floor yet: every bucket is listed"
    mark = _floor(store)
    assert mark == {"origin": int(clock.now // 60), "floor": int(clock.now // 60)}


def test_empty_past_minutes_are_sealed_so_a_late_writer_goes_to_overdue() -> None:
    store, clock = MemoryStore(), FakeClock(BASE)
    poller = _engine(store, clock)
    poller.fire_due_timers()  # the floor starts at this minute
    clock.advance(600)
    poller.fire_due_timers()
    assert _floor(store)["floor"] == int(clock.now // 60)
    late = FakeClock(BASE + 120)  # a writer whose clock runs 8 minutes behind
    run = _engine(store, late).start("nap", 30)
    assert run.status is Status.SUSPENDED
    assert store.head(OVERDUE) == 1, "its minute is sealed: the hint is overdue"
    assert poller.fire_due_timers() == [run.id]


def test_a_store_left_without_a_poll_catches_up_over_several_polls() -> None:
    store, clock = MemoryStore(), FakeClock(BASE)
    engine = _engine(store, clock)
    engine.fire_due_timers()
    clock.advance(3 * 60 * 60)  # three hours: the documented 60 empty minutes a poll
    engine.fire_due_timers()
    first = _floor(store)["floor"]
    assert first == int(BASE // 60) + 60
    engine.fire_due_timers()
    engine.fire_due_timers()
    assert _floor(store)["floor"] == int(clock.now // 60)


def test_the_floor_stops_at_a_minute_whose_hints_are_not_handled() -> None:
    store, clock = MemoryStore(), FakeClock(BASE)
    engine = _engine(store, clock)
    engine.fire_due_timers()
    stuck = TimerIndex(store, clock)
    stuck.add("ghost", 0, clock.now + 90)  # a hint the wake keeps (None: not yet)
    clock.advance(600)
    woken, failures = TimerIndex(store, clock).fire_due(clock.now, lambda _entry: None)
    assert (woken, failures) == ([], [])
    assert _floor(store)["floor"] == int((BASE + 90) // 60), "not past the live minute"
    woken, _ = TimerIndex(store, clock).fire_due(clock.now, lambda _entry: True)
    assert woken == ["ghost"]
    TimerIndex(store, clock).fire_due(clock.now, lambda _entry: True)
    assert _floor(store)["floor"] == int(clock.now // 60)


class FailingOnce(MemoryStore):
    """Raises StoreUnavailableError once from the next call of each operation named."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: set[str] = set()

    def _maybe_fail(self, operation: str) -> None:
        if operation in self.fail:
            self.fail.discard(operation)
            raise StoreUnavailableError(f"{operation} failed (injected)")

    def _delete(self, stream: str) -> None:
        self._maybe_fail("delete")
        super()._delete(stream)

    def _trim(self, stream: str, before: int) -> None:
        self._maybe_fail("trim")
        super()._trim(stream, before)


def _seal_without_delete(store: FailingOnce, clock: FakeClock, engine: Engine) -> None:
    """A run's timer fires at a poll that seals its bucket but fails to delete it."""
    run = engine.start("nap", 30)
    clock.advance(120)
    store.fail = {"delete"}
    with pytest.raises(StoreUnavailableError, match="injected"):
        engine.fire_due_timers()  # woken; the seal landed, the delete did not
    assert engine.get(run.id).status is Status.COMPLETED


def test_a_bucket_sealed_by_a_poll_that_failed_to_delete_it_is_deleted_next_time() -> None:
    store, clock = FailingOnce(), FakeClock(BASE)
    engine = _engine(store, clock)
    _seal_without_delete(store, clock, engine)
    (bucket,) = TimerIndex(store, clock).buckets()
    assert store.read(bucket)[-1].kind == SEAL_KIND
    late = TimerIndex(store, FakeClock(BASE))
    late.add("late", 0, BASE + 30)  # a writer aiming at the sealed minute
    assert [json.loads(r.payload)["id"] for r in store.read(OVERDUE)] == ["late"]
    assert store.read(bucket)[-1].kind == SEAL_KIND, "nothing lands after a seal"
    engine.fire_due_timers()
    assert TimerIndex(store, clock).buckets() in ([], [OVERDUE])
    assert bucket not in TimerIndex(store, clock).buckets()


def test_a_bucket_whose_settling_fails_holds_the_floor_and_its_hint_fires_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, clock = FailingOnce(), FakeClock(BASE)
    _engine(store, clock).fire_due_timers()
    TimerIndex(store, clock).add("ghost", 0, clock.now + 90)
    clock.advance(600)
    store.fail = {"trim"}  # the bucket's settling (a trim below its open hint) fails
    with caplog.at_level("WARNING", logger="loom"):
        woken, failures = TimerIndex(store, clock).fire_due(clock.now, lambda _entry: None)
    assert woken == []
    assert [str(failure) for failure in failures] == ["trim failed (injected)"]
    assert "StoreUnavailableError: trim failed (injected)" in caplog.text, "and logged"
    assert _floor(store)["floor"] == int((BASE + 90) // 60), "not past the unsettled minute"
    woken, _ = TimerIndex(store, clock).fire_due(clock.now, lambda _entry: True)
    assert woken == ["ghost"]


def test_a_failed_trim_is_reported_and_the_next_poll_finishes_it() -> None:
    store, clock = FailingOnce(), FakeClock(BASE)
    engine = _engine(store, clock)
    soon, later = engine.start("nap", 5), engine.start("nap", 50)
    clock.advance(10)
    store.fail = {"trim"}
    with pytest.raises(StoreUnavailableError, match="injected"):
        engine.fire_due_timers()
    assert engine.get(soon.id).status is Status.COMPLETED
    clock.advance(60)
    assert engine.fire_due_timers() == [later.id]
    assert TimerIndex(store, clock).buckets() == []


def test_a_damaged_floor_mark_is_reported_and_loses_no_timer() -> None:
    store, clock = MemoryStore(), FakeClock(BASE)
    engine = _engine(store, clock)
    engine.fire_due_timers()
    head = store.head(FLOOR_STREAM)
    store.append(FLOOR_STREAM, head, [NewRecord(FLOOR_KIND, b'{"origin": "x"}', clock.now)])
    writer = _engine(store, clock)  # cannot read the origin: its hint goes to both
    run = writer.start("nap", 30)
    assert store.head(OVERDUE) == 1
    clock.advance(120)
    with pytest.raises(SchemaError, match="floor"):
        _engine(store, clock).fire_due_timers()
    assert writer.get(run.id).status is Status.COMPLETED


@settings(max_examples=120, deadline=None)
@given(
    data=st.data(),
    floor_exists=st.booleans(),
    poll_offset=st.sampled_from([0.0, 120.0, 600.0, 2 * DAY]),
    wake_offset=st.sampled_from([-2 * DAY, -300.0, 0.0, 150.0, 330.0, 900.0]),
)
def test_a_writer_racing_a_poll_that_moves_the_floor_loses_no_hint(
    data: st.DataObject, floor_exists: bool, poll_offset: float, wake_offset: float
) -> None:
    """A sleep and a poll, their store calls interleaved in every order: the poll may
    create the floor's origin (the writer did not know it) or seal the writer's
    minute as empty; afterwards a poll wakes the sleep."""
    store = Interleaving(MemoryStore())
    if floor_exists:
        _engine(store, FakeClock(BASE)).fire_due_timers()
    poller_clock = FakeClock(BASE + poll_offset)
    writer_clock = FakeClock(BASE + wake_offset)
    outcome: dict[str, Any] = store.run(
        {
            "poll": lambda: _engine(store, poller_clock).fire_due_timers(),
            "sleep": lambda: _engine(store, writer_clock).start("nap", 1, key="sleeper").id,
        },
        choose=lambda names: data.draw(st.sampled_from(sorted(names))),
    )
    assert not any(isinstance(value, BaseException) for value in outcome.values()), outcome
    later = FakeClock(BASE + 10 * DAY)
    for _ in range(3):
        _engine(store, later).fire_due_timers()
    assert _engine(store, later).get("sleeper").status is Status.COMPLETED


class PollingBeforeTheBucket(MemoryStore):
    """Runs `between` once, when a writer looks at a minute bucket's head: after the
    writer found no floor, before its hint lands."""

    def __init__(self) -> None:
        super().__init__()
        self.between: Any = None

    def _head(self, stream: str) -> int:
        if self.between is not None and stream.startswith("timers/0"):
            between, self.between = self.between, None
            between()
        return super()._head(stream)


def test_a_writer_that_found_no_floor_copies_its_hint_below_a_new_origin_to_overdue() -> None:
    store, clock = PollingBeforeTheBucket(), FakeClock(BASE)
    poller = _engine(store, clock)
    store.between = poller.fire_due_timers  # creates the origin at BASE's minute
    run = _engine(store, FakeClock(BASE - 300)).start("nap", 30)  # its minute is older
    assert store.head(FLOOR_STREAM) == 2, "the origin, then the floor after listing"
    assert [json.loads(r.payload)["id"] for r in store.read(OVERDUE)] == [run.id]
    clock.advance(120)
    assert poller.fire_due_timers() == [run.id]


def test_a_poll_reads_the_overdue_stream_from_where_it_trimmed_it() -> None:
    class OverdueReads(MemoryStore):
        def __init__(self) -> None:
            super().__init__()
            self.afters: list[int] = []

        def _read(self, stream: str, after: int, limit: int | None) -> list[Any]:
            if stream == OVERDUE:
                self.afters.append(after)
            return super()._read(stream, after, limit)

    store, clock = OverdueReads(), FakeClock(BASE)
    poller = _engine(store, clock)
    poller.fire_due_timers()
    clock.advance(600)
    poller.fire_due_timers()  # the last ten minutes are sealed
    late = _engine(store, FakeClock(BASE + 60)).start("nap", 30)  # lands in overdue
    assert poller.fire_due_timers() == [late.id]
    store.afters.clear()
    poller.fire_due_timers()
    assert store.afters == [store.head(OVERDUE)], "from its trimmed head: one read, nothing"


@pytest.mark.parametrize(
    "payload",
    [
        b'{"origin": -1, "floor": null}',
        b'{"origin": "5", "floor": null}',
        b'{"origin": 5, "floor": -1}',
        b'{"origin": 5, "floor": "7"}',
        b'{"origin": 5, "floor": 7.5}',
        b'{"origin": 5, "floor": true}',
        b'{"origin": 5}',
    ],
)
def test_a_floor_mark_with_a_field_out_of_its_range_is_damaged(payload: bytes) -> None:
    from loom_kernel._coordination._timer_floor import _parse
    from loom_kernel.spi import Record

    with pytest.raises(SchemaError, match="damaged timer floor mark"):
        _parse(Record(1, FLOOR_KIND, payload, 0.0))
    assert _parse(Record(1, FLOOR_KIND, b'{"origin": 5, "floor": null}', 0.0)).floor is None
    assert _parse(Record(1, FLOOR_KIND, b'{"origin": 0, "floor": 0}', 0.0)).floor == 0


@pytest.mark.parametrize("moment", [math.nan, math.inf, -math.inf])
def test_a_hint_or_a_poll_at_a_time_that_is_not_finite_is_refused_and_writes_nothing(
    moment: float,
) -> None:
    store, clock = MemoryStore(), FakeClock()
    index = TimerIndex(store, clock)
    with pytest.raises(InvalidArgumentError, match="a wake time must be a finite number"):
        index.add("run", 0, moment)
    with pytest.raises(InvalidArgumentError, match="a wake time must be a finite number"):
        index.fire_due(moment, lambda _entry: True)
    assert store.streams("") == []


def test_the_floor_stream_is_trimmed_as_the_floor_moves() -> None:
    from loom_kernel._coordination._timer_floor import _TRIM_EVERY

    store, clock = MemoryStore(), FakeClock(BASE)
    engine = _engine(store, clock)
    for _ in range(_TRIM_EVERY + 10):
        clock.advance(60)
        engine.fire_due_timers()
    head = store.head(FLOOR_STREAM)
    assert head > _TRIM_EVERY, "a mark per minute the floor moved"
    with pytest.raises(TrimmedError):
        store.read(FLOOR_STREAM, 0)
    assert _floor(store)["floor"] == int(clock.now // 60)


class WriterBetweenSealAndDelete(MemoryStore):
    """Runs `meanwhile` once, just before the first delete of a timer bucket: a
    writer whose hint lands between a poll's seal and its delete."""

    def __init__(self) -> None:
        super().__init__()
        self.meanwhile: Any = None

    def _delete(self, stream: str) -> None:
        if stream.startswith("timers/0") and self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()
        super()._delete(stream)


def test_a_hint_aimed_at_a_bucket_sealed_but_not_yet_deleted_goes_to_overdue_and_fires() -> None:
    store, clock = WriterBetweenSealAndDelete(), FakeClock(BASE)
    poller = TimerIndex(store, clock)
    poller.fire_due(clock.now, lambda _entry: True)  # the floor's origin: this minute
    poller.add("early", 0, BASE + 30)
    clock.advance(120)
    late = TimerIndex(store, FakeClock(BASE))  # a writer whose clock runs behind
    store.meanwhile = lambda: late.add("late", 0, BASE + 30)
    assert poller.fire_due(clock.now, lambda _entry: True) == (["early"], [])
    assert store.meanwhile is None, "the writer ran between the seal and the delete"
    assert poller.fire_due(clock.now, lambda _entry: True) == (["late"], [])


def test_the_poll_that_deletes_a_bucket_an_earlier_poll_sealed_moves_the_floor_past_it() -> None:
    store, clock = FailingOnce(), FakeClock(BASE)
    engine = _engine(store, clock)
    engine.fire_due_timers()
    _seal_without_delete(store, clock, engine)
    assert _floor(store)["floor"] == int(BASE // 60), "held by the sealed bucket"
    engine.fire_due_timers()
    assert TimerIndex(store, clock).buckets() == []
    assert _floor(store)["floor"] == int(clock.now // 60), "moved at the poll that deleted it"


class FloorCreatedMeanwhile(ListingRecorder):
    """Runs `meanwhile` once, just before the first attempt to create the floor."""

    def __init__(self) -> None:
        super().__init__()
        self.meanwhile: Any = None

    def _append(self, stream: str, expected: int, records: Any) -> int:
        if stream == FLOOR_STREAM and expected == 0 and self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()
        return super()._append(stream, expected, records)


def test_a_poll_that_loses_the_race_to_create_the_floor_uses_the_winners() -> None:
    store, clock = FloorCreatedMeanwhile(), FakeClock(BASE)

    def another_poll_first() -> None:
        TimerIndex(store, clock).fire_due(clock.now, lambda _entry: True)
        store.listed_after.clear()

    store.meanwhile = another_poll_first
    assert TimerIndex(store, clock).fire_due(clock.now, lambda _entry: True) == ([], [])
    assert store.meanwhile is None, "the other poll created the floor first"
    assert store.listed_after == [], "it read the minutes since the floor by name, no listing"


def test_a_floor_that_cannot_be_created_is_logged_and_the_poll_lists_every_bucket(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class NoFloor(MemoryStore):
        def _append(self, stream: str, expected: int, records: Any) -> int:
            if stream == FLOOR_STREAM:
                raise StoreUnavailableError("the floor cannot be written")
            return super()._append(stream, expected, records)

    store, clock = NoFloor(), FakeClock(BASE)
    engine = _engine(store, clock)
    run = engine.start("nap", 30)
    clock.advance(120)
    with caplog.at_level(logging.WARNING, logger="loom"), pytest.raises(StoreUnavailableError):
        engine.fire_due_timers()
    assert "timer floor: StoreUnavailableError: the floor cannot be written" in caplog.text
    assert engine.get(run.id).status is Status.COMPLETED, "every bucket listed: it fired"


def test_a_bucket_whose_seal_meets_a_new_hint_trims_what_the_poll_handled() -> None:
    """A poll retiring a past bucket meets a hint written there as it seals it: the
    bucket stays, with the hints the poll handled trimmed (the next poll reads only
    the new one)."""

    class HintAsSealed(MemoryStore):
        raced = False
        hint: Any = None  # the last hint written to a bucket

        def _append(self, stream: str, expected: int, records: Any) -> int:
            if stream.startswith("timers/") and records[0].kind == SEAL_KIND and not self.raced:
                self.raced = True
                payload = json.loads(self.hint.payload) | {"id": "newcomer"}
                newcomer = NewRecord(self.hint.kind, json.dumps(payload).encode(), 0.0)
                expected = super()._append(stream, expected, (newcomer,)) - 1
                return super()._append(stream, expected, records)  # meets the newcomer
            if stream.startswith("timers/") and stream != OVERDUE:
                self.hint = records[0]
            return super()._append(stream, expected, records)

    store, clock = HintAsSealed(), FakeClock(BASE)
    engine = _engine(store, clock)
    engine.start(nap.name, 30.0, key="sleeper")
    (bucket,) = [b for b in TimerIndex(store, clock).buckets() if b != OVERDUE]
    clock.advance(DAY)
    engine.fire_due_timers()
    assert engine.get("sleeper").status is Status.COMPLETED
    assert store.raced, "the poll tried to seal the bucket"
    try:
        records = store.read(bucket)
    except TrimmedError as trimmed:
        records = store.read(bucket, trimmed.floor)
    left = [json.loads(record.payload)["id"] for record in records]
    assert left == ["newcomer"], "what the poll handled is trimmed; the new hint stays"


def test_a_floor_that_cannot_be_read_as_a_hint_is_added_is_logged_and_the_hint_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its origin unknown, a hint goes to its minute's bucket and to OVERDUE as well
    (a poll may list above that minute), and the floor's failure is said."""

    class FloorAway(MemoryStore):
        def _head(self, stream: str) -> int:
            if stream == FLOOR_STREAM:
                raise StoreUnavailableError("the floor cannot be read")
            return super()._head(stream)

    store, clock = FloorAway(), FakeClock(BASE)
    with caplog.at_level(logging.WARNING, logger="loom"):
        TimerIndex(store, clock).add("r", 0, BASE + 30)
    assert "timer floor: StoreUnavailableError: the floor cannot be read" in caplog.text
    assert store.head(OVERDUE) == 1, "kept where any poll finds it"


@pytest.mark.parametrize(
    "moved", [ConflictError("ex/ghost", 3, 4), NotSuspendedError("ghost", "running")]
)
def test_a_hint_whose_wake_met_another_writer_is_offered_again(moved: Exception) -> None:
    store, clock = MemoryStore(), FakeClock(BASE)
    TimerIndex(store, clock).add("ghost", 0, clock.now + 30)
    clock.advance(60)

    def moved_first(_entry: Any) -> bool:
        raise moved

    woken, failures = TimerIndex(store, clock).fire_due(clock.now, moved_first)
    assert (woken, failures) == ([], [])
    woken, _ = TimerIndex(store, clock).fire_due(clock.now, lambda _entry: True)
    assert woken == ["ghost"], "the hint must stay for the next poll, not be dropped"
