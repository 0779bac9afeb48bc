"""Enqueue and a worker's slots: an enqueued run is journaled, not driven inline, and
handed at once to a free slot of this engine's workers (with no claim), or waits as the
engine's own while every slot is busy and is let go to any worker once it waits too
long; a start no worker can take runs inline; and what enqueue reserved is given back
when nothing is handed over."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from loom_kernel import (
    Context,
    Engine,
    MemoryStore,
    ResultTimeoutError,
    RunHandle,
    Status,
    StoreUnavailableError,
    Worker,
    flow,
)
from loom_kernel._coordination import driving_here, partition_of
from loom_kernel._engine import parts_of
from loom_kernel.events import ExecutionClaimed, ExecutionStarted
from worker_helpers import FLOWS, _claims, _driven, _engine, at_gate, effects, gate

pytestmark = pytest.mark.usefixtures("fresh_effects")


def test_enqueue_journals_a_run_no_one_drives_until_a_worker_does() -> None:
    store = MemoryStore()
    engine = _engine(store)
    handle = engine.enqueue("three", "a", key="a")
    assert isinstance(handle, RunHandle)
    view = engine.get("a")
    assert (view.status, view.owner, view.position) == (Status.RUNNING, None, 1)
    assert not effects, "nothing ran inline"
    with pytest.raises(ResultTimeoutError, match="still running"):
        handle.result(timeout=0.05)
    with Worker(_engine(store), idle_poll=0.05):
        assert handle.result(timeout=10) == ["a:0", "a:1", "a:2"]
    assert effects == Counter({"a:0": 1, "a:1": 1, "a:2": 1})
    assert engine.enqueue("three", "a", key="a") == handle, "the same key, the same run"
    assert engine.get("a").position == view.position + 5  # claim, 3 steps, end


def test_an_enqueue_on_the_workers_own_engine_wakes_it_at_once() -> None:
    engine = _engine(MemoryStore())
    with Worker(engine, idle_poll=60.0):
        time.sleep(0.2)  # the worker is idle: its next poll is a minute away
        started = time.monotonic()
        assert engine.enqueue("three", "b").result(timeout=10) == ["b:0", "b:1", "b:2"]
        assert time.monotonic() - started < 30


def test_an_enqueue_that_no_slot_takes_wakes_the_engines_workers() -> None:
    engine = _engine(MemoryStore())
    worker = Worker(engine)  # registered, but with no pool: it takes no hand-over
    parts_of(engine).enqueueing.slots.append(worker._slots)
    assert not worker._wake.is_set()
    engine.enqueue("three", "x", key="x")
    assert worker._wake.is_set(), "its next poll comes now, not after idle_poll"


def test_an_enqueue_beside_a_free_slot_is_handed_to_it_and_driven_with_no_claim() -> None:
    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, idle_poll=60.0) as worker:
        time.sleep(0.1)  # idle: its next poll is a minute away
        handle = engine.enqueue("three", "h", key="h")
        assert handle.result(timeout=10) == ["h:0", "h:1", "h:2"]
        assert _driven(worker, 1) == 1
    events = [entry.event for entry in engine.history("h")]
    assert not any(isinstance(event, ExecutionClaimed) for event in events)
    assert isinstance(events[0], ExecutionStarted)
    assert events[0].by == engine.worker_id, "started as the engine's own, as start does"
    assert effects == Counter({"h:0": 1, "h:1": 1, "h:2": 1})


def test_an_enqueue_goes_to_a_free_slot_of_a_second_worker_before_a_queue() -> None:
    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, concurrency=1, idle_poll=60.0) as first:
        busy = engine.enqueue("slow", "b", key="busy")  # the first worker's only slot
        assert first.stats.in_flight == 1
        with Worker(engine, concurrency=1, idle_poll=60.0) as second:
            handle = engine.enqueue("three", "f", key="free")
            assert handle.result(timeout=10) == ["f:0", "f:1", "f:2"]
            assert _driven(second, 1) == 1
            assert not first._slots._handed
        gate.set()
        busy.result(timeout=10)


def test_enqueues_while_every_slot_is_busy_wait_as_the_engines_own_and_need_no_claim() -> None:
    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, concurrency=1, idle_poll=0.02) as worker:
        busy = engine.enqueue("slow", "b", key="busy")  # takes the only slot
        waiting = [engine.enqueue("three", f"w{i}", key=f"w{i}") for i in range(3)]
        assert all(engine.get(f"w{i}").owner == engine.worker_id for i in range(3))
        gate.set()
        assert [handle.result(timeout=10) for handle in waiting] == [
            [f"w{i}:0", f"w{i}:1", f"w{i}:2"] for i in range(3)
        ]
        busy.result(timeout=10)
        assert _driven(worker, 4) == 4
    assert [_claims(engine, f"w{i}") for i in range(3)] == [0, 0, 0]


def test_enqueues_past_the_workers_own_queue_start_unowned_for_any_worker() -> None:
    from loom_kernel._hosting._slots import _HANDED_PER_SLOT

    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, concurrency=1, idle_poll=60.0):
        busy = engine.enqueue("slow", "b", key="busy")
        count = _HANDED_PER_SLOT + 2
        handles = [engine.enqueue("three", f"n{i}", key=f"n{i}") for i in range(count)]
        owners = [engine.get(f"n{i}").owner for i in range(count)]
        assert owners == [engine.worker_id] * _HANDED_PER_SLOT + [None] * 2
        gate.set()
        for i, handle in enumerate(handles):
            assert handle.result(timeout=10) == [f"n{i}:0", f"n{i}:1", f"n{i}:2"]
        busy.result(timeout=10)


# -- let go after waiting too long -----------------------------------------------------


def test_an_enqueue_waiting_too_long_for_a_busy_slot_is_let_go_to_any_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("loom_kernel._hosting._slots._HANDED_WAIT", 0.2)
    store = MemoryStore()
    engine = _engine(store, lease=600.0)  # taken over at once, not a lease later
    with Worker(engine, concurrency=1, idle_poll=60.0) as worker:
        busy = engine.enqueue("slow", "b", key="busy")  # takes the only slot
        queued = [engine.enqueue("three", f"q{i}", key=f"q{i}") for i in range(3)]
        assert {engine.get(f"q{i}").owner for i in range(3)} == {engine.worker_id}
        with Worker(_engine(store, lease=600.0), idle_poll=0.02):  # another process's
            assert [handle.result(timeout=10) for handle in queued] == [
                [f"q{i}:0", f"q{i}:1", f"q{i}:2"] for i in range(3)
            ]
        gate.set()
        busy.result(timeout=10)
        assert _driven(worker, 1) == 1
    assert [_claims(engine, f"q{i}") for i in range(3)] == [1, 1, 1]
    assert [effects[f"q{i}:0"] for i in range(3)] == [1, 1, 1]


def test_a_let_go_enqueue_is_taken_by_another_machine_at_once_not_a_lease_later(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's beat at the let-go is all another machine's worker goes by: it must
    no longer list the runs let go (in one process, the engines also see it directly)."""
    monkeypatch.setattr("loom_kernel._hosting._slots._HANDED_WAIT", 0.2)
    store = MemoryStore()
    remote = "other-host.1:4242:abcdef"  # not this process: only its beats tell
    engine = _engine(store, lease=600.0, worker_id=remote)
    with Worker(engine, concurrency=1, idle_poll=60.0):
        busy = engine.enqueue("slow", "b", key="busy")  # takes the only slot
        queued = engine.enqueue("three", "q", key="q")
        assert engine.get("q").owner == remote
        taker = _engine(store, lease=600.0)
        with caplog.at_level("DEBUG", logger="loom"), Worker(taker, idle_poll=0.02):
            assert queued.result(timeout=5) == ["q:0", "q:1", "q:2"]
        gate.set()
        busy.result(timeout=10)
    claims = [e for e in (x.event for x in engine.history("q")) if isinstance(e, ExecutionClaimed)]
    assert [claim.by for claim in claims] == [taker.worker_id], "taken while the slot was busy"
    seen = re.findall(r"busy is running on \S+ \(seen (\S+) s ago\): left to it", caplog.text)
    assert seen, "the busy run was left to its owner"
    assert all(0 <= float(ago) < 5 for ago in seen), "seen moments ago"
    assert effects["q:0"] == 1


