"""The PostgreSQL server crashes (`pg_ctl stop -m immediate`) mid-append and comes
back: no acknowledged append is lost, and every run is found and finished by
`recover()`, none left stranded half-way (the reports of runs stuck PENDING after a
database outage in DBOS Transact, dbos-transact-py#716, #804 and #805)."""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from loom_kernel import Engine, Status, StoreUnavailableError, open_store
from loom_kernel.events import StepCompleted, decode_events
from loom_kernel.spi import JournalStore, NewRecord
from loom_store_postgres.testing import PostgresServer, find_programs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        find_programs() is None,
        reason="SKIPPED LOUDLY: PostgreSQL is not installed; run scripts/install-postgres",
    ),
]

WORKER = Path(__file__).parent / "journal_worker.py"


@pytest.fixture
def server() -> Iterator[PostgresServer]:
    """A cluster of the test's own: the test stops and starts it."""
    with PostgresServer() as cluster:
        yield cluster


def _append_until_refused(
    store: JournalStore, stream: str, acknowledged: dict[str, int], stop: threading.Event
) -> None:
    head = 0
    while not stop.is_set():
        try:
            head = store.append(stream, head, [NewRecord("n", str(head + 1).encode(), 1.0)])
        except StoreUnavailableError:
            return  # the server went away: this append may or may not have landed
        acknowledged[stream] = head


def test_an_acknowledged_append_survives_the_server_crashing_mid_append(
    server: PostgresServer,
) -> None:
    store = server.store(schema="crash", pool_max=8, timeout=2)
    acknowledged: dict[str, int] = {}
    stop = threading.Event()
    writers = [
        threading.Thread(target=_append_until_refused, args=(store, f"w/{n}", acknowledged, stop))
        for n in range(8)
    ]
    for writer in writers:
        writer.start()
    deadline = time.monotonic() + 30
    while sum(acknowledged.values()) < 400 and time.monotonic() < deadline:
        time.sleep(0.005)
    server.stop_immediately()  # mid-append: eight writers with a statement in flight
    stop.set()
    for writer in writers:
        writer.join(timeout=30)
    store.close()
    server.start()
    reopened = server.store(schema="crash")
    for n in range(8):
        stream = f"w/{n}"
        records = reopened.read(stream)
        head = reopened.head(stream)
        # Every acknowledged append is there; one more may have landed unacknowledged.
        assert acknowledged.get(stream, 0) <= head <= acknowledged.get(stream, 0) + 1
        assert [r.position for r in records] == list(range(1, head + 1))
        assert [r.payload for r in records] == [str(p).encode() for p in range(1, head + 1)]
    assert sum(acknowledged.values()) >= 400
    # The store goes on at the head it left: the next append lands exactly once.
    assert reopened.append("w/0", reopened.head("w/0"), [NewRecord("n", b"after", 2.0)])
    reopened.close()


def _lines(side: Path) -> int:
    return side.read_bytes().count(b"\n") if side.exists() else 0


def _wait_for_effects(side: Path, goal: int, worker: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while worker.poll() is None and _lines(side) < goal and time.monotonic() < deadline:
        time.sleep(0.001)


def test_every_run_is_finished_after_server_crashes_and_a_killed_worker(
    server: PostgresServer, tmp_path: Path
) -> None:
    """Workers run 20 five-step runs while the server crashes three times; in one of
    the outages the worker is SIGKILLed too, leaving its runs half-way with no owner.
    A new worker's `recover()` finds every one: all complete, each step journaled once."""
    url = server.store_url(schema="runs", timeout=2)
    open_store(url).close()
    side = tmp_path / "side-effects.txt"
    executions, steps = 20, 5
    rng = random.Random(20261207)

    def worker() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(WORKER), "crash", url, str(side), str(executions), str(steps)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ),
        )

    running = worker()
    for outage in range(3):
        _wait_for_effects(side, _lines(side) + rng.randint(5, 15), running)
        server.stop_immediately()
        time.sleep(rng.uniform(0.2, 1.0))
        if outage == 1:
            running.kill()  # stranded: runs half-way, their owner gone
            running.wait()
        server.start()
        if outage == 1:
            running = worker()
    _out, err = running.communicate(timeout=300)
    assert running.returncode == 0, err.decode()

    store = open_store(url)
    engine = Engine(store, [])
    listed = engine.runs()  # the run index agrees: none left open, none missing
    assert sorted(run.id for run in listed) == sorted(f"job-{n}" for n in range(executions))
    assert {run.status for run in listed} == {Status.COMPLETED}
    for number in range(executions):
        execution_id = f"job-{number}"
        assert engine.get(execution_id).status is Status.COMPLETED, execution_id
        events = decode_events(store.read(f"ex/{execution_id}"))
        indices = [e.index for e in events if isinstance(e, StepCompleted)]
        assert sorted(indices) == list(range(steps)), f"{execution_id}: steps {indices}"
    effects = collections.Counter(side.read_text().splitlines())
    assert {f"job-{n}:{i}" for n in range(executions) for i in range(steps)} <= set(effects)
    store.close()
