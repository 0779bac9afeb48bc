"""Schedules with real processes, on SQLite and on S3 (Ceph RGW): `loom worker`
processes SIGKILLed at random (sometimes all of them at once, for a few seconds) while
a schedule fires every second for a minute. Every tick from its creation to the last
one decided has one run, none missed or skipped, each run's step journaled once; a
step ran again only where a kill cut it short."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path
from unittest import mock

import pytest
from loom_kernel import Engine, Status, open_store
from loom_kernel.events import StepCompleted, decode_events
from loom_orchestration import create_schedule, get_schedule, pause_schedule
from process_targets import Target, loom_worker, make_target, python_path

HERE = Path(__file__).parent
CHAOS_SECONDS = 40.0


@pytest.fixture(params=["sqlite", "rgw", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    return make_target(request, tmp_path, "schedules")


def _worker(target: Target, environment: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return loom_worker(target, environment, log, "schedule_flows:FLOWS")


def _tick_of(execution_id: str) -> float:
    return datetime.fromisoformat(execution_id.split("@")[1]).timestamp()


@pytest.mark.slow
def test_a_per_second_schedule_under_sigkilled_workers_starts_each_tick_once(
    target: Target, tmp_path: Path
) -> None:
    seed = random.randrange(2**32)
    chance = random.Random(seed)
    side, log = tmp_path / "side.txt", tmp_path / "workers.log"
    side.touch()
    environment = {
        **os.environ,
        **target.environment,
        "LOOM_SCHEDULE_SIDE": str(side),
        "PYTHONPATH": python_path(HERE),
    }
    with mock.patch.dict(os.environ, target.environment):
        store = open_store(target.url)
    engine = Engine(store, [], listeners=[])
    created = create_schedule(
        engine, "each-second", "stamp", cron="* * * * * *", overlap="allow_all",
        catchup_window=3600,
    )  # fmt: skip
    workers = [_worker(target, environment, log) for _ in range(3)]
    kills = 0
    try:
        chaos_ends = time.monotonic() + CHAOS_SECONDS
        while time.monotonic() < chaos_ends:
            time.sleep(chance.uniform(1.0, 5.0))
            alive = [worker for worker in workers if worker.poll() is None]
            victims = alive if chance.random() < 0.15 else chance.sample(alive, k=1)
            for victim in victims:
                victim.send_signal(signal.SIGKILL)
                victim.wait(30)
                kills += 1
            if len(victims) > 1:
                time.sleep(chance.uniform(1.0, 4.0))  # an outage: its ticks are caught up
            workers = [worker for worker in workers if worker.poll() is None]
            while len(workers) < 3:
                workers.append(_worker(target, environment, log))
        calm = time.time()
        deadline = time.monotonic() + 180
        while True:
            info = get_schedule(engine, "each-second")
            runs = list(engine.executions("sched/each-second@"))
            decided_past_calm = info.last_tick is not None and info.last_tick.timestamp() > calm
            if decided_past_calm and all(run.status is Status.COMPLETED for run in runs):
                break
            assert time.monotonic() < deadline, (seed, log.read_text()[-3000:])
            time.sleep(0.5)
        pause_schedule(engine, "each-second")  # what comes next is not this test's
        info = get_schedule(engine, "each-second")
        runs = list(engine.executions("sched/each-second@"))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.wait(60)

    last = max(_tick_of(run.id) for run in runs)
    first = int(created.created_at.timestamp()) + 1
    expected = [float(tick) for tick in range(first, int(last) + 1)]
    ticks = sorted(_tick_of(run.id) for run in runs)
    assert ticks == expected, f"seed {seed}: every tick once, none lost"
    assert (info.counts.missed, info.counts.skipped) == (0, 0), seed
    assert info.counts.started >= len(runs), seed  # and past `last`, decided but not seen
    assert len(runs) >= CHAOS_SECONDS, seed
    for run in runs:
        assert run.status is Status.COMPLETED, (seed, run.id)
        events = decode_events(engine.store.read(engine.stream_of(run.id)))
        assert sum(isinstance(event, StepCompleted) for event in events) == 1, (seed, run.id)
    noted = collections.Counter(line.split()[0] for line in side.read_text().splitlines())
    assert set(noted) == {run.id.split("@")[1] for run in runs}, seed
    again = sum(noted.values()) - len(noted)
    assert again <= kills, f"seed {seed}: a step ran again only where a kill cut it short"
