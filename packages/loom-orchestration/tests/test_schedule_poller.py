"""A worker's schedule poller, on a fake clock and a fake monotonic clock: it says
when the next tick is due (and nothing when no schedule has one, so an idle worker
keeps its own pace), lists the names again at the first poll `refresh` seconds after
the last, and reads every state again every sixth listing."""

from __future__ import annotations

import pytest
from loom_kernel import MemoryStore
from loom_kernel.spi import NewRecord
from loom_kernel.testing import FakeClock
from loom_orchestration import create_schedule, pause_schedule, unpause_schedule
from loom_orchestration._schedules import _book
from loom_orchestration._schedules._poller import FULL_EVERY, SchedulePoller
from schedule_helpers import BASE, engine, runs_of


class Monotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_it_says_when_the_next_tick_is_due_and_nothing_without_schedules() -> None:
    e = engine()
    monotonic = Monotonic()
    poller = SchedulePoller(e, refresh=5, monotonic=monotonic)
    assert poller() is None, "no schedule: the worker's idle pace decides"
    create_schedule(e, "minutely", "tick", cron="* * * * *")
    monotonic.now += 5
    assert poller() == pytest.approx(30.0), "BASE is half a minute before a tick"
    e.clock.advance(30)  # type: ignore[attr-defined]
    assert poller() == pytest.approx(60.0), "fired 00:01, and 00:02 is next"
    assert [run.id for run in runs_of(e, "minutely")] == ["sched/minutely@2026-12-07T00:01:00Z"]


def test_a_schedule_made_elsewhere_is_seen_at_the_first_poll_after_refresh() -> None:
    clock = FakeClock(BASE)
    here, elsewhere = engine(MemoryStore(), clock), None
    elsewhere = engine(here.store, clock)
    monotonic = Monotonic()
    poller = SchedulePoller(here, refresh=5, monotonic=monotonic)
    assert poller() is None
    create_schedule(elsewhere, "minutely", "tick", cron="* * * * *")
    clock.advance(90)
    monotonic.now += 4
    assert poller() is None, "not listed again yet"
    assert runs_of(here, "minutely") == []
    monotonic.now += 1
    poller()
    assert [run.id for run in runs_of(here, "minutely")] == [
        "sched/minutely@2026-12-07T00:01:00Z",
        "sched/minutely@2026-12-07T00:02:00Z",
    ], "its ticks meanwhile caught up"


def test_a_pause_elsewhere_holds_at_once_and_an_unpause_is_seen_at_the_next_look() -> None:
    clock = FakeClock(BASE)
    here = engine(MemoryStore(), clock)
    elsewhere = engine(here.store, clock)
    monotonic = Monotonic()
    poller = SchedulePoller(here, refresh=5, monotonic=monotonic)
    create_schedule(here, "minutely", "tick", cron="* * * * *")
    poller()
    pause_schedule(elsewhere, "minutely")
    clock.advance(30)
    assert poller() is None, "the fire read the pause: nothing due while paused"
    assert runs_of(here, "minutely") == []
    unpause_schedule(elsewhere, "minutely")
    assert poller() is None, "not looked again yet"
    monotonic.now += 5
    assert poller() == pytest.approx(60.0), "its notice read: due at 00:02"
    clock.advance(60)
    poller()
    assert [run.id for run in runs_of(here, "minutely")] == ["sched/minutely@2026-12-07T00:02:00Z"]


def test_a_change_whose_notice_was_lost_is_seen_at_the_next_full_listing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock(BASE)
    here = engine(MemoryStore(), clock)
    elsewhere = engine(here.store, clock)
    monotonic = Monotonic()
    poller = SchedulePoller(here, refresh=5, monotonic=monotonic)
    assert poller() is None
    with monkeypatch.context() as patched:  # a crash between the change and its notice
        patched.setattr(_book, "notice", lambda *_args: None)
        create_schedule(elsewhere, "lost", "tick", cron="* * * * *")
    looks = 1
    while poller() is None:
        monotonic.now += 5
        looks += 1
        assert looks <= FULL_EVERY + 1
    assert looks == FULL_EVERY + 1, "seen at the full listing, not before"


def test_a_worker_behind_the_trimmed_notices_lists_everything_again() -> None:
    clock = FakeClock(BASE)
    here = engine(MemoryStore(), clock)
    monotonic = Monotonic()
    poller = SchedulePoller(here, refresh=5, monotonic=monotonic)
    poller()
    for number in range(600):  # trimmed every 256 notices, keeping 256
        _book.notice(here.store, f"n{number}", BASE)
    assert here.store.read(_book.NOTICES, 512)[0].position == 513
    create_schedule(here, "late", "tick", cron="* * * * *")
    monotonic.now += 5
    assert poller() == pytest.approx(30.0), "a full listing found it"


def test_a_damaged_schedule_is_tried_again_after_refresh_and_the_others_fire(
    caplog: pytest.LogCaptureFixture,
) -> None:
    e = engine()
    monotonic = Monotonic()
    create_schedule(e, "good", "tick", cron="* * * * *")
    create_schedule(e, "bad", "tick", cron="* * * * *")
    stream = "schedules/bad"
    e.store.append(stream, e.store.head(stream), [NewRecord("SCHEDULE", b"{not json", 0.0)])
    poller = SchedulePoller(e, refresh=5, monotonic=monotonic)
    with caplog.at_level("WARNING", logger="loom"):
        assert poller() == pytest.approx(5.0), "the damaged one is looked at again in 5 s"
        e.clock.advance(30)  # type: ignore[attr-defined]
        poller()
    assert "schedule bad not" in caplog.text
    assert [run.id for run in runs_of(e, "good")] == ["sched/good@2026-12-07T00:01:00Z"]
