"""Timers whatever the clocks do: a sleep always parks and always wakes, and one damaged
hint, a stale one, or a bucket trimmed or deleted under a poll never stops the others."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel import Context, Engine, MemoryStore, Status, flow
from loom_kernel._coordination import OVERDUE, QUARANTINE, TimerIndex
from loom_kernel._engine import parts_of
from loom_kernel.spi import JournalStore, NewRecord, SchemaError
from loom_kernel.testing import FakeClock, Interleaving, sandbox

DAY = 86_400.0


@flow
def nap(ctx: Context, seconds: float) -> str:
    ctx.sleep(seconds)
    return "rested"


class HeadCountingStore(MemoryStore):
    """Fails loudly once head() is called more often than any sleep could need."""

    def __init__(self, limit: int = 1_000) -> None:
        super().__init__()
        self.heads = 0
        self.limit = limit

    def _head(self, stream: str) -> int:
        self.heads += 1
        if self.heads > self.limit:
            raise AssertionError(f"head() called {self.heads} times: the timer index loops")
        return super()._head(stream)


def _engine(store: JournalStore, clock: FakeClock) -> Engine:
    return sandbox(nap, store=store, clock=clock, listeners=[]).engine


def test_a_sleep_parks_after_the_clock_went_back_more_than_a_day() -> None:
    store = HeadCountingStore()
    late = FakeClock(1_700_000_000.0)  # this machine's clock runs two days behind
    ahead = FakeClock(late.now + 2 * DAY)
    first = _engine(store, late).start("nap", 30)
    assert _engine(store, ahead).fire_due_timers() == [first.id]  # its bucket is retired
    assert TimerIndex(store, ahead).buckets() == []
    second = _engine(store, late).start("nap", 30)  # aims at the retired bucket
    assert second.status is Status.SUSPENDED
    assert TimerIndex(store, late).buckets() == [OVERDUE]
    assert _engine(store, ahead).fire_due_timers() == [second.id]
    assert _engine(store, ahead).get(second.id).result == "rested"


def test_handled_buckets_are_retired_and_an_idle_poll_reads_nothing() -> None:
    store, clock = MemoryStore(), FakeClock()
    engine = _engine(store, clock)
    ids = [engine.start("nap", 60 * minutes).id for minutes in range(1, 40)]
    clock.advance(3600)
    assert sorted(engine.fire_due_timers()) == sorted(ids)
    assert TimerIndex(store, clock).buckets() == [], "every handled bucket is retired"
    assert store.streams("timers/") == []
    assert engine.fire_due_timers() == []


def test_a_bucket_with_a_hint_not_yet_due_keeps_it_and_drops_the_rest() -> None:
    store, clock = MemoryStore(), FakeClock(1_700_000_000.0)  # 20 s into a minute
    engine = _engine(store, clock)
    soon = engine.start("nap", 5)
    later = engine.start("nap", 30)  # the same minute, 25 s later
    clock.advance(10)
    assert engine.fire_due_timers() == [soon.id]
    (bucket,) = TimerIndex(store, clock).buckets()
    assert len(store.read(bucket, store.head(bucket) - 1)) == 1, "the handled hint is trimmed"
    clock.advance(30)
    assert engine.fire_due_timers() == [later.id]
    assert TimerIndex(store, clock).buckets() == []


def test_a_damaged_hint_is_quarantined_and_reported_and_the_others_fire() -> None:
    store, clock = MemoryStore(), FakeClock()
    engine = _engine(store, clock)
    first = engine.start("nap", 30)
    (bucket,) = TimerIndex(store, clock).buckets()
    store.append(bucket, store.head(bucket), [NewRecord("loom.timer", b"{not json", clock())])
    second = engine.start("nap", 31)
    clock.advance(60)
    with pytest.raises(SchemaError, match="quarantine") as caught:
        engine.fire_due_timers()
    assert (caught.value.stream, caught.value.position) == (bucket, 2)
    assert engine.get(first.id).status is Status.COMPLETED
    assert engine.get(second.id).status is Status.COMPLETED
    (copied,) = store.read(QUARANTINE)
    assert json.loads(copied.payload)["payload"] == "{not json"
    assert engine.fire_due_timers() == [], "reported once: the damaged hint is gone"


def test_a_damaged_hint_whose_copy_fails_is_kept_until_it_is_copied() -> None:
    """The quarantine's append fails: the damaged hint stays in its bucket (it is
    never dropped uncopied), the others fire, and the next fire copies it."""
    from loom_kernel.spi import StoreUnavailableError

    class QuarantineAway(MemoryStore):
        away = True

        def _append(self, stream: str, expected: int, records: Any) -> int:
            if stream == QUARANTINE and self.away:
                raise StoreUnavailableError("the quarantine is away")
            return super()._append(stream, expected, records)

    store, clock = QuarantineAway(), FakeClock()
    engine = _engine(store, clock)
    first = engine.start("nap", 30)
    (bucket,) = TimerIndex(store, clock).buckets()
    store.append(bucket, store.head(bucket), [NewRecord("loom.timer", b"{not json", clock())])
    clock.advance(60)
    with pytest.raises(StoreUnavailableError):
        engine.fire_due_timers()
    assert engine.get(first.id).status is Status.COMPLETED
    assert store.head(QUARANTINE) == 0
    store.away = False
    with pytest.raises(SchemaError, match="quarantine"):
        engine.fire_due_timers()
    (copied,) = store.read(QUARANTINE)
    assert json.loads(copied.payload)["payload"] == "{not json"


def test_a_damaged_hint_behind_one_not_yet_due_is_quarantined_once() -> None:
    store, clock = MemoryStore(), FakeClock(6000.0)  # the start of a minute
    engine = _engine(store, clock)
    engine.start("nap", 50, key="later")  # due at 6050, in the same minute
    (bucket,) = TimerIndex(store, clock).buckets()
    store.append(bucket, store.head(bucket), [NewRecord("loom.timer", b"not json", clock())])
    for _ in range(3):
        clock.advance(5)
        assert engine.fire_due_timers() == []  # kept until what is before it is handled
    assert store.head(QUARANTINE) == 0
    clock.advance(40)
    with pytest.raises(SchemaError):
        engine.fire_due_timers()
    assert store.head(QUARANTINE) == 1
    assert engine.get("later").status is Status.COMPLETED
    assert engine.fire_due_timers() == []
    assert store.head(QUARANTINE) == 1, "copied once"


class TrimmingWhileReadStore(MemoryStore):
    """Another poller trims a bucket between this poller's head and read of it."""

    def __init__(self) -> None:
        super().__init__()
        self.trims: list[tuple[str, int]] = []

    def _read(self, stream: str, after: int, limit: int | None) -> list[Any]:
        while self.trims and self.trims[0][0] == stream:
            super()._trim(*self.trims.pop(0))
        return super()._read(stream, after, limit)