def test_a_let_go_enqueue_is_taken_back_by_its_own_worker_once_a_slot_frees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("loom_kernel._hosting._slots._HANDED_WAIT", 0.1)
    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, concurrency=1, idle_poll=0.02) as worker:
        busy = engine.enqueue("slow", "b", key="busy")
        queued = engine.enqueue("three", "q", key="queued")
        deadline = time.monotonic() + 10
        while worker._slots._handed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not worker._slots._handed, "let go after the wait"
        gate.set()
        assert queued.result(timeout=10) == ["q:0", "q:1", "q:2"]
        busy.result(timeout=10)
    claims = [
        e for e in (x.event for x in engine.history("queued")) if isinstance(e, ExecutionClaimed)
    ]
    assert [(claim.by, claim.previous) for claim in claims] == [(engine.worker_id,) * 2]


def test_a_beat_that_fails_as_enqueues_are_let_go_is_counted_and_the_nudges_still_written(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sys

    monkeypatch.setattr("loom_kernel._hosting._slots._HANDED_WAIT", 0.1)
    store = MemoryStore()
    engine = _engine(store, lease=600.0)
    heartbeat = parts_of(engine).driver.heartbeat
    beat = heartbeat.beat

    def failing_as_it_lets_go() -> None:
        if sys._getframe(1).f_code.co_name == "let_go_handed":
            raise StoreUnavailableError("the beats cannot be written")
        beat()

    monkeypatch.setattr(heartbeat, "beat", failing_as_it_lets_go)
    with Worker(engine, concurrency=1, idle_poll=60.0) as worker:
        busy = engine.enqueue("slow", "b", key="busy")  # takes the only slot
        queued = engine.enqueue("three", "q", key="q")
        said = "a beat letting runs go: StoreUnavailableError"

        def nudged() -> bool:
            index = store.read(f"runs/open/{partition_of('q')}")
            return any(b'"nudge"' in record.payload for record in index)

        with caplog.at_level(logging.WARNING, logger="loom"):
            deadline = time.monotonic() + 10
            # Taken off the backlog first, then let go, beaten for and nudged.
            while (worker._slots._handed or not nudged()) and time.monotonic() < deadline:
                time.sleep(0.01)
        assert not worker._slots._handed, "let go after the wait"
        assert said in caplog.text
        assert worker.stats.failures == 1
        assert nudged(), "the nudge written all the same"
        gate.set()
        assert queued.result(timeout=10) == ["q:0", "q:1", "q:2"]
        busy.result(timeout=10)


# -- starts handed over or run inline --------------------------------------------------


def test_a_start_handed_to_workers_with_no_slot_and_no_place_runs_inline() -> None:
    """A worker running, but its slot busy and its queue of handed runs full: the run
    `_start_or_hand` starts is driven inline, on the caller's thread, before it returns."""
    from loom_kernel._hosting._slots import _HANDED_PER_SLOT

    threads: dict[str, str] = {}

    @flow(name="where", version="1")
    def where(ctx: Context, tag: str) -> Any:
        return ctx.step("s", lambda: threads.setdefault(tag, threading.current_thread().name))

    store = MemoryStore()
    engine = Engine(store, [*FLOWS, where], listeners=[])
    with Worker(engine, concurrency=1, idle_poll=0.05) as worker:
        busy = engine.enqueue("slow", "busy")
        assert at_gate.wait(10)
        queued = [engine.enqueue("three", f"q{n}") for n in range(_HANDED_PER_SLOT)]
        assert len(worker._slots._handed) == _HANDED_PER_SLOT, "its queue of handed runs is full"
        handle = engine.dispatch("where", "inline", key="inline")
        assert engine.get(handle.id).status is Status.COMPLETED, "driven before returning"
        assert threads == {"inline": threading.current_thread().name}
        late = engine.enqueue("three", "late")  # no slot, no place: left to the polls
        assert not driving_here(engine.worker_id, late.id), "nothing here holds it"
        gate.set()
        assert busy.result(timeout=10) == "busy:after"
        assert all(run.result(timeout=10)[0].startswith("q") for run in queued)
        assert late.result(timeout=10) == ["late:0", "late:1", "late:2"]


def test_a_start_handed_to_no_worker_runs_inline_and_one_taken_by_a_worker_does_not() -> None:
    """`_start_or_hand`, what orchestration's start_child uses: with no worker of this
    engine running, the run is driven inline before the call returns."""
    store = MemoryStore()
    engine = _engine(store)
    handle = engine.dispatch("three", "i", key="inline")
    assert engine.get(handle.id).status is Status.COMPLETED, "driven before returning"
    with Worker(engine, idle_poll=0.05):
        handed = engine.dispatch("three", "w", key="handed")
        assert handed.result(timeout=10) == ["w:0", "w:1", "w:2"]


# -- what enqueue reserved, given back -------------------------------------------------


def test_an_enqueue_that_fails_gives_its_slot_back() -> None:
    from loom_kernel import ExecutionNotFoundError

    store = MemoryStore()
    engine = _engine(store)
    store.delete("ex/gone")  # a deleted run's key can never start another
    with Worker(engine, concurrency=1, idle_poll=0.05) as worker:
        with pytest.raises(ExecutionNotFoundError):
            engine.enqueue("three", "g", key="gone")
        assert worker.stats.in_flight == 0
        assert engine.enqueue("three", "n", key="next").result(timeout=10) == ["n:0", "n:1", "n:2"]


def test_an_interrupt_as_a_run_is_handed_over_leaves_the_worker_whole() -> None:
    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, concurrency=1, idle_poll=0.02) as worker:
        original = worker._slots.hand

        def interrupted(*args: Any) -> bool:
            raise KeyboardInterrupt  # Ctrl-C as the hand-over begins

        worker._slots.hand = interrupted  # type: ignore[method-assign,assignment]
        with pytest.raises(KeyboardInterrupt):
            engine.enqueue("three", "x", key="x")
        worker._slots.hand = original  # type: ignore[method-assign]
        assert worker.stats.in_flight == 0
        assert engine.enqueue("three", "y", key="y").result(timeout=10) == ["y:0", "y:1", "y:2"]
        assert engine.handle("x").result(timeout=10) == ["x:0", "x:1", "x:2"], "found by a poll"


