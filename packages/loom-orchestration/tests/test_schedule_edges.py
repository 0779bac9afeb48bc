"""Schedules at their edges (each found by an adversarial review): a bad backfill or a
schedule whose fire raises stops no other; ticks buffered or backfilled make progress
whatever the policy becomes; a re-created schedule never re-decides its ticks; a
trigger never takes a tick's id; a long catch-up is bounded per poll and logged; a
damaged record is reported, listed around and deletable."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from loom_kernel import ConflictError, InvalidArgumentError, MemoryStore, SchemaError, Status
from loom_kernel.spi import NewRecord, Record
from loom_kernel.testing import FakeClock
from loom_orchestration import (
    backfill_schedule,
    create_schedule,
    delete_schedule,
    fire_due_schedules,
    get_schedule,
    list_schedules,
    trigger_schedule,
    update_schedule,
)
from loom_orchestration._schedules import _poller
from loom_orchestration._schedules._api import scan_schedules
from loom_orchestration._schedules._poller import SchedulePoller
from schedule_helpers import BASE, engine, runs_of


class CountsConflicts(MemoryStore):
    """A store that counts the appends refused for a conflict, per stream."""

    def __init__(self) -> None:
        super().__init__()
        self.conflicts: Counter[str] = Counter()

    def append(self, stream: str, expected: int, *args: Any, **kwargs: Any) -> int:
        try:
            return super().append(stream, expected, *args, **kwargs)
        except ConflictError:
            self.conflicts[stream] += 1
            raise


class BrokenReads(MemoryStore):
    """A store whose reads of one stream raise an error that is not Loom's."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken = broken

    def read(self, stream: str, after: int = 0, limit: int | None = None) -> list[Record]:
        if stream == self.broken:
            raise RuntimeError("a bug in a store")
        return super().read(stream, after, limit)


def test_a_backfill_past_any_date_is_refused_writing_nothing() -> None:
    e = engine()
    create_schedule(e, "a", "tick", cron="* * * * *")
    head = e.store.head("schedules/a")
    for start in (-1e20, 10**400, datetime(2026, 1, 1)):
        with pytest.raises(InvalidArgumentError):
            backfill_schedule(e, "a", start, BASE - 60)
    assert e.store.head("schedules/a") == head


def test_a_schedule_whose_fire_raises_any_error_stops_no_other() -> None:
    store = BrokenReads("schedules/a")
    e = engine(store)
    for name in ("a", "b", "c"):
        store.broken = ""
        create_schedule(e, name, "tick", cron="* * * * *", overlap="allow_all")
    store.broken = "schedules/a"
    e.clock.advance(60)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="a bug in a store"):
        fire_due_schedules(e)
    assert [len(runs_of(e, name)) for name in ("b", "c")] == [1, 1]
    poller = SchedulePoller(e, refresh=3600)
    e.clock.advance(60)  # type: ignore[attr-defined]
    poller()
    assert [len(runs_of(e, name)) for name in ("b", "c")] == [2, 2]


def test_a_buffered_tick_starts_as_the_run_before_it_ends_not_at_the_next_fire() -> None:
    """The listener of a scheduled run's end fires its schedule: the tick it buffered
    starts then, with no poll and no fire_due_schedules."""
    e = engine()
    create_schedule(e, "s", "lasts", cron="* * * * *", input=30, overlap="buffer_one")
    e.clock.advance(90)  # type: ignore[attr-defined]  # 00:02:00: 01:00 runs, 02:00 waits
    fire_due_schedules(e)
    (first,) = runs_of(e, "s")
    assert len(get_schedule(e, "s").buffered) == 1
    e.clock.advance(31)  # type: ignore[attr-defined]  # 01:00's run, started at 02:00, slept 30 s
    e.fire_due_timers()
    assert e.get(first.id).status is Status.COMPLETED
    assert len(runs_of(e, "s")) == 2, "02:00 started as 01:00's run ended"
    assert get_schedule(e, "s").buffered == ()


