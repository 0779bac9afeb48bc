"""What a schedule is (`_schedules/_spec.py`): its name and arguments checked before
anything is written, its ticks as Debian cron reads them in its time zone (across a
spring-forward and a fall-back), its runs' ids, and a jitter that every process
draws the same and that never passes the next tick."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from loom_kernel import Engine, InvalidArgumentError, InvalidIdError, MemoryStore
from loom_orchestration import create_schedule, list_schedules
from loom_orchestration._schedules._spec import MAX_NAME_LENGTH, ScheduleSpec, run_id, tick_text


def _utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> float:  # noqa: PLR0917
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC).timestamp()


def _ticks(spec: ScheduleSpec, after: float, count: int) -> list[str]:
    ticks = spec.ticks_after(after)
    return [tick_text(next(ticks)) for _ in range(count)]


def test_ticks_are_strictly_after_the_cursor_in_utc() -> None:
    spec = ScheduleSpec(flow="f", cron="*/15 * * * *")
    assert _ticks(spec, _utc(2026, 12, 7, 3, 0), 3) == [
        "2026-12-07T03:15:00Z",
        "2026-12-07T03:30:00Z",
        "2026-12-07T03:45:00Z",
    ]
    assert _ticks(spec, _utc(2026, 12, 7, 3, 0) - 0.5, 1) == ["2026-12-07T03:00:00Z"]


def test_six_fields_have_seconds_first_and_l_and_hash_work() -> None:
    assert _ticks(ScheduleSpec(flow="f", cron="*/20 * * * * *"), _utc(2026, 1, 1), 2) == [
        "2026-01-01T00:00:20Z",
        "2026-01-01T00:00:40Z",
    ]
    assert _ticks(ScheduleSpec(flow="f", cron="0 0 L * *"), _utc(2026, 2, 1), 1) == [
        "2026-02-28T00:00:00Z"
    ]
    assert _ticks(ScheduleSpec(flow="f", cron="0 9 * * 1#2"), _utc(2026, 1, 1), 1) == [
        "2026-01-12T09:00:00Z"
    ]


def test_a_spring_forward_fires_the_skipped_time_at_the_next_one() -> None:
    """New York, 8 March 2026: 02:00 EST jumps to 03:00 EDT. A 02:30 job runs at 03:00
    that day, as Debian cron runs it, and at 02:30 again the day after."""
    spec = ScheduleSpec(flow="f", cron="30 2 * * *", timezone="America/New_York")
    assert _ticks(spec, _utc(2026, 3, 7, 12, 0), 3) == [
        "2026-03-08T07:00:00Z",  # 03:00 EDT: the first time after the skipped 02:30
        "2026-03-09T06:30:00Z",  # 02:30 EDT
        "2026-03-10T06:30:00Z",
    ]


def test_a_fall_back_fires_the_repeated_time_once() -> None:
    """New York, 1 November 2026: 02:00 EDT falls back to 01:00 EST, so 01:30 happens
    twice; the job runs at the first, once."""
    spec = ScheduleSpec(flow="f", cron="30 1 * * *", timezone="America/New_York")
    assert _ticks(spec, _utc(2026, 10, 31, 12, 0), 3) == [
        "2026-11-01T05:30:00Z",  # 01:30 EDT; 01:30 EST an hour later does not fire
        "2026-11-02T06:30:00Z",  # 01:30 EST
        "2026-11-03T06:30:00Z",
    ]
    hourly = ScheduleSpec(flow="f", cron="0 * * * *", timezone="America/New_York")
    ticks = _ticks(hourly, _utc(2026, 11, 1, 4, 30), 4)
    assert ticks == [
        "2026-11-01T05:00:00Z",  # 01:00 EDT
        "2026-11-01T06:00:00Z",  # 01:00 EST: another hour, another tick
        "2026-11-01T07:00:00Z",
        "2026-11-01T08:00:00Z",
    ]


def test_run_ids_name_the_schedule_and_the_tick_in_utc() -> None:
    assert run_id("nightly", _utc(2026, 12, 7, 3, 0)) == "sched/nightly@2026-12-07T03:00:00Z"
    assert run_id("n", _utc(2026, 12, 7, 3, 4, 5) + 0.123) == "sched/n@2026-12-07T03:04:05.123Z"
    assert run_id("n", _utc(2026, 12, 7) + 0.9999) == "sched/n@2026-12-07T00:00:01Z"


@given(
    name=st.text(alphabet="abcxyz-", min_size=1, max_size=12),
    minute=st.integers(0, 59),
    jitter=st.floats(0, 10_000),
    day=st.integers(0, 364),
)
def test_jitter_is_the_same_everywhere_and_never_reaches_the_next_tick(
    name: str, minute: int, jitter: float, day: int
) -> None:
    spec = ScheduleSpec(flow="f", cron=f"{minute} * * * *", jitter=jitter)
    tick = next(spec.ticks_after(_utc(2026, 1, 1) + day * 86_400))
    following = next(spec.ticks_after(tick))
    due = spec.due_at(name, tick, following)
    assert due == ScheduleSpec(flow="f", cron=f"{minute} * * * *", jitter=jitter).due_at(
        name, tick, following
    )
    assert tick <= due <= tick + min(jitter, following - tick)
    if jitter == 0:
        assert due == tick


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"cron": "* * * *"}, "is not a cron expression"),
        ({"cron": "0 0 30 2 *"}, "is not a cron expression"),
        ({"cron": 5}, "cron is a str"),
        ({"timezone": "Mars/Olympus"}, "not an IANA time zone"),
        ({"overlap": "queue"}, "overlap is one of skip, buffer_one"),
        ({"catchup_window": 0.5}, "catchup_window is at least 1 s"),
        ({"catchup_window": float("nan")}, "catchup_window is at most"),
        ({"catchup_window": 10**400}, "catchup_window is at most"),
        ({"jitter": 10**400}, "jitter is at most"),
        ({"catchup_window": "1h"}, "catchup_window is a timedelta"),
        ({"jitter": -1}, "jitter is at least 0 s"),
        ({"jitter": timedelta(seconds=-1)}, "jitter is at least 0 s"),
        ({"paused": "yes"}, "paused is a bool"),
        ({"note": 3}, "a note is a str"),
        ({"input": {1: "x"}}, "a schedule's input and note must be JSON"),
        ({"input": float("inf")}, "a schedule's input and note must be JSON"),
        ({"note": "\ud800"}, "a schedule's input and note must be JSON"),
    ],
)
def test_bad_arguments_are_refused_writing_nothing(options: dict[str, Any], error: str) -> None:
    engine = Engine(MemoryStore(), [], listeners=[])
    arguments: dict[str, Any] = {"cron": "* * * * *", **options}
    with pytest.raises(InvalidArgumentError, match=error):
        create_schedule(engine, "s", "f", **arguments)
    assert list_schedules(engine) == []
    assert engine.store.streams() == []


@pytest.mark.parametrize("name", ["", "a/b", "a@b", "x" * (MAX_NAME_LENGTH + 1), "sp ace", 7])
def test_a_name_that_cannot_name_its_runs_is_refused(name: Any) -> None:
    engine = Engine(MemoryStore(), [], listeners=[])
    with pytest.raises(InvalidIdError):
        create_schedule(engine, name, "f", cron="* * * * *")
    assert engine.store.streams() == []


def test_the_longest_name_still_names_valid_runs() -> None:
    engine = Engine(MemoryStore(), [], listeners=[])
    name = "x" * MAX_NAME_LENGTH
    create_schedule(engine, name, "f", cron="* * * * *")
    Engine.stream_of(run_id(name, _utc(2026, 12, 7, 3, 4, 5) + 0.123))  # a valid id


@pytest.mark.parametrize("flow_name", ["", None, 7])
def test_a_schedule_of_no_flow_name_is_refused(flow_name: Any) -> None:
    engine = Engine(MemoryStore(), [], listeners=[])
    with pytest.raises(InvalidArgumentError, match="a schedule's flow is a flow name"):
        create_schedule(engine, "s", flow_name, cron="* * * * *")
    assert engine.store.streams() == []
