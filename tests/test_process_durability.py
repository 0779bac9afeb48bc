"""Durability with real processes, on SQLite and on S3 (Ceph RGW): SIGKILL at random
moments, and racing workers."""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import itertools
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import attrs
import pytest
from loom_kernel import Engine, open_store
from loom_kernel.events import Status, StepCompleted, decode_events
from loom_store_postgres.testing import PostgresServer
from loom_store_s3.testing import S3Server
from process_targets import python_path

WORKER = Path(__file__).parent / "journal_worker.py"


@attrs.frozen
class _Target:
    """A store the workers share: its URL and the environment that reaches it."""

    url: str
    environment: dict[str, str]
    sqlite_file: Path | None = None


@pytest.fixture(params=["sqlite", "rgw", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> _Target:
    if request.param == "sqlite":
        db = tmp_path / "loom.db"
        open_store(f"sqlite://{db}").close()  # create the schema before any race
        return _Target(f"sqlite://{db}?timeout=30", {}, db)
    if request.param == "postgres":
        postgres: PostgresServer = request.getfixturevalue("postgres_server")
        url = postgres.store_url()
        open_store(url).close()  # create the schema before any race
        return _Target(url, {})
    server: S3Server = request.getfixturevalue("rgw_server")
    bucket = server.new_bucket()
    url = f"s3://{bucket}/durability?endpoint_url={server.endpoint_url}&shards=4"
    return _Target(url, server.environment())


def _worker(
    mode: str, target: _Target, side: Path, executions: int, steps: int
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, target.url, str(side), str(executions), str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **target.environment},
    )


def _check_journals(target: _Target, executions: int, steps: int, gate: bool) -> None:
    with mock.patch.dict(os.environ, target.environment):
        store = open_store(target.url)
    engine = Engine(store, [])
    for number in range(executions):
        execution_id = f"job-{number}"
        assert engine.get(execution_id).status is Status.COMPLETED, execution_id
        records = store.read(f"ex/{execution_id}")
        assert [r.position for r in records] == list(range(1, len(records) + 1))
        events = decode_events(records)
        kinds = collections.Counter(type(e).__name__ for e in events)
        assert kinds["ExecutionStarted"] == 1
        assert kinds["ExecutionCompleted"] == 1
        indices = [e.index for e in events if isinstance(e, StepCompleted)]
        expected_steps = steps + (1 if gate else 0)
        assert sorted(indices) == list(range(expected_steps)), f"{execution_id}: steps {indices}"
        assert kinds["ExecutionResumed"] == (1 if gate else 0), f"{execution_id}: {kinds}"
    if target.sqlite_file is not None:
        with sqlite3.connect(target.sqlite_file) as connection:
            assert connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store.close()


def _side_effects(side: Path) -> collections.Counter[str]:
    return collections.Counter(side.read_text().splitlines())


def _lines(side: Path) -> int:
    return side.read_bytes().count(b"\n") if side.exists() else 0


def _kill_after_progress(
    worker: subprocess.Popen[bytes], side: Path, effects: int, rng: random.Random
) -> bool:
    """SIGKILL the worker once `effects` more step side effects have appended, then a
    random moment more, so the kill lands anywhere in a step's life (before its
    journal record, inside the transaction, after it); False if it finished first.

    Paced by the work itself, not by the clock, so a faster kernel or machine does not
    outrun the kills.
    """
    goal = _lines(side) + effects
    deadline = time.monotonic() + 300
    while worker.poll() is None and _lines(side) < goal and time.monotonic() < deadline:
        time.sleep(0.0002)  # yield the core to the worker; the random wait below spreads kills
    if rng.random() < 0.5:
        time.sleep(rng.uniform(0, 0.002))
    if worker.poll() is not None:
        return False
    worker.kill()  # SIGKILL: no cleanup, no flush, mid-transaction if it is in one
    worker.wait()
    return True


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_and_doubles_nothing(
    tmp_path: Path, target: _Target
) -> None:
    side = tmp_path / "side-effects.txt"
    executions, steps, kills = (40, 5, 12) if target.sqlite_file else (12, 4, 8)
    rng = random.Random(20261130)
    # Spread the kills over the work: each lets at most a share of the steps run.
    share = executions * steps // (kills + 1)
    killed_mid_work = 0
    for _ in range(kills):
        worker = _worker("crash", target, side, executions, steps)
        killed_mid_work += _kill_after_progress(worker, side, rng.randint(1, share), rng)
    final = _worker("crash", target, side, executions, steps)
    _out, err = final.communicate(timeout=300)
    assert final.returncode == 0, err.decode()
    assert killed_mid_work == kills, "a worker finished before it could be killed"
    _check_journals(target, executions, steps, gate=False)
    effects = _side_effects(side)
    for number in range(executions):
        for index in range(steps):
            assert effects[f"job-{number}:{index}"] >= 1, "every step ran at least once"


@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 4])
def test_racing_worker_processes_double_nothing(
    tmp_path: Path, target: _Target, workers: int
) -> None:
    side = tmp_path / "side-effects.txt"
    executions, steps = 15, 3
    running = [_worker("race", target, side, executions, steps) for _ in range(workers)]
    for worker in running:
        _out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err.decode()
    _check_journals(target, executions, steps, gate=True)


