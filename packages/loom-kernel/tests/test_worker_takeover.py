"""A stopping worker lets go of what it holds: a run in flight is released at its next
step (a timer's wake and a visit not yet driving too) and another worker takes it at
once, not a lease later; the runs waiting for its slots or handed to it as it stops are
left to the next worker; and a run its owner is driving is never taken."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

import pytest
from loom_kernel import Context, Engine, MemoryStore, Status, StoreUnavailableError, Worker, flow
from loom_kernel._engine import parts_of
from loom_kernel.events import ExecutionClaimed
from worker_helpers import FLOWS, _claims, _driven, _effect, _engine, at_gate, effects, gate

pytestmark = pytest.mark.usefixtures("fresh_effects")


def test_a_stopping_worker_releases_its_run_and_another_takes_it_at_once() -> None:
    store = MemoryStore()
    first = _engine(store, lease=3600.0)  # a lease that would keep the run an hour
    handle = first.enqueue("slow", "s")
    worker = Worker(first, idle_poll=0.02).start()
    assert at_gate.wait(10), "the step is in flight (not merely claimed) when the stop comes"
    stopper = threading.Thread(target=worker.stop, kwargs={"grace": 0.0})
    stopper.start()
    assert worker._slots.released.wait(10)
    gate.set()  # the step in flight finishes; the next one is not started
    stopper.join(10)
    assert not stopper.is_alive()
    assert effects == Counter({"s:wait": 1})
    view = first.get(handle.id)
    assert view.status is Status.RUNNING
    with Worker(_engine(store, lease=3600.0), idle_poll=0.02):
        assert handle.result(timeout=10) == "s:after"
    assert effects == Counter({"s:wait": 1, "s:after": 1})


def test_a_run_released_at_a_stop_is_taken_by_a_running_worker_at_its_next_poll() -> None:
    # The other worker saw the run open (driven by the first) long before the stop:
    # with a lease of an hour its next sweep is half an hour away.
    store = MemoryStore()
    first = _engine(store, lease=3600.0)
    handle = first.enqueue("slow", "r")
    worker = Worker(first, idle_poll=0.02).start()
    assert at_gate.wait(10)
    other = Worker(_engine(store, lease=3600.0), idle_poll=0.02).start()
    try:
        deadline = time.monotonic() + 10
        while other.stats.visited == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # it has looked at the run, and left it to its owner
        assert other.stats.visited >= 1
        assert other.stats.driven == 0
        stopper = threading.Thread(target=worker.stop, kwargs={"grace": 0.0})
        stopper.start()
        assert worker._slots.released.wait(10)
        gate.set()
        stopper.join(10)
        # Not `status is RUNNING` here: the other worker may have finished it already.
        assert handle.result(timeout=10) == "r:after", "taken over at once"
        assert _driven(other, 1) == 1, "by the other worker: the stop left it running"
    finally:
        other.stop()
    assert effects == Counter({"r:wait": 1, "r:after": 1})


@flow(name="elsewhere", version="1")
def elsewhere(ctx: Context, _input: Any) -> Any:
    return ctx.step("s", lambda: "done")


def _stop_with_runs_released(worker: Worker, engine: Engine, runs: list[str]) -> None:
    """Stop `worker` as if `runs` were in flight when its grace ended: each is left
    running, owned by `engine` (their flow is one its engine lacks, so that its polls
    leave them alone)."""
    starter = Engine(engine.store, [elsewhere], listeners=[])
    for execution_id in runs:
        starter.enqueue("elsewhere", key=execution_id)  # no worker: nobody's
        driver = parts_of(starter).driver
        state = driver.checkout(execution_id)
        driver.append(state, [ExecutionClaimed(engine.worker_id, None)])  # this engine's
        assert engine.get(execution_id).owner == engine.worker_id
    worker._wind_down = lambda: setattr(worker, "_released_runs", runs)  # type: ignore[method-assign]
    worker.stop()


def test_the_nudges_of_a_stop_end_at_the_first_store_failure() -> None:
    store = MemoryStore()
    engine = _engine(store, lease=3600.0)
    worker = Worker(engine, idle_poll=0.02)
    calls: list[str] = []

    def down(execution_id: str, flow_name: str) -> None:
        calls.append(execution_id)
        raise StoreUnavailableError("the store went away at the stop")

    parts_of(engine).driver.runs.nudged = down  # type: ignore[method-assign,assignment]
    worker.start()
    _stop_with_runs_released(worker, engine, ["a", "b", "c"])
    assert calls == ["a"], "one failed call, not one per released run"
    assert worker._stopped.is_set()


def test_a_stop_whose_last_beat_fails_nudges_nothing_and_still_ends() -> None:
    store = MemoryStore()
    engine = _engine(store, lease=3600.0)
    worker = Worker(engine, idle_poll=0.02).start()
    nudged: list[str] = []
    parts_of(engine).driver.runs.nudged = lambda execution_id, _flow: nudged.append(execution_id)  # type: ignore[method-assign,assignment]

    def no_beat() -> None:
        raise StoreUnavailableError("the last beat cannot be written")

    parts_of(engine).driver.heartbeat.beat = no_beat  # type: ignore[method-assign]
    _stop_with_runs_released(worker, engine, ["a"])
    assert nudged == [], "the old beat still lists the run: a nudge would find it held"
    assert worker._stopped.is_set()


def test_a_released_run_whose_start_never_landed_is_not_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    engine = _engine(store, lease=3600.0)
    worker = Worker(engine, idle_poll=0.02).start()
    worker._wind_down = lambda: setattr(worker, "_released_runs", ["never"])  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="loom"):
        worker.stop()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_worker_does_not_take_a_run_its_owner_is_driving() -> None:
    store = MemoryStore()
    inline = _engine(store)
    result: list[Any] = []
    driver = threading.Thread(target=lambda: result.append(inline.start("slow", "t", key="t")))
    driver.start()
    with Worker(_engine(store), idle_poll=0.02) as worker:
        time.sleep(0.3)  # several polls and a sweep see the run open
        gate.set()
        driver.join(10)
        assert worker.stats.driven == 0
    assert result[0].status is Status.COMPLETED
    assert effects == Counter({"t:wait": 1, "t:after": 1})


def test_a_run_woken_by_a_timer_is_driven_in_the_pool_and_released_on_stop() -> None:
    """The wake of a timer is work like any other: the worker goes on polling while it
    drives, and a stop releases it at its next step."""

    def slow_effect(index: int) -> str:
        time.sleep(0.3)
        return _effect(f"nap:{index}")

    @flow(name="long_nap", version="1")
    def long_nap(ctx: Context, _input: Any) -> Any:
        ctx.sleep(0.05)
        for index in range(6):
            ctx.step(f"s{index}", lambda index=index: slow_effect(index))
        return "done"

    engine = Engine(MemoryStore(), [*FLOWS, long_nap], listeners=[])
    engine.start("long_nap", key="n")
    worker = Worker(engine, grace=0.1, idle_poll=0.02).start()
    deadline = time.monotonic() + 10
    while not effects and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.enqueue("three", "q").result(timeout=5) == ["q:0", "q:1", "q:2"]
    began = time.monotonic()
    worker.stop()
    assert time.monotonic() - began < 1.5, "released at its next step, not driven to its end"
    assert engine.get("n").status is Status.RUNNING


def test_a_timer_wake_released_before_its_first_step_journals_the_wake_and_no_step() -> None:
    woken = threading.Event()
    hold = threading.Event()

    @flow(name="wakes", version="1")
    def wakes(ctx: Context, _input: Any) -> Any:
        ctx.sleep(0.05)
        woken.set()
        hold.wait(10)  # released here, before the first step after the wake
        return ctx.step("after", lambda: _effect("after"))

    store = MemoryStore()
    engine = Engine(store, [*FLOWS, wakes], listeners=[])
    engine.start("wakes", key="w")
    worker = Worker(engine, grace=0.05, idle_poll=0.02).start()
    assert woken.wait(10)
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    time.sleep(0.2)  # the grace is over: the drive is released
    hold.set()
    stopper.join(10)
    assert "after" not in effects, "a released drive starts no step"
    kinds = [record.kind for record in store.read("ex/w")]
    assert kinds[-1] == "EXECUTION_RESUMED", "the wake landed; nothing after it"


def test_a_visit_that_has_not_started_driving_is_released_too() -> None:
    class SlowReads(MemoryStore):
        slow = False

        def _read(self, stream: str, after: int, limit: int | None) -> Any:
            if self.slow and stream.startswith("ex/"):
                time.sleep(0.4)  # a slow GET, while the visit loads the run
            return super()._read(stream, after, limit)

    store = SlowReads()
    engine = _engine(store)
    worker = Worker(engine, grace=0.0, idle_poll=0.02).start()
    store.slow = True
    _engine(store).enqueue("three", "late", key="late")  # from another process
    time.sleep(0.15)  # the visit is loading the run
    worker.stop()
    assert not effects, "no step started once the worker was released"
    assert engine.get("late").status is Status.RUNNING


def test_a_stopping_worker_lets_go_the_enqueues_waiting_for_its_slots_at_once() -> None:
    store = MemoryStore()
    engine = _engine(store, lease=600.0)  # taken over at once, not a lease later
    worker = Worker(engine, concurrency=1, idle_poll=60.0, grace=5.0).start()
    busy = engine.enqueue("slow", "b", key="busy")
    queued = engine.enqueue("three", "q", key="queued")
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    time.sleep(0.1)
    gate.set()  # the busy run ends within the grace; the waiting one is not started
    stopper.join(10)
    busy.result(timeout=10)
    assert engine.get("queued").status is Status.RUNNING
    assert effects["q:0"] == 0
    with Worker(_engine(store, lease=600.0), idle_poll=0.02):
        assert queued.result(timeout=10) == ["q:0", "q:1", "q:2"]
    assert _claims(engine, "queued") == 1


def test_a_stopping_worker_lets_its_queue_go_before_its_grace_not_after() -> None:
    store = MemoryStore()
    engine = _engine(store, lease=600.0)
    worker = Worker(engine, concurrency=1, idle_poll=60.0, grace=30.0).start()
    busy = engine.enqueue("slow", "b", key="busy")
    queued = engine.enqueue("three", "q", key="queued")
    with Worker(_engine(store, lease=600.0), idle_poll=0.02):
        stopper = threading.Thread(target=worker.stop)
        stopper.start()  # the busy run holds its slot through the grace
        assert queued.result(timeout=10) == ["q:0", "q:1", "q:2"]
        assert stopper.is_alive(), "taken over during the grace"
        gate.set()
        stopper.join(10)
    busy.result(timeout=10)


def test_a_run_handed_to_a_stopping_worker_is_left_to_the_next_one() -> None:
    store = MemoryStore()
    engine = _engine(store)
    worker = Worker(engine, idle_poll=0.02).start()
    time.sleep(0.05)
    original = worker._slots.hand

    def stopping_meanwhile(execution_id: str, drive: Any, let_go: Any, flow: str) -> bool:
        worker._stopping.set()  # stop() began between the slot and the hand-over
        return original(execution_id, drive, let_go, flow)

    worker._slots.hand = stopping_meanwhile  # type: ignore[method-assign]
    handle = engine.enqueue("three", "s", key="stopped")
    worker.stop()
    assert engine.get("stopped").status is Status.RUNNING
    with Worker(_engine(store), idle_poll=0.02):  # after the stopped one's last beat
        assert handle.result(timeout=10) == ["s:0", "s:1", "s:2"]
