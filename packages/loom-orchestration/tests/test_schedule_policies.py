"""The six overlap policies as timelines: a schedule every minute whose runs last 2.5
minutes (so two ticks come while each run runs), fired every 5 seconds on a fake
clock from 00:00:30 to 00:05:50 (before 06:00, where a buffered run's end and a tick
coincide). For each policy: which tick's run started when, how each ended, and what
the schedule counted, as Temporal documents each policy."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from loom_kernel import Engine, Status
from loom_orchestration import create_schedule, fire_due_schedules, get_schedule
from loom_orchestration._schedules._spec import schedule_of
from schedule_helpers import BASE, engine, runs_of

LASTS = 150  # seconds: 2.5 intervals
END = BASE + 5 * 60 + 20  # 00:05:50


def _clock_text(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%M:%S")


def _timeline(overlap: str) -> tuple[Engine, dict[str, str]]:
    """Fire the schedule every 5 s; which tick (mm:ss) started when (mm:ss)."""
    e = engine()
    create_schedule(e, "every", "lasts", cron="* * * * *", input=LASTS, overlap=overlap)
    started: dict[str, str] = {}
    while e.clock() < END:
        e.clock.advance(5)  # type: ignore[attr-defined]
        e.fire_due_timers()
        fire_due_schedules(e)
        for run in runs_of(e, "every"):
            tick = run.id.split("@")[1][14:19]  # the tick's mm:ss
            started.setdefault(tick, _clock_text(e.clock()))
    return e, started


def _statuses(e: Engine) -> dict[str, str]:
    return {run.id.split("@")[1][14:19]: run.status.value for run in runs_of(e, "every")}


def test_allow_all_starts_every_tick_at_its_time_and_lets_them_overlap() -> None:
    e, started = _timeline("allow_all")
    assert started == {f"0{m}:00": f"0{m}:00" for m in range(1, 6)}
    statuses = _statuses(e)
    assert [statuses[f"0{m}:00"] for m in range(1, 4)] == ["completed"] * 3
    assert statuses["04:00"] == statuses["05:00"] == "suspended", "still sleeping"
    counts = get_schedule(e, "every").counts
    assert (counts.started, counts.skipped, counts.buffered) == (5, 0, 0)


def test_skip_drops_the_ticks_that_come_while_the_last_run_runs() -> None:
    e, started = _timeline("skip")
    # 01:00 runs to 03:30, so 02:00 and 03:00 are skipped; 04:00 runs to 06:30, so
    # 05:00 is skipped.
    assert started == {"01:00": "01:00", "04:00": "04:00"}
    counts = get_schedule(e, "every").counts
    assert (counts.started, counts.skipped) == (2, 3)


def test_buffer_one_keeps_one_tick_and_starts_it_when_the_last_run_ends() -> None:
    e, started = _timeline("buffer_one")
    # 02:00 waits for 01:00 to end (03:30); 03:00 finds the buffer full and is
    # skipped; 04:00 waits for 02:00 (ends 06:00); 05:00 is skipped.
    assert started == {"01:00": "01:00", "02:00": "03:30"}
    info = get_schedule(e, "every")
    assert info.buffered == ("sched/every@2026-12-07T00:04:00Z",)
    assert (info.counts.started, info.counts.skipped, info.counts.buffered) == (2, 2, 2)


def test_buffer_all_runs_every_tick_one_after_another() -> None:
    e, started = _timeline("buffer_all")
    assert started == {"01:00": "01:00", "02:00": "03:30"}
    info = get_schedule(e, "every")
    assert info.buffered == tuple(f"sched/every@2026-12-07T00:0{m}:00Z" for m in range(3, 6))
    assert (info.counts.started, info.counts.skipped, info.counts.buffered) == (2, 0, 4)
    assert _statuses(e)["01:00"] == "completed"


@pytest.mark.parametrize(
    ("overlap", "how"), [("cancel_other", "cancelled"), ("terminate_other", "terminated")]
)
def test_cancel_and_terminate_other_end_the_last_run_for_each_new_tick(
    overlap: str, how: str
) -> None:
    e, started = _timeline(overlap)
    assert started == {f"0{m}:00": f"0{m}:00" for m in range(1, 6)}
    statuses = _statuses(e)
    assert [statuses[f"0{m}:00"] for m in range(1, 5)] == ["cancelled"] * 4
    assert statuses["05:00"] == "suspended"
    for run in runs_of(e, "every")[:-1]:
        assert run.status is Status.CANCELLED
        assert run.cancel_reason is not None
        assert f"({overlap}): {how} by the tick of" in run.cancel_reason
    counts = get_schedule(e, "every").counts
    assert counts.started == 5
    assert getattr(counts, how) == 4
    assert all(schedule_of(run.id) == "every" for run in runs_of(e, "every"))


def test_cancel_other_with_two_ticks_due_at_once_starts_each_in_turn() -> None:
    """Fired late, with 02:00 and 03:00 both due: the decision that cancels 01:00's run
    for 02:00 stops there (the next must see the cancel's outcome), so 02:00's run
    starts, then is cancelled for 03:00's: no tick is skipped."""
    e = engine()
    create_schedule(e, "every", "lasts", cron="* * * * *", input=LASTS, overlap="cancel_other")
    e.clock.advance(65)  # type: ignore[attr-defined]
    fire_due_schedules(e)
    e.clock.advance(120)  # type: ignore[attr-defined]
    fire_due_schedules(e)
    statuses = _statuses(e)
    assert statuses == {"01:00": "cancelled", "02:00": "cancelled", "03:00": "suspended"}
    counts = get_schedule(e, "every").counts
    assert (counts.started, counts.cancelled, counts.skipped) == (3, 2, 0)