OWNERSHIP_WORKER = Path(__file__).parent / "ownership_worker.py"


def _slow_run_in_another_process(
    target: _Target, tmp_path: Path
) -> tuple[subprocess.Popen[str], Path, Path]:
    side, flag = tmp_path / "side.txt", tmp_path / "flag"
    flag.touch()
    worker = subprocess.Popen(
        [sys.executable, str(OWNERSHIP_WORKER), target.url, str(side), str(flag)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **target.environment, "PYTHONPATH": python_path(Path(__file__).parent)},
    )
    deadline = time.monotonic() + 60
    while not (side.exists() and side.read_text()) and time.monotonic() < deadline:
        assert worker.poll() is None, worker.stderr.read() if worker.stderr else ""
        time.sleep(0.02)
    assert side.read_text() == "slow\n", "the slow step is running in the other process"
    return worker, side, flag


def _engine_with(target: _Target, module: str, factory: str, *args: Any) -> Engine:
    """An engine on the target with the flow `factory(*args)` of the helper `module`
    beside these tests (the one the other processes run)."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        make = getattr(importlib.import_module(module), factory)
    finally:
        sys.path.pop(0)
    with mock.patch.dict(os.environ, target.environment):
        store = open_store(target.url)
    return Engine(store, [make(*args)], listeners=[])


def _engine_on(target: _Target, side: Path, flag: Path) -> Engine:
    return _engine_with(target, "ownership_flow", "slow_then_after", side, flag)


def test_recover_in_another_process_leaves_a_live_run_to_its_owner(
    target: _Target, tmp_path: Path
) -> None:
    worker, side, flag = _slow_run_in_another_process(target, tmp_path)
    try:
        engine = _engine_on(target, side, flag)
        with mock.patch.dict(os.environ, target.environment):
            assert engine.recover() == [], "its owner is alive: not taken over"
            view = engine.get("own")
        assert worker.stdout is not None
        owner = worker.stdout.readline().strip()
        assert (view.status, view.owner) == (Status.RUNNING, owner)
    finally:
        flag.unlink()
    assert worker.wait(60) == 0
    assert side.read_text() == "slow\n", "the step ran once"
    with mock.patch.dict(os.environ, target.environment):
        assert engine.get("own").status is Status.COMPLETED


def test_a_killed_owner_is_taken_over_at_once_on_its_machine(
    target: _Target, tmp_path: Path
) -> None:
    worker, side, flag = _slow_run_in_another_process(target, tmp_path)
    worker.kill()
    worker.wait(30)
    flag.unlink()
    engine = _engine_on(target, side, flag)
    with mock.patch.dict(os.environ, target.environment):
        assert engine.recover() == ["own"], "its process is gone: no lease to wait out"
        done = engine.get("own")
    assert (done.status, done.result) == (Status.COMPLETED, ["slow done", "after"])
    assert side.read_text() == "slow\nslow\n", "in flight at the kill: it ran again"


SOAK_FLOWS_DIR = Path(__file__).parent
SOAK_CONCURRENCY = 4


def _loom_worker(target: _Target, side: Path, log: Path) -> subprocess.Popen[bytes]:
    """`loom worker` on the soak flows, as a user would run it; it logs to `log`."""
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "loom_kernel", "worker", "--store", target.url),
            *("--flows", "soak_flows:FLOWS", "--concurrency", str(SOAK_CONCURRENCY)),
            *("--lease", "4", "--idle-poll", "0.2", "--grace", "10"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("ab"),
        env={
            **os.environ,
            **target.environment,
            "PYTHONPATH": python_path(SOAK_FLOWS_DIR),
            "LOOM_SOAK_SIDE": str(side),
        },
    )


def _soak_engine(target: _Target) -> Engine:
    sys.path.insert(0, str(SOAK_FLOWS_DIR))
    try:
        from soak_flows import FLOWS
    finally:
        sys.path.pop(0)
    with mock.patch.dict(os.environ, target.environment):
        store = open_store(target.url)
    return Engine(store, FLOWS)


def _wait_for(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _has_started(log: Path) -> bool:
    return "started" in log.read_text()


def _approve_gated(engine: Engine, waiting: set[str]) -> None:
    """Resume the runs of `waiting` that are parked at their gate (and forget them)."""
    from loom_kernel import ConflictError, NotSuspendedError

    for execution_id in sorted(waiting):
        with contextlib.suppress(ConflictError, NotSuspendedError):  # not there yet
            engine.resume(execution_id, "approved", key="approve", on="approve")
            waiting.discard(execution_id)


@pytest.mark.slow
@pytest.mark.parametrize("kills", [0, 5])
def test_worker_processes_killed_at_random_end_every_run_and_journal_no_step_twice(
    target: _Target, tmp_path: Path, kills: int
) -> None:
    """3 `loom worker` processes drive 200 runs (80 on RGW) with steps, timers, gates and
    children while workers are SIGKILLed (and replaced) at random: every run ends, no
    step is journaled twice, and a side effect repeats only for a step in flight at a
    kill (at most the concurrency per kill); with no kill, none repeats."""
    runs = 200 if target.url.startswith(("sqlite", "postgres")) else 80  # 200 took 100 s
    side = tmp_path / "side-effects.txt"
    side.touch()
    rng = random.Random(20261202 + kills)
    with mock.patch.dict(os.environ, {**target.environment, "LOOM_SOAK_SIDE": str(side)}):
        engine = _soak_engine(target)
        for number in range(runs):
            engine.enqueue("soak_job", number, key=f"job-{number}")
        logs = iter(tmp_path / f"worker-{number}.log" for number in range(100))
        workers = [(_loom_worker(target, side, log), log) for log in itertools.islice(logs, 3)]
        gated = {f"job-{number}" for number in range(0, runs, 5)}
        approved = threading.Event()

        def approve() -> None:
            while gated and not approved.wait(0.3):
                _approve_gated(engine, gated)

        approving = threading.Thread(target=approve)
        killed, expected_effects = 0, runs * 4 + len(range(0, runs, 4))
        deadline = time.monotonic() + 400
        try:
            approving.start()  # beside the kills, so slow approvals never delay one
            while time.monotonic() < deadline:
                lines = _side_effects(side)
                if all(lines[f"job-{number}:last"] for number in range(runs)):
                    break
                if (
                    kills
                    and killed < kills
                    and sum(lines.values()) >= (killed + 1) * expected_effects * 7 // (10 * kills)
                ):  # spread over the first 70% of the work, so every kill lands mid-work
                    victim, _log = workers.pop(rng.randrange(len(workers)))
                    time.sleep(rng.uniform(0, 0.05))
                    victim.kill()
                    victim.wait()
                    killed += 1
                    log = next(logs)
                    workers.append((_loom_worker(target, side, log), log))
                time.sleep(0.01)
            else:
                pytest.fail(f"not every run ended: {len(_side_effects(side))} effects")
        finally:
            approved.set()
            approving.join(60)
            for worker, log in workers:
                _wait_for(functools.partial(_has_started, log), 60)  # its handlers are set
                worker.terminate()  # SIGTERM: a graceful stop
            for worker, log in workers:
                assert worker.wait(60) == 0, log.read_text()
        assert killed == kills
        for number in range(runs):
            children = [child.id for child in engine.executions(f"job-{number}/")]
            assert len(children) == (1 if number % 4 == 0 else 0), children
            for execution_id in [f"job-{number}", *children]:
                view = engine.get(execution_id)
                assert view.status is Status.COMPLETED, (execution_id, view)
                events = [entry.event for entry in engine.history(execution_id)]
                indices = [e.index for e in events if isinstance(e, StepCompleted)]
                assert len(indices) == len(set(indices)), f"{execution_id}: a step journaled twice"
        repeats = sum(count - 1 for count in _side_effects(side).values())
        assert repeats <= kills * SOAK_CONCURRENCY, (
            f"{repeats} repeated side effects, {kills} kills"
        )
    if target.sqlite_file is not None:
        with sqlite3.connect(target.sqlite_file) as connection:
            assert connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_loom_worker_stops_gracefully_on_sigterm_and_at_once_on_a_second(
    tmp_path: Path,
) -> None:
    """A first SIGTERM lets the run in flight go on (within the grace period); a
    second one stops the worker at once, and the run is taken over as after a crash."""
    db = tmp_path / "loom.db"
    target = _Target(f"sqlite://{db}?timeout=30", {}, db)
    side, flag, log = tmp_path / "side.txt", tmp_path / "flag", tmp_path / "worker.log"
    flag.touch()
    engine = _soak_engine(target)
    with mock.patch.dict(os.environ, {"LOOM_SOAK_SIDE": str(side), "LOOM_SOAK_FLAG": str(flag)}):
        handle = engine.enqueue("soak_slow", key="slow")
        worker = _loom_worker(target, side, log)
        _wait_for(lambda: side.exists() and "slow:wait" in side.read_text(), 60)
        worker.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert worker.poll() is None, "the run in flight has its grace period"
        assert "stopping" in log.read_text()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 128 + signal.SIGTERM, log.read_text()
        flag.unlink()
        assert engine.recover() == ["slow"], "its process is gone: taken over at once"
        assert handle.result(timeout=30) == ["waited", "after"]
    assert _side_effects(side) == collections.Counter({"slow:wait": 2, "slow:after": 1}), (
        "the step in flight at the hard stop ran again, once"
    )


def test_loom_worker_exits_after_its_grace_though_a_thread_an_async_flow_left_runs(
    tmp_path: Path,
) -> None:
    """A thread an async flow started (asyncio.to_thread, its await cancelled by a
    timeout) and that never ends holds `loom worker`'s exit for the grace, not forever:
    the interpreter would wait for it at exit, so the command exits at once instead."""
    db = tmp_path / "loom.db"
    target = _Target(f"sqlite://{db}?timeout=30", {}, db)
    side, flag, log = tmp_path / "side.txt", tmp_path / "flag", tmp_path / "worker.log"
    flag.touch()  # the stray thread waits while it exists (up to 120 s)
    engine = _soak_engine(target)
    with mock.patch.dict(os.environ, {"LOOM_SOAK_FLAG": str(flag)}):
        worker = subprocess.Popen(
            [
                *(sys.executable, "-m", "loom_kernel", "worker", "--store", target.url),
                *("--flows", "soak_flows:FLOWS", "--idle-poll", "0.2", "--grace", "1"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=log.open("ab"),
            env={
                **os.environ,
                "PYTHONPATH": python_path(SOAK_FLOWS_DIR),
                "LOOM_SOAK_SIDE": str(side),
            },
        )
        try:
            handle = engine.enqueue("soak_strays", key="strays")
            assert handle.result(timeout=60) == "left"
            _wait_for(functools.partial(_has_started, log), 60)
            worker.terminate()
            assert worker.wait(30) == 0, log.read_text()
        finally:
            worker.kill()
            flag.unlink()
    assert "still run after 1.0 s" in log.read_text()
    assert "stopped" in log.read_text(), "its own stop ran to its end"
    assert _side_effects(side) == collections.Counter({"strays:stray": 1})


MESSAGE_PROCESS = Path(__file__).parent / "message_process.py"


def _message_process(target: _Target, side: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(MESSAGE_PROCESS), args[0], target.url, str(side), *args[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **target.environment, "PYTHONPATH": python_path(Path(__file__).parent)},
    )


def _inbox_engine(target: _Target, side: Path) -> Engine:
    return _engine_with(target, "message_flow", "consume", side)


def _consumed(engine: Engine) -> list[str]:
    """The messages the run `inbox` consumed, in its journal's order."""
    payloads = engine.state("inbox").resume_payloads
    positions = [p["position"] for p in payloads if isinstance(p, dict)]
    assert len(positions) == len(set(positions)), "an inbox message consumed twice"
    return [p["message"] for p in payloads if isinstance(p, dict)]


