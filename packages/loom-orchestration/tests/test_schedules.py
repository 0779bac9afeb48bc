"""Schedules on a fake clock: each tick starts one run whatever the interleaving of the
engines that fire it; missed ticks are started within the catch-up window and counted
past it; a backfill ignores the window and never runs a tick twice; pause, trigger,
delete; and a decision whose actions a crash cut short is finished by the next fire."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel import (
    Engine,
    InvalidArgumentError,
    MemoryStore,
    SchemaError,
    Status,
    StoreUnavailableError,
)
from loom_kernel.spi import NewRecord
from loom_kernel.testing import FakeClock, Interleaving
from loom_orchestration import (
    ScheduleExistsError,
    ScheduleNotFoundError,
    backfill_schedule,
    create_schedule,
    delete_schedule,
    fire_due_schedules,
    get_schedule,
    list_schedules,
    pause_schedule,
    trigger_schedule,
    unpause_schedule,
    update_schedule,
)
from schedule_helpers import BASE, engine, ran, reset, runs_of

pytestmark = pytest.mark.usefixtures("fresh")


@pytest.fixture
def fresh() -> None:
    reset()


def _minute_ids(name: str, first: int, last: int) -> list[str]:
    start = datetime.fromtimestamp(BASE - 30, UTC)
    return [
        f"sched/{name}@{(start + timedelta(minutes=m)).strftime('%Y-%m-%dT%H:%M:%SZ')}"
        for m in range(first, last + 1)
    ]


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
)
@given(
    data=st.data(),
    steps=st.lists(st.integers(1, 25 * 60), min_size=1, max_size=4),
    skew=st.integers(-90, 90),
    overlap=st.sampled_from(["allow_all", "skip"]),
)
def test_two_engines_firing_in_any_interleaving_decide_each_of_sixty_ticks_once(
    data: st.DataObject, steps: list[int], skew: int, overlap: str
) -> None:
    """A schedule every minute for an hour, fired by two engines (their clocks apart by
    `skew` seconds, moved on in `steps`) whose store calls interleave as hypothesis
    picks: each tick is decided once. With `allow_all` that is sixty runs, one per
    tick, with the tick's id; with `skip` a tick is skipped only when the run before it
    was still being driven (by the other engine) as it was decided."""
    reset()  # each example's own ticks
    store = Interleaving(MemoryStore())
    first, second = FakeClock(BASE), FakeClock(BASE + skew)
    engines = [engine(store, first), engine(store, second)]
    create_schedule(engines[0], "hourly", "tick", cron="* * * * *", overlap=overlap)
    end = BASE + 3600
    for step in [*steps, 3600]:
        for clock in (first, second):
            clock.advance(max(0.0, min(step, end - clock())))
        outcome: dict[str, Any] = store.run(
            {
                "one": lambda: fire_due_schedules(engines[0]),
                "two": lambda: fire_due_schedules(engines[1]),
            },
            choose=lambda names: data.draw(st.sampled_from(sorted(names))),
        )
        assert not any(isinstance(value, BaseException) for value in outcome.values()), outcome
    ids = [run.id for run in runs_of(engines[0], "hourly")]
    ticks = _minute_ids("hourly", 1, 60)
    assert set(ids) <= set(ticks)
    assert sorted(ran) == sorted(set(ran)), "no tick's step ran twice"
    counts = get_schedule(engines[0], "hourly").counts
    assert counts.started == len(ids)
    assert counts.started + counts.skipped == 60
    assert counts.missed == 0
    if overlap == "allow_all":
        assert ids == ticks


def test_two_engines_firing_each_minute_in_turn_start_sixty_runs() -> None:
    clock = FakeClock(BASE)
    engines = [engine(MemoryStore(), clock)]
    engines.append(engine(engines[0].store, clock))
    create_schedule(engines[0], "hourly", "tick", cron="* * * * *")
    for minute in range(60):
        clock.advance(60)
        fire_due_schedules(engines[minute % 2])
        fire_due_schedules(engines[(minute + 1) % 2])
    assert [run.id for run in runs_of(engines[0], "hourly")] == _minute_ids("hourly", 1, 60)
    assert ran == [tick.split("@")[1] for tick in _minute_ids("hourly", 1, 60)]


def test_each_run_receives_its_nominal_tick_and_the_input() -> None:
    e = engine()
    create_schedule(e, "daily", "tick", cron="0 * * * *", input={"region": "eu"}, jitter=1800)
    e.clock.advance(3 * 3600 + 1800)  # type: ignore[attr-defined]  # 03:00's jitter is past
    started = fire_due_schedules(e)
    assert started == _hours("daily", 1, 3)
    assert ran == [run.split("@")[1] for run in started], "the nominal tick, not the jittered one"
    first = e.state(started[0])
    assert first.input == {
        "schedule": "daily",
        "tick": started[0].split("@")[1],
        "input": {"region": "eu"},
    }


def _hours(name: str, first: int, last: int) -> list[str]:
    start = datetime.fromtimestamp(BASE - 30, UTC)
    return [
        f"sched/{name}@{(start + timedelta(hours=h)).strftime('%Y-%m-%dT%H:%M:%SZ')}"
        for h in range(first, last + 1)
    ]


def test_ticks_older_than_the_window_are_counted_missed_and_a_backfill_runs_them_once() -> None:
    e = engine()
    create_schedule(e, "m", "tick", cron="* * * * *", catchup_window=600, overlap="allow_all")
    e.clock.advance(3600 - 30)  # type: ignore[attr-defined]  # at minute 60's tick: no worker ran
    started = fire_due_schedules(e)
    # Minute 50's tick is 600 s late: still within the window; minutes 1 to 49 are not.
    assert started == _minute_ids("m", 50, 60)
    counts = get_schedule(e, "m").counts
    assert (counts.started, counts.missed, counts.skipped) == (11, 49, 0)
    assert fire_due_schedules(e) == []
    back = backfill_schedule(
        e, "m", datetime.fromtimestamp(BASE + 30, UTC), datetime.fromtimestamp(BASE + 3600, UTC)
    )
    # buffer_all: one after another, each once the one before ended (inline, at once)
    assert back == _minute_ids("m", 1, 49)
    assert [run.id for run in runs_of(e, "m")] == _minute_ids("m", 1, 60)
    assert get_schedule(e, "m").counts.already_ran == 10, "50 to 59 (the range ends now)"
    again = backfill_schedule(
        e, "m", datetime.fromtimestamp(BASE + 30, UTC), datetime.fromtimestamp(BASE + 3600, UTC)
    )
    assert again == []
    assert len(runs_of(e, "m")) == 60
    info = get_schedule(e, "m")
    assert (info.counts.started, info.counts.already_ran, info.backfills) == (60, 10 + 59, 0)


def test_a_backfill_with_allow_all_starts_its_ticks_at_once_and_refuses_an_empty_range() -> None:
    e = engine()
    create_schedule(e, "b", "tick", cron="*/10 * * * *")
    e.clock.advance(10)  # type: ignore[attr-defined]
    day = datetime(2026, 12, 6, tzinfo=UTC)
    started = backfill_schedule(e, "b", day, day + timedelta(hours=1), overlap="allow_all")
    assert [s.split("@")[1] for s in started] == [
        f"2026-12-06T00:{m:02d}:00Z" for m in (0, 10, 20, 30, 40, 50)
    ]
    with pytest.raises(InvalidArgumentError, match="start < end"):
        backfill_schedule(e, "b", day, day)
    with pytest.raises(InvalidArgumentError, match="aware datetime"):
        backfill_schedule(e, "b", datetime(2026, 12, 6), day)
    with pytest.raises(InvalidArgumentError, match="overlap is one of"):
        backfill_schedule(e, "b", day, day + timedelta(hours=1), overlap="all")


def test_a_paused_schedule_starts_nothing_and_counts_what_came_meanwhile() -> None:
    e = engine()
    create_schedule(e, "p", "tick", cron="* * * * *")
    e.clock.advance(60)  # type: ignore[attr-defined]
    assert fire_due_schedules(e) == _minute_ids("p", 1, 1)
    info = pause_schedule(e, "p", note="maintenance")
    assert (info.paused, info.note, info.next_ticks) == (True, "maintenance", ())
    e.clock.advance(600)  # type: ignore[attr-defined]
    assert fire_due_schedules(e) == []
    assert trigger_schedule(e, "p") is not None, "a paused schedule may be triggered"
    info = unpause_schedule(e, "p")
    assert (info.paused, info.counts.paused) == (False, 10)
    e.clock.advance(60)  # type: ignore[attr-defined]
    assert fire_due_schedules(e) == _minute_ids("p", 12, 12)


def test_trigger_follows_the_overlap_policy_unless_told_otherwise() -> None:
    e = engine()
    create_schedule(e, "t", "lasts", cron="0 0 1 1 *", input=600)  # a run lasts 10 min
    first = trigger_schedule(e, "t")
    assert first is not None
    assert e.get(first).status is Status.SUSPENDED
    assert trigger_schedule(e, "t") is None, "skip: the last run still runs"
    e.clock.advance(1)  # type: ignore[attr-defined]
    second = trigger_schedule(e, "t", overlap="allow_all")
    assert second not in (None, first)
    with pytest.raises(InvalidArgumentError, match="overlap is one of"):
        trigger_schedule(e, "t", overlap="sometimes")
    assert get_schedule(e, "t").counts.skipped == 1


def test_a_schedule_deleted_between_its_listing_and_its_fire_fires_nothing() -> None:
    """A poller listed it due; it was deleted before the fire: nothing starts, and the
    fire says there is no such schedule (None)."""
    from loom_orchestration._schedules._firing import fire_schedule

    e = engine()
    create_schedule(e, "gone", "tick", cron="* * * * *")
    delete_schedule(e, "gone")
    e.clock.advance(600)  # type: ignore[attr-defined]
    assert fire_schedule(e, "gone") == ([], None)
    assert fire_schedule(e, "never") == ([], None)
    assert runs_of(e, "gone") == []


def test_create_delete_and_create_again_and_what_is_not_there() -> None:
    e = engine()
    create_schedule(e, "d", "tick", cron="* * * * *")
    with pytest.raises(ScheduleExistsError):
        create_schedule(e, "d", "tick", cron="*/5 * * * *")
    e.clock.advance(60)  # type: ignore[attr-defined]
    assert len(fire_due_schedules(e)) == 1
    delete_schedule(e, "d")
    assert list_schedules(e) == []
    for call in (get_schedule, pause_schedule, unpause_schedule, delete_schedule, trigger_schedule):
        with pytest.raises(ScheduleNotFoundError):
            call(e, "d")
    e.clock.advance(600)  # type: ignore[attr-defined]
    assert fire_due_schedules(e) == []
    again = create_schedule(e, "d", "tick", cron="*/5 * * * *")
    assert (again.counts.started, again.cron) == (0, "*/5 * * * *")
    assert [info.name for info in list_schedules(e)] == ["d"]


def test_an_update_changes_what_comes_and_keeps_what_was_decided() -> None:
    e = engine()
    create_schedule(e, "u", "tick", cron="* * * * *", input=1)
    e.clock.advance(60)  # type: ignore[attr-defined]
    fire_due_schedules(e)
    info = update_schedule(e, "u", cron="*/10 * * * *", input={"v": 2}, overlap="allow_all")
    assert (info.cron, info.input, info.overlap, info.counts.started) == (
        "*/10 * * * *",
        {"v": 2},
        "allow_all",
        1,
    )
    assert info.next_ticks[0] == datetime(2026, 12, 7, 0, 10, tzinfo=UTC)
    with pytest.raises(InvalidArgumentError):
        update_schedule(e, "u", cron="nonsense")
    assert get_schedule(e, "u").cron == "*/10 * * * *"


class FailsStartsOnce(MemoryStore):
    """A store whose first append of a run's start fails: the fire stops after its
    decision landed, as a crash between the two would."""

    failed = False

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        if stream.startswith("ex/sched/") and not FailsStartsOnce.failed:
            FailsStartsOnce.failed = True
            raise StoreUnavailableError("the disk hiccuped")
        return super()._append(stream, expected, records)


def test_a_decision_whose_start_failed_is_started_by_the_next_fire() -> None:
    FailsStartsOnce.failed = False
    store = FailsStartsOnce()
    e = engine(store)
    create_schedule(e, "c", "tick", cron="* * * * *")
    e.clock.advance(60)  # type: ignore[attr-defined]
    with pytest.raises(StoreUnavailableError):
        fire_due_schedules(e)
    assert runs_of(e, "c") == []
    assert get_schedule(e, "c").counts.started == 1, "decided, then the start failed"
    other = engine(store, e.clock)  # type: ignore[arg-type]
    assert fire_due_schedules(other) == [], "nothing new decided: the owed start is made"
    assert [run.id for run in runs_of(e, "c")] == _minute_ids("c", 1, 1)
    assert ran == [_minute_ids("c", 1, 1)[0].split("@")[1]]


def test_a_damaged_schedule_is_reported_and_the_others_still_fire() -> None:
    e = engine()
    create_schedule(e, "good", "tick", cron="* * * * *")
    create_schedule(e, "bad", "tick", cron="* * * * *")
    e.store.append("schedules/bad", 1, [NewRecord("loom.schedule", b'{"format": 1}', 0.0)])
    e.clock.advance(60)  # type: ignore[attr-defined]
    with pytest.raises(SchemaError, match="schedules/bad at 2: a damaged schedule record"):
        fire_due_schedules(e)
    assert [run.id for run in runs_of(e, "good")] == _minute_ids("good", 1, 1)
    with pytest.raises(SchemaError):
        get_schedule(e, "bad")
    wrong = json.dumps({"format": 2, "state": {}}).encode()
    e.store.append("schedules/bad", 2, [NewRecord("loom.schedule", wrong, 0.0)])
    with pytest.raises(SchemaError, match="format 1"):
        get_schedule(e, "bad")


def test_a_schedule_of_a_flow_this_engine_lacks_waits_for_a_worker_that_has_it() -> None:
    store = MemoryStore()
    web = Engine(store, [], listeners=[], clock=FakeClock(BASE))
    create_schedule(web, "w", "tick", cron="* * * * *")
    web.clock.advance(60)  # type: ignore[attr-defined]
    started = fire_due_schedules(web)
    assert [web.get(i).status for i in started] == [Status.RUNNING], "journaled, not driven"
    worker = engine(store)
    assert worker.recover() == started
    assert worker.get(started[0]).status is Status.COMPLETED


def test_a_long_outage_of_a_per_second_schedule_is_caught_up_in_bounded_decisions() -> None:
    """A day of seconds, with a window of a minute: 86,340 missed, 61 started (the
    inline runs end at once, so `skip` starts every one), counted exactly."""
    e = engine()
    create_schedule(e, "s", "tick", cron="* * * * * *", catchup_window=60)
    e.clock.advance(86_400)  # type: ignore[attr-defined]
    started = fire_due_schedules(e)
    counts = get_schedule(e, "s").counts
    assert (len(started), counts.started, counts.missed) == (61, 61, 86_400 - 61)
    assert len(e.store.read("schedules/s", e.store.head("schedules/s") - 1)) == 1