def test_a_bucket_trimmed_by_another_poll_while_it_is_read_stops_nothing() -> None:
    store, clock = TrimmingWhileReadStore(), FakeClock(6000.0)
    engine = _engine(store, clock)
    for key in ("a0", "a1", "a2"):
        engine.start("nap", 1, key=key)  # three hints in one minute
    clock.advance(70)
    engine.start("nap", 1, key="b")  # one in the next
    first = TimerIndex(store, clock).buckets()[0]
    store.trims = [(first, 2), (first, 3)]  # two trims by another poll, one per read
    clock.advance(5)
    assert set(engine.fire_due_timers()) >= {"a2", "b"}
    assert engine.get("b").status is Status.COMPLETED


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    offsets=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.floats(-3 * 365 * DAY, 3 * 365 * DAY, allow_nan=False),
            st.sampled_from(["sleep", "fire"]),
            st.floats(0, 3 * DAY, allow_nan=False),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_every_sleep_wakes_whatever_the_two_clocks_do(
    offsets: list[tuple[str, float, str, float]],
) -> None:
    """Two machines whose clocks jump anywhere within years of each other start
    sleeps and fire timers in any order; afterwards every sleep wakes."""
    store = MemoryStore()
    base = 1_700_000_000.0
    clocks = {"a": FakeClock(base), "b": FakeClock(base)}
    engines = {name: _engine(store, clock) for name, clock in clocks.items()}
    sleeping: list[str] = []
    for machine, offset, action, seconds in offsets:
        clocks[machine].now = base + offset
        if action == "sleep":
            sleeping.append(engines[machine].start("nap", seconds).id)
        else:
            engines[machine].fire_due_timers()
    future = FakeClock(base + 10 * 365 * DAY)
    _engine(store, future).fire_due_timers()
    for execution_id in sleeping:
        assert _engine(store, future).get(execution_id).status is Status.COMPLETED
    assert TimerIndex(store, future).buckets() in ([], [OVERDUE])