def test_sigkill_between_a_send_and_the_receive_loses_nothing(
    target: _Target, tmp_path: Path
) -> None:
    side = tmp_path / "side.txt"
    engine = _inbox_engine(target, side)
    with mock.patch.dict(os.environ, target.environment):
        engine.start("consume", 2, key="inbox")  # parked at its first receive
        sender = _message_process(target, side, "send-then-die", "m1")
        assert sender.wait(60) == -signal.SIGKILL
        assert engine.get("inbox").status is Status.SUSPENDED, "the sender died before the wake"
        assert engine.recover() == ["inbox"], "the message in the inbox wakes it"
        engine.send("inbox", "m1", key="m1")  # the sender's retry: a no-op
        engine.send("inbox", "m2", key="m2")
        done = engine.get("inbox")
        assert (done.status, done.result) == (Status.COMPLETED, ["m1", "m2"])
        assert _consumed(engine) == ["m1", "m2"]
    assert side.read_text() == "m1\nm2\n"


def test_sigkill_between_a_receive_and_the_next_step_delivers_nothing_twice(
    target: _Target, tmp_path: Path
) -> None:
    side = tmp_path / "side.txt"
    engine = _inbox_engine(target, side)
    with mock.patch.dict(os.environ, target.environment):
        engine.start("consume", 3, key="inbox")
        sender = _message_process(target, side, "send-and-drive-die-on", "m2")
        assert sender.wait(60) == -signal.SIGKILL
        assert engine.recover() == ["inbox"]
        engine.send("inbox", "m3", key="m3")  # the dead sender's last send: once only
        done = engine.get("inbox")
        assert (done.status, done.result) == (Status.COMPLETED, ["m1", "m2", "m3"])
        assert _consumed(engine) == ["m1", "m2", "m3"]
    assert side.read_text() == "m1\nm2\nm2\nm3\n", "only the step in flight at the kill ran twice"


def test_two_processes_sending_to_one_run_at_once_deliver_each_message_once(
    target: _Target, tmp_path: Path
) -> None:
    side = tmp_path / "side.txt"
    count = 15
    engine = _inbox_engine(target, side)
    with mock.patch.dict(os.environ, target.environment):
        engine.start("consume", 2 * count, key="inbox")
        senders = [_message_process(target, side, "sender", name, str(count)) for name in "ab"]
        Path(f"{side}.go").touch()
        for sender in senders:
            assert sender.wait(120) == 0, sender.stderr.read() if sender.stderr else ""
        engine.recover()  # nothing to do unless a wake was left to it
        done = engine.get("inbox")
        assert done.status is Status.COMPLETED
        received = _consumed(engine)
    assert sorted(received) == sorted(f"{name}-{index}" for name in "ab" for index in range(count))
    for name in "ab":
        assert [m for m in received if m.startswith(name)] == [f"{name}-{i}" for i in range(count)]
    assert sorted(side.read_text().split()) == sorted(received), "each step ran once"