def test_ticks_buffered_start_at_once_when_the_policy_becomes_allow_all() -> None:
    e = engine()
    create_schedule(e, "s", "lasts", cron="* * * * *", input=3600, overlap="buffer_all")
    e.clock.advance(180)  # type: ignore[attr-defined]
    fire_due_schedules(e)
    assert len(get_schedule(e, "s").buffered) == 2, "01:00 runs, 02:00 and 03:00 wait"
    update_schedule(e, "s", overlap="allow_all")
    fire_due_schedules(e)
    info = get_schedule(e, "s")
    assert info.buffered == ()
    assert len(runs_of(e, "s")) == 3


def test_a_buffer_all_backfill_goes_on_beside_an_allow_all_schedules_overlapping_runs() -> None:
    e = engine()
    create_schedule(e, "s", "lasts", cron="* * * * *", input=150, overlap="allow_all")
    start = datetime.fromtimestamp(BASE - 3600 - 30, UTC)  # an hour before: 60 ticks
    first = backfill_schedule(e, "s", start, start.replace(minute=start.minute + 3))
    assert first == ["sched/s@2026-12-06T23:00:00Z"], "the first backfilled tick starts"
    for _ in range(30):  # the regular runs overlap, each lasting 2.5 ticks
        e.clock.advance(30)  # type: ignore[attr-defined]
        e.fire_due_timers()
        fire_due_schedules(e)
    backfilled = [run.id for run in runs_of(e, "s") if run.id < "sched/s@2026-12-07"]
    assert backfilled == [f"sched/s@2026-12-06T23:0{m}:00Z" for m in range(3)]
    assert get_schedule(e, "s").backfills == 0


def test_a_schedule_made_again_never_decides_the_ticks_its_predecessor_did() -> None:
    ahead, behind = FakeClock(BASE), FakeClock(BASE - 60)  # 00:00:30 and 23:59:30
    store = MemoryStore()
    one, two = engine(store, ahead), engine(store, behind)
    create_schedule(one, "s", "tick", cron="* * * * *", input="old")
    ahead.advance(31)
    assert fire_due_schedules(one) == ["sched/s@2026-12-07T00:01:00Z"]
    delete_schedule(one, "s")
    create_schedule(two, "s", "tick", cron="* * * * *", input="new")
    behind.advance(91)  # 00:01:01 on the slow clock
    assert fire_due_schedules(two) == []
    assert get_schedule(two, "s").counts.started == 0, "00:01 was the old schedule's"
    behind.advance(60)
    assert fire_due_schedules(two) == ["sched/s@2026-12-07T00:02:00Z"]
    assert two.get("sched/s@2026-12-07T00:02:00Z").input["input"] == "new"


def test_a_trigger_never_takes_a_ticks_id_and_two_in_a_millisecond_are_two_runs() -> None:
    clock = FakeClock(BASE)
    e = engine(MemoryStore(), clock)
    create_schedule(e, "s", "tick", cron="* * * * *", overlap="allow_all")
    clock.advance(30)  # exactly 00:01:00.000
    assert trigger_schedule(e, "s") == "sched/s@2026-12-07T00:01:00.000Z"
    assert trigger_schedule(e, "s") == "sched/s@2026-12-07T00:01:00.001Z"
    fire_due_schedules(e)  # the tick itself (or the listener of a trigger's run did)
    runs = runs_of(e, "s")
    assert "sched/s@2026-12-07T00:01:00Z" in [run.id for run in runs]
    assert len(runs) == get_schedule(e, "s").counts.started == 3
    assert e.get("sched/s@2026-12-07T00:01:00.000Z").input["tick"] == "2026-12-07T00:01:00.000Z"