def test_a_handed_run_whose_drive_cannot_begin_is_let_go_and_found_by_a_poll() -> None:
    store = MemoryStore()
    engine = _engine(store)
    original = parts_of(engine).driver.locks.hold
    holds: list[str] = []

    @contextlib.contextmanager
    def hold(key: str, *, wait: float | None = None) -> Iterator[None]:
        holds.append(key)
        if holds.count("x") == 2:  # the enqueue's hold, then the handed drive's
            raise RuntimeError("the drive could not take the run's lock")
        with original(key, wait=wait):
            yield

    parts_of(engine).driver.locks.hold = hold  # type: ignore[method-assign]
    with Worker(engine, concurrency=1, idle_poll=0.02):
        handle = engine.enqueue("three", "x", key="x")
        assert handle.result(timeout=10) == ["x:0", "x:1", "x:2"], "let go, then polled"
    assert holds.count("x") >= 3


def test_an_enqueue_of_a_key_that_exists_gives_back_the_slot_it_reserved() -> None:
    """The slot `enqueue` reserved for a run whose key exists already (nothing to
    hand over) goes back: kept, one run of a one-slot worker would never be driven
    again."""
    engine = _engine(MemoryStore())
    with Worker(engine, concurrency=1, idle_poll=0.05) as worker:
        first = engine.enqueue("three", "a", key="k")
        assert first.result(timeout=10) == ["a:0", "a:1", "a:2"]
        deadline = time.monotonic() + 10
        while worker._slots._in_flight and time.monotonic() < deadline:
            time.sleep(0.005)  # its slot's thread is done with it
        again = engine.enqueue("three", "b", key="k")
        assert again.id == first.id
        assert worker._slots._in_flight == set(), "the slot went back"
        later = engine.enqueue("three", "c")
        assert later.result(timeout=10) == ["c:0", "c:1", "c:2"]


def test_an_enqueue_of_a_key_that_exists_with_every_slot_busy_gives_back_its_place() -> None:
    """With every slot busy, `enqueue` takes a place in the worker's queue; for a run
    whose key exists already (nothing to hand over) the place goes back: kept, the
    worker would count the run as waiting here and never look at it again."""
    engine = _engine(MemoryStore())
    with Worker(engine, concurrency=1, idle_poll=0.05) as worker:
        try:
            first = engine.enqueue("three", "a", key="k")
            assert first.result(timeout=10) == ["a:0", "a:1", "a:2"]
            busy = engine.enqueue("slow", "busy", key="busy")  # takes the only slot
            assert at_gate.wait(10)
            again = engine.enqueue("three", "b", key="k")
            assert again.id == first.id
            slots = worker._slots
            assert (slots._queued, slots._handed) == (set(), set()), "the place went back"
            assert not worker._slots.busy_with(first.id)
        finally:
            gate.set()
        busy.result(timeout=10)
