"""Chains with real processes, on SQLite and on S3 (Ceph RGW): `loom worker` processes
SIGKILLed at random while a process with no flow code sends keyed messages to a chain
whose runs each receive one and rotate, for a few hundred rotations. Every message is
received exactly once, in send order, one a run; one live run at the end."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
from loom_kernel import Engine, LoomError, open_store
from loom_orchestration import chain_runs, current_run, send_to_chain, start_chain
from loom_orchestration._chains._inbox import items
from loom_orchestration._chains._routing import FORWARD_KEY
from process_targets import Target, loom_worker, make_target, python_path

HERE = Path(__file__).parent


#: Rotations a test makes on each store: a worker on S3 polls once a second at most.
MESSAGES = {"sqlite": 300, "rgw": 60, "postgres": 120}


@pytest.fixture(params=["sqlite", "rgw", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    return make_target(request, tmp_path, "chains")


def _worker(target: Target, environment: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return loom_worker(target, environment, log, "chain_flows:FLOWS", concurrency=4)


def _received(engine: Engine, execution_id: str) -> list[int]:
    keys = {m.position: m.key for m in engine.inbox(execution_id)}
    found = []
    for resume_key in engine.state(execution_id).resume_keys:
        key = keys.get(int(resume_key.removeprefix("loom.inbox:")))
        if resume_key.startswith("loom.inbox:") and key and key.startswith(FORWARD_KEY):
            found.append(int(key.removeprefix(FORWARD_KEY)))
    return found


@pytest.mark.slow
def test_a_chain_under_sigkilled_workers_receives_each_message_once_in_order(
    target: Target, tmp_path: Path
) -> None:
    seed = random.randrange(2**32)
    chance = random.Random(seed)
    log = tmp_path / "workers.log"
    environment = {**os.environ, **target.environment, "PYTHONPATH": python_path(HERE)}
    with mock.patch.dict(os.environ, target.environment):
        store = open_store(target.url)
    web = Engine(store, [], listeners=[], worker_id="web")  # no flow code: starts by name
    start_chain(web, "c", "chain.step", {"count": 0, "last": None})
    workers = [_worker(target, environment, log) for _ in range(3)]
    sent: list[int] = []
    failures: list[BaseException] = []

    def send_all() -> None:
        try:
            for number in range(MESSAGES[target.kind]):
                while True:
                    try:
                        sent.append(send_to_chain(web, "c", number, topic="tick", key=f"k{number}"))
                        break
                    except LoomError:  # a store fault: the same key again is safe
                        time.sleep(0.1)
                time.sleep(chance.uniform(0.0, 0.1))
        except BaseException as exc:  # reported below
            failures.append(exc)

    sender = threading.Thread(target=send_all)
    sender.start()
    try:
        while sender.is_alive():
            time.sleep(chance.uniform(1.0, 4.0))
            alive = [worker for worker in workers if worker.poll() is None]
            victim = chance.choice(alive)
            victim.send_signal(signal.SIGKILL)
            victim.wait(30)
            workers = [worker for worker in workers if worker.poll() is None]
            while len(workers) < 3:
                workers.append(_worker(target, environment, log))
        sender.join()
        assert not failures, (seed, failures)
        deadline = time.monotonic() + 300
        while current_run(web, "c").id != f"c@{MESSAGES[target.kind] + 1}":
            assert time.monotonic() < deadline, (
                seed,
                current_run(web, "c"),
                log.read_text()[-3000:],
            )
            time.sleep(0.5)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.wait(60)

    runs = chain_runs(web, "c")
    assert [run.id for run in runs] == [f"c@{n}" for n in range(1, MESSAGES[target.kind] + 2)], seed
    assert [run.id for run in runs if not run.status.finished] == [runs[-1].id], seed
    positions = [item.position for item in items(store, "c")]
    assert sorted(sent) == positions, f"seed {seed}: one item a message"
    got = [_received(web, run.id) for run in runs]
    assert got[:-1] == [[p] for p in positions], f"seed {seed}: each once, in order, one a run"
    assert got[-1] == []
    assert runs[-1].input["carry"] == {
        "count": MESSAGES[target.kind],
        "last": MESSAGES[target.kind] - 1,
    }
