"""Workers fire schedules with no call of the application's: installing
loom-orchestration publishes the schedule poller (`loom.pollers`), and every worker,
on the real clock, starts each tick once however many workers poll."""

from __future__ import annotations

import itertools
import time
from datetime import datetime
from pathlib import Path

from loom_kernel import Engine, Status, Worker, open_store
from loom_kernel._hosting._pollers import POLLER_GROUP, installed_pollers
from loom_orchestration import create_schedule, delete_schedule, get_schedule
from loom_orchestration._schedules._poller import schedule_poller
from schedule_helpers import FLOWS, ran, reset


def test_the_schedule_poller_is_published_for_every_worker() -> None:
    assert POLLER_GROUP == "loom.pollers"
    assert schedule_poller in installed_pollers()


def test_two_workers_fire_a_per_second_schedule_each_tick_once(tmp_path: Path) -> None:
    reset()
    url = f"sqlite:///{tmp_path}/loom.db"
    with open_store(url) as one_store, open_store(url) as two_store:
        one = Engine(one_store, FLOWS, worker_id="one")
        two = Engine(two_store, FLOWS, worker_id="two")
        create_schedule(
            one,
            "each-second",
            "tick",
            cron="* * * * * *",
            overlap="allow_all",
            catchup_window=60,
        )
        with Worker(one, idle_poll=0.05), Worker(two, idle_poll=0.05):
            deadline = time.monotonic() + 30
            while get_schedule(one, "each-second").counts.started < 4:
                assert time.monotonic() < deadline, "a per-second schedule started no 4 runs"
                time.sleep(0.1)
            delete_schedule(one, "each-second")
        runs = list(one.executions("sched/each-second@"))
        ticks = [run.id.split("@")[1] for run in runs]
        assert len(ticks) >= 4
        assert sorted(ran) == sorted(set(ran)), "no tick's step ran twice"
        assert set(ran) <= set(ticks)
        # Consecutive seconds: none skipped or missed (the runs take no time).
        stamps = [datetime.fromisoformat(tick).timestamp() for tick in ticks]
        assert [b - a for a, b in itertools.pairwise(stamps)] == [1.0] * (len(ticks) - 1)
        assert all(run.status is Status.COMPLETED for run in runs)
