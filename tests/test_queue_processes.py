"""Queues with real processes, on SQLite and on S3 (Ceph RGW): `loom worker` processes
keep a queue's cap and per-key limit together, and a worker SIGKILLed while it holds
admissions gives them back (its runs end, no step is journaled twice)."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
from loom_kernel import Engine, Status, open_store
from loom_kernel.events import StepCompleted, decode_events
from process_targets import Target, loom_worker, make_target, python_path

HERE = Path(__file__).parent


@pytest.fixture(params=["sqlite", "rgw", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    return make_target(request, tmp_path, "queues")


def _environment(target: Target, side: Path, hold: Path | None = None) -> dict[str, str]:
    extra = {"LOOM_QUEUE_SIDE": str(side), "PYTHONPATH": python_path(HERE)}
    if hold is not None:
        extra["LOOM_QUEUE_HOLD"] = str(hold)
    return {**os.environ, **target.environment, **extra}


def _worker(
    target: Target,
    environment: dict[str, str],
    log: Path,
    *,
    lease: float = 2.0,
    grace: float = 5.0,
) -> subprocess.Popen[bytes]:
    return loom_worker(
        target, environment, log, "queue_flows:FLOWS", queues="queue_flows:QUEUES",
        lease=lease, grace=grace,
    )  # fmt: skip


def _engine(target: Target) -> Engine:
    sys.path.insert(0, str(HERE))
    try:
        from queue_flows import FLOWS, QUEUES
    finally:
        sys.path.pop(0)
    with mock.patch.dict(os.environ, target.environment):
        store = open_store(target.url)
    return Engine(store, FLOWS, queues=QUEUES, listeners=[])


def _most_at_once(side: Path, group: Callable[[str], str]) -> collections.Counter[str]:
    """The most steps in progress at once (by start and end times), per group of key."""
    events = []
    for line in side.read_text().splitlines():
        what, _run, key, at = line.split()
        events.append((float(at), 0 if what == "end" else 1, group(key)))
    now: collections.Counter[str] = collections.Counter()
    most: collections.Counter[str] = collections.Counter()
    for _at, starts, name in sorted(events):
        now[name] += 1 if starts else -1
        most[name] = max(most[name], now[name])
    return most


def _check_journals(engine: Engine, runs: list[str]) -> None:
    for run in runs:
        assert engine.get(run).status is Status.COMPLETED, run
        events = decode_events(engine.store.read(engine.stream_of(run)))
        indices = [e.index for e in events if isinstance(e, StepCompleted)]
        assert sorted(indices) == [0, 1], f"{run}: steps {indices}"


def _stop(workers: list[subprocess.Popen[bytes]], log: Path) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(60) in (0, -signal.SIGKILL), log.read_text()[-3000:]


@pytest.mark.slow
def test_worker_processes_keep_a_cap_and_a_per_key_limit_together(
    target: Target, tmp_path: Path
) -> None:
    side, log = tmp_path / "side.txt", tmp_path / "workers.log"
    side.touch()
    environment = _environment(target, side)
    engine = _engine(target)
    with mock.patch.dict(os.environ, environment):
        capped = [
            engine.enqueue("queued_job", {"seconds": 0.15}, key=f"c{i}", queue="capped").id
            for i in range(18)
        ]
        keyed = [
            engine.enqueue(
                "queued_job",
                {"seconds": 0.1, "key": key},
                key=f"k{key}{i}",
                queue="keyed",
                queue_key=key,
            ).id
            for i in range(5)
            for key in ("a", "b", "c")
        ]
        workers = [_worker(target, environment, log) for _ in range(3)]
        try:
            for run in capped + keyed:
                engine.handle(run).wait(timeout=120)
        finally:
            _stop(workers, log)
        _check_journals(engine, capped + keyed)
    capped_ids = set(capped)
    lines = side.read_text().splitlines()
    assert len(lines) == 2 * len(capped + keyed), "every step ran once"
    by_run = {line.split()[1]: line.split()[2] for line in lines}
    most = _most_at_once(side, lambda key: "keyed:" + key if key != "-" else "capped")
    assert most["capped"] == 3, f"the cap held across 3 processes and was reached: {most}"
    for key in "abc":
        assert most[f"keyed:{key}"] == 1, f"one run of key {key} at a time: {most}"
    assert len(by_run) == len(capped_ids) + len(keyed)


@pytest.mark.slow
def test_a_worker_killed_holding_admissions_gives_them_back(target: Target, tmp_path: Path) -> None:
    side, log, hold = tmp_path / "side.txt", tmp_path / "workers.log", tmp_path / "hold"
    side.touch()
    hold.touch()
    environment = _environment(target, side, hold)
    engine = _engine(target)
    with mock.patch.dict(os.environ, environment):
        runs = [
            engine.enqueue("queued_job", {"seconds": 0.0}, key=f"r{i}", queue="capped").id
            for i in range(6)
        ]
        first = _worker(target, environment, log)
        deadline = time.monotonic() + 60
        while side.read_text().count("start") < 3:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        assert sorted(engine.queue("capped").active) != []
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        hold.unlink()
        second = _worker(target, environment, log)
        try:
            for run in runs:
                engine.handle(run).wait(timeout=120)
        finally:
            _stop([second], log)
        _check_journals(engine, runs)
        view = engine.queue("capped")
        assert (view.waiting, view.active) == ([], [])
    starts = collections.Counter(
        line.split()[1] for line in side.read_text().splitlines() if line.startswith("start")
    )
    repeated = sum(starts.values()) - len(runs)
    assert repeated <= 3, "only the steps in flight at the kill ran again"
    assert set(starts) == set(runs)


@pytest.mark.slow
def test_a_run_a_stopping_worker_process_lets_go_is_taken_by_another_at_once(
    target: Target, tmp_path: Path
) -> None:
    """The stopping worker still drives another run, so its process lives on and its
    lease is fresh: only its beat at the let-go frees the run for the other worker
    before its next regular beat (a third of a 60 s lease; the test waits at most 10)."""
    side, log = tmp_path / "side.txt", tmp_path / "workers.log"
    released_hold, busy_hold = tmp_path / "released.hold", tmp_path / "busy.hold"
    side.touch()
    released_hold.touch()
    busy_hold.touch()
    environment = _environment(target, side)
    engine = _engine(target)
    with mock.patch.dict(os.environ, environment):
        released = engine.enqueue(
            "queued_job",
            {"seconds": 0.0, "hold": str(released_hold)},
            key="released",
            queue="capped",
        ).id
        busy = engine.enqueue(
            "queued_job", {"seconds": 0.0, "hold": str(busy_hold)}, key="busy", queue="capped"
        ).id
        first = _worker(target, environment, log, lease=60.0, grace=0.2)
        deadline = time.monotonic() + 60
        while side.read_text().count("start") < 2:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        second = _worker(target, environment, log, lease=60.0, grace=0.2)
        first.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # past the grace: the drives are released at their next step
        released_hold.unlink()
        try:
            assert engine.handle(released).wait(timeout=10).status is Status.COMPLETED
            assert first.poll() is None, "the stopping worker still drives the other run"
            busy_hold.unlink()
            assert first.wait(60) == 0, log.read_text()[-3000:]  # its last run released
            # ... and back on its queue, for the worker still running to take.
            assert engine.handle(busy).wait(timeout=60).status is Status.COMPLETED
            _stop([second], log)
        finally:
            busy_hold.unlink(missing_ok=True)
            for worker in (first, second):
                if worker.poll() is None:  # a failed assertion above: do not leave it
                    worker.kill()
                    worker.wait(30)
        _check_journals(engine, [released, busy])