@settings(max_examples=80, deadline=None)
@given(data=st.data(), wake_offset=st.sampled_from([-2 * DAY, -30.0, 0.0, 30.0]))
def test_a_hint_written_while_its_bucket_is_retired_is_never_lost(
    data: st.DataObject, wake_offset: float
) -> None:
    """A writer adds a sleep to a bucket that a poll on another machine is retiring at
    the same moment, their store calls interleaved in every order."""
    store = Interleaving(MemoryStore())
    now = 1_700_000_040.0
    clock = FakeClock(now)
    # Keys, not random ids: a run's id picks its run index partition, and the store
    # calls must be the same on every replay of the drawn interleaving.
    first = _engine(store, clock).start("nap", 1, key="first")  # the bucket to retire
    poller_clock = FakeClock(now + 120)
    writer_clock = FakeClock(now + wake_offset)
    outcome: dict[str, Any] = store.run(
        {
            "poll": lambda: _engine(store, poller_clock).fire_due_timers(),
            "sleep": lambda: _engine(store, writer_clock).start("nap", 1, key="second").id,
        },
        choose=lambda names: data.draw(st.sampled_from(sorted(names))),
    )
    assert not any(isinstance(value, BaseException) for value in outcome.values()), outcome
    later = FakeClock(now + 10 * DAY)
    _engine(store, later).fire_due_timers()
    for execution_id in (first.id, outcome["sleep"]):
        assert _engine(store, later).get(execution_id).status is Status.COMPLETED


def test_a_hint_of_a_run_that_does_not_exist_is_dropped_not_kept_for_ever() -> None:
    store, clock = MemoryStore(), FakeClock()
    TimerIndex(store, clock).add("never-started", 0, clock() + 5)  # its start never landed
    clock.advance(3600)
    engine = _engine(store, clock)
    assert engine.fire_due_timers() == []
    assert TimerIndex(store, clock).buckets() == [], "the obsolete hint is handled"


def test_a_timer_woken_by_another_engine_meanwhile_is_not_counted_as_woken_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, clock = MemoryStore(), FakeClock()
    here, there = _engine(store, clock), _engine(store, clock)
    run = here.start("nap", 30)
    clock.advance(60)
    delivery = parts_of(here).delivery
    resuming = delivery.resuming

    def beaten_to_it(*args: Any, **kwargs: Any) -> Any:
        assert there.fire_due_timers() == [run.id]  # between the look and the resume
        return resuming(*args, **kwargs)

    monkeypatch.setattr(delivery, "resuming", beaten_to_it)
    assert here.fire_due_timers() == [], "woken once, by the other engine"
    assert here.get(run.id).result == "rested"
    assert TimerIndex(store, clock).buckets() == []


@pytest.mark.usefixtures("flow_loop")
def test_a_stale_timer_hint_wakes_nothing() -> None:
    @flow(name="napper", version="1")
    def napper(ctx: Context, _input: Any) -> Any:
        ctx.sleep(60)
        return ctx.suspend("human")

    box = sandbox(napper)
    box.engine.start("napper", key="n")
    box.clock.advance(61)
    assert box.engine.fire_due_timers() == ["n"]
    assert box.engine.get("n").waiting_on == "human"
    now = box.clock()
    parts_of(box.engine).driver.timers.add("n", 0, now - 1)  # the timer gate, already woken
    parts_of(box.engine).driver.timers.add("n", 1, now - 1)  # a human gate: no timer wakes it
    assert box.engine.fire_due_timers() == []
    assert box.engine.get("n").waiting_on == "human"


class VanishingBucketStore(MemoryStore):
    """Deletes a timer bucket between the listing that names it and the read of it."""

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        names = super()._streams(prefix, after, limit)
        if prefix == "timers/" and names:
            super()._delete(names[0])
        return names


@pytest.mark.usefixtures("flow_loop")
def test_a_bucket_deleted_between_listing_and_reading_is_skipped() -> None:
    store, clock = VanishingBucketStore(), FakeClock(6000.0)
    engine = Engine(store, [nap], clock=clock, listeners=[])
    engine.start("nap", 10, key="first")  # minute 100: deleted under the poll
    engine.start("nap", 70, key="second")  # minute 101: fires
    clock.advance(100)
    assert engine.fire_due_timers() == ["second"]
    assert engine.get("first").status is Status.SUSPENDED, "its hint is gone, not doubled"
