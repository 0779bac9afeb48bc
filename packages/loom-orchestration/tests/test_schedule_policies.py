"""The six overlap policies as timelines: a schedule every minute whose runs last 140
seconds (so each tick but the first of a run comes while the last still runs), fired
every 5 seconds on a fake clock from 00:00:30 to 00:07:30. For each policy: which
tick's run started when, how each ended, and what the schedule counted."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from loom_kernel import Engine, Status
from loom_orchestration import create_schedule, fire_due_schedules, get_schedule
from loom_orchestration._schedules._spec import schedule_of
from schedule_helpers import BASE, engine, runs_of

LASTS = 140  # seconds: 2 1/3 intervals
END = BASE + 7 * 60  # 00:07:30


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
    assert started == {f"0{m}:00": f"0{m}:00" for m in range(1, 8)}
    statuses = _statuses(e)
    assert [statuses[f"0{m}:00"] for m in range(1, 6)] == ["completed"] * 5
    assert statuses["06:00"] == statuses["07:00"] == "suspended", "still sleeping"
    counts = get_schedule(e, "every").counts
    assert (counts.started, counts.skipped, counts.buffered) == (7, 0, 0)


def test_skip_drops_the_ticks_that_come_while_the_last_run_runs() -> None:
    e, started = _timeline("skip")
    # 01:00 runs to 03:20, so 02:00 and 03:00 are skipped; 04:00 runs to 06:20 ...
    assert started == {"01:00": "01:00", "04:00": "04:00", "07:00": "07:00"}
    counts = get_schedule(e, "every").counts
    assert (counts.started, counts.skipped) == (3, 4)


def test_buffer_one_keeps_one_tick_and_starts_it_when_the_last_run_ends() -> None:
    e, started = _timeline("buffer_one")
    # 02:00 waits for 01:00 to end (03:20); 03:00 finds the buffer full and is
    # skipped; 04:00 waits for 02:00 (ends 05:40); 05:00 is skipped; 06:00 waits
    # for 04:00 (ends 08:00), and 07:00 is skipped.
    assert started == {"01:00": "01:00", "02:00": "03:20", "04:00": "05:40"}
    info = get_schedule(e, "every")
    assert info.buffered == ("sched/every@2026-12-07T00:06:00Z",)
    assert (info.counts.started, info.counts.skipped, info.counts.buffered) == (3, 3, 3)


def test_buffer_all_runs_every_tick_one_after_another() -> None:
    e, started = _timeline("buffer_all")
    assert started == {"01:00": "01:00", "02:00": "03:20", "03:00": "05:40"}
    info = get_schedule(e, "every")
    assert info.buffered == tuple(f"sched/every@2026-12-07T00:0{m}:00Z" for m in range(4, 8))
    assert (info.counts.started, info.counts.skipped) == (3, 0)
    statuses = _statuses(e)
    assert statuses["01:00"] == statuses["02:00"] == "completed"


@pytest.mark.parametrize(
    ("overlap", "how"), [("cancel_other", "cancelled"), ("terminate_other", "terminated")]
)
def test_cancel_and_terminate_other_end_the_last_run_for_each_new_tick(
    overlap: str, how: str
) -> None:
    e, started = _timeline(overlap)
    assert started == {f"0{m}:00": f"0{m}:00" for m in range(1, 8)}
    statuses = _statuses(e)
    assert [statuses[f"0{m}:00"] for m in range(1, 7)] == ["cancelled"] * 6
    assert statuses["07:00"] == "suspended"
    for run in runs_of(e, "every")[:-1]:
        assert run.status is Status.CANCELLED
        assert run.cancel_reason is not None
        assert f"({overlap}): {how} by the tick of" in run.cancel_reason
    counts = get_schedule(e, "every").counts
    assert counts.started == 7
    assert getattr(counts, how) == 6
    assert all(schedule_of(run.id) == "every" for run in runs_of(e, "every"))
