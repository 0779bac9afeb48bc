"""Orchestration across real processes on SQLite: SIGKILL at each point, and racing deliveries."""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from loom_kernel import Engine, open_store
from loom_kernel.events import ExecutionResumed, Status, decode_events

WORKER = Path(__file__).parent / "orchestration_worker.py"


def _run(db: Path, mode: str, crash_at: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(WORKER), str(db), mode, crash_at],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _check_once(db: Path) -> None:
    store = open_store(f"sqlite://{db}")
    engine = Engine(store, [])
    parent = engine.get("order-1")
    assert parent.status is Status.COMPLETED
    assert parent.result == {"receipt": {"charged": 10}, "shipping": "shipped"}
    assert store.streams("ex/order-1/") == ["ex/order-1/c0"], "exactly one child"
    events = decode_events(store.read("ex/order-1"))
    kinds = collections.Counter(type(e).__name__ for e in events)
    assert kinds["ExecutionCompleted"] == 1
    woken = [
        e
        for e in events
        if isinstance(e, ExecutionResumed) and (e.key or "").startswith("child:order-1/c0@")
    ]
    assert len(woken) == 1, "the parent was woken exactly once"
    store.close()


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", ["child-started", "child-completed", "parent-notified"])
def test_sigkill_at_each_point_leaves_one_child_and_one_completion(
    tmp_path: Path, crash_at: str
) -> None:
    db = tmp_path / "loom.db"
    crashed = _run(db, "start", crash_at)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    recovered = _run(db, "recover")
    assert recovered.returncode == 0, recovered.stderr
    _check_once(db)


@pytest.mark.slow
def test_child_finished_by_another_process_while_a_third_recovers(tmp_path: Path) -> None:
    db = tmp_path / "loom.db"
    assert _run(db, "start", "gated").returncode == 0  # the parent parks; the child waits
    racers = [
        subprocess.Popen([sys.executable, str(WORKER), str(db), mode, "gated"])
        for mode in ("resume-child", "recover", "recover")
    ]
    for racer in racers:
        assert racer.wait(timeout=120) == 0
    _check_once(db)