def test_a_trigger_of_a_schedule_made_again_in_the_same_millisecond_is_a_new_run() -> None:
    """The old schedule's trigger run is in no state of the new one: its id is seen
    taken in the store."""
    clock = FakeClock(BASE)
    e = engine(MemoryStore(), clock)
    create_schedule(e, "s", "tick", cron="0 0 1 1 *", overlap="allow_all", input="old")
    clock.advance(30)
    assert trigger_schedule(e, "s") == "sched/s@2026-12-07T00:01:00.000Z"
    delete_schedule(e, "s")
    create_schedule(e, "s", "tick", cron="0 0 1 1 *", overlap="allow_all", input="new")
    again = trigger_schedule(e, "s")
    assert again == "sched/s@2026-12-07T00:01:00.001Z"
    assert again is not None
    assert e.get(again).input["input"] == "new"


def test_one_fire_deciding_many_ticks_never_conflicts_with_its_own_appends() -> None:
    """Each decision is appended at the head the last one left: a fire alone in the
    store meets no conflict, however many ticks it catches up."""
    store, clock = CountsConflicts(), FakeClock(BASE)
    e = engine(store, clock)
    create_schedule(e, "s", "tick", cron="* * * * * *", overlap="allow_all")
    clock.advance(250)  # 250 ticks: three decisions (each starts at most 100)
    assert len(fire_due_schedules(e)) == 250
    assert store.conflicts == Counter()


def test_a_backfill_over_a_tick_due_now_starts_it_once() -> None:
    e = engine()
    create_schedule(e, "s", "lasts", cron="* * * * *", input=3600, overlap="allow_all")
    e.clock.advance(31)  # type: ignore[attr-defined]  # 00:01:01: a tick is due
    started = backfill_schedule(
        e, "s", datetime(2026, 12, 7, 0, 0, 30, tzinfo=UTC), BASE + 30.5, overlap="allow_all"
    )
    assert started == ["sched/s@2026-12-07T00:01:00Z"]
    counts = get_schedule(e, "s").counts
    assert (counts.started, counts.already_ran) == (1, 1)


def test_a_long_catch_up_is_cut_into_polls_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_poller, "_BUDGET", 0.0)  # one decision a poll
    e = engine()
    create_schedule(e, "s", "tick", cron="* * * * * *", catchup_window=60, overlap="allow_all")
    e.clock.advance(3 * 86_400)  # type: ignore[attr-defined]  # 259,200 ticks
    poller = SchedulePoller(e)
    polls = 1
    with caplog.at_level("WARNING", logger="loom"):
        while (after := poller()) is not None and after <= 0:
            polls += 1
            assert polls < 20
    assert polls >= 3, "a decision looks at 100,000 ticks at most"
    counts = get_schedule(e, "s").counts
    assert (counts.missed, counts.started) == (259_200 - 61, 61)
    assert "tick(s) missed, due longer ago than its catch-up window (60 s)" in caplog.text


def test_a_damaged_schedule_is_reported_listed_around_and_deletable() -> None:
    e = engine()
    create_schedule(e, "good", "tick", cron="* * * * *")
    create_schedule(e, "bad", "tick", cron="* * * * *")
    stream = "schedules/bad"
    damaged = b'{"format": 1, "state": {"spec": {"flow": 3}}}'
    e.store.append(stream, e.store.head(stream), [NewRecord("loom.schedule", damaged, 0.0)])
    with pytest.raises(SchemaError, match=r"state\.spec"):
        get_schedule(e, "bad")
    assert [info.name for info in list_schedules(e)] == ["good"]
    scanned: Sequence[tuple[str, object]] = scan_schedules(e)
    assert [name for name, _ in scanned] == ["bad", "good"]
    assert isinstance(scanned[0][1], SchemaError)
    delete_schedule(e, "bad")
    assert [name for name, _ in scan_schedules(e)] == ["good"]
    create_schedule(e, "bad", "tick", cron="* * * * *")
    assert get_schedule(e, "bad").flow == "tick"
    e.clock.advance(60)  # type: ignore[attr-defined]
    assert sorted(fire_due_schedules(e)) == [
        "sched/bad@2026-12-07T00:01:00Z",
        "sched/good@2026-12-07T00:01:00Z",
    ]
    assert all(run.status is Status.COMPLETED for run in runs_of(e, "bad"))
