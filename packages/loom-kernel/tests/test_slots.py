"""A worker's slots, driven by hand (no worker, no poll loop): work submitted or kept
in the backlog for a free slot, slots reserved and handed runs by enqueue, and the
handed runs let go."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from loom_kernel import Engine, MemoryStore, StoreUnavailableError
from loom_kernel._engine import parts_of
from loom_kernel._hosting._slots import Slots, Task, WorkerStats
from loom_kernel._replay import Drive


def _drive_of(call: Callable[[], Any]) -> Callable[[], Drive[Any]]:
    """A slot task's drive that makes `call` and asks for no pass of async code."""

    def drive() -> Drive[Any]:
        return call()
        yield  # a generator, as a drive is

    return drive


_idle = _drive_of(lambda: None)  # a task that does nothing


def _engine() -> Engine:
    return Engine(MemoryStore(), listeners=[])


def _slots(engine: Engine, concurrency: int = 8) -> Slots:
    """The slots of a worker of `engine` (a Worker's default concurrency), not open."""
    parts = parts_of(engine)
    return Slots(parts, concurrency, WorkerStats(), threading.Event(), threading.Event())


def test_a_run_queued_for_a_slot_is_queued_once() -> None:
    slots = _slots(_engine(), concurrency=1)
    submitted: list[Any] = []

    class Pool:
        def submit(self, *args: Any) -> None:
            submitted.append(args)

    pool: Any = Pool()
    slots.open(pool, None)
    assert slots.submit(Task("a", _idle), queue=True)
    assert slots.submit(Task("b", _idle), queue=True)  # waits for the slot
    assert not slots.submit(Task("b", _idle), queue=True), "queued already"
    assert len(slots._backlog) == 1
    assert len(submitted) == 1
    assert slots.stats.in_flight == 1, "the stats count the run in its slot"
    slots.next_up([Task("c", _idle)])  # handed to the slot next, ahead of the backlog
    assert not slots.submit(Task("c", _idle), queue=True), "c is queued already"
    assert [task.execution_id for task in slots._backlog] == ["c", "b"]


def test_a_visit_that_raises_a_bug_is_logged_and_counted(caplog: Any) -> None:
    slots = _slots(_engine())

    def broken_visit() -> None:
        raise ZeroDivisionError("a bug")

    with caplog.at_level(logging.ERROR, logger="loom"):
        slots._work(Task("buggy", _drive_of(broken_visit)))
    assert slots.stats.failures == 1
    assert any("working on buggy failed" in record.getMessage() for record in caplog.records)


def test_a_visit_that_meets_a_store_fault_is_logged_counted_and_its_slot_freed(
    caplog: Any,
) -> None:
    slots = _slots(_engine())

    def faulty_visit() -> None:
        raise StoreUnavailableError("the store is away")

    slots._in_flight.add("faulty")
    slots.stats.in_flight = 1
    with caplog.at_level(logging.WARNING, logger="loom"):
        slots._work(Task("faulty", _drive_of(faulty_visit)))
    assert slots.stats.failures == 1
    assert (slots.stats.in_flight, slots._in_flight) == (0, set()), "its slot is free"
    assert any(
        "faulty: StoreUnavailableError: the store is away" in record.getMessage()
        for record in caplog.records
    )


def test_a_slot_given_back_takes_the_work_queued_meanwhile() -> None:
    ran = threading.Event()
    slots = _slots(_engine(), concurrency=1)
    with ThreadPoolExecutor(1) as pool:
        slots.open(pool, None)
        assert slots.reserve("reserved", queue=False)  # an enqueue about to start
        assert slots.submit(Task("found", _drive_of(ran.set)), queue=True)
        assert not ran.is_set(), "queued: the only slot is reserved"
        slots.unreserve("reserved")  # the key existed: nothing started
        assert ran.wait(5), "the freed slot took the queued work"


def test_a_task_a_freed_slot_takes_from_the_backlog_is_in_flight_while_it_runs() -> None:
    slots = _slots(_engine(), concurrency=1)
    seen: list[set[str]] = []
    slots._in_flight.add("first")
    slots._backlog.append(Task("queued", _drive_of(lambda: seen.append(set(slots._in_flight)))))
    slots._queued.add("queued")
    slots._work(Task("first", _idle))
    assert seen == [{"queued"}], "in flight while it runs: no second drive of it starts"
    assert (slots._in_flight, slots._queued, slots.stats.in_flight) == (set(), set(), 0)


def test_a_task_a_freed_slot_cannot_start_as_the_pool_shuts_down_is_let_go_not_counted() -> None:
    slots = _slots(_engine(), concurrency=1)
    let_go: list[str] = []

    class ShutDown:
        def submit(self, *_args: Any) -> None:
            raise RuntimeError("cannot schedule new futures after shutdown")

    slots.open(ShutDown(), None)  # type: ignore[arg-type]
    slots._in_flight.add("reserved")  # a slot taken for an enqueue that is given back
    slots._backlog.append(Task("next", _idle, lambda: let_go.append("next")))
    slots._queued.add("next")
    slots.unreserve("reserved")
    assert let_go == ["next"], "let go for another worker"
    assert slots._in_flight == set()
    assert slots.stats.in_flight == 0


def test_a_handed_run_let_go_whose_nudge_fails_is_counted_and_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """It is held by no one now: the sweeps find it; the failure is counted and logged."""
    engine = _engine()
    slots = _slots(engine)
    let_go: list[str] = []
    slots._backlog.append(Task("x", _idle, lambda: let_go.append("x"), "three", 0.0))

    def down(_execution_id: str, _flow: str) -> None:
        raise StoreUnavailableError("down")

    monkeypatch.setattr(parts_of(engine).driver.runs, "nudged", down)
    slots.let_go_handed()
    assert let_go == ["x"]
    assert slots.stats.failures == 1
    assert "loom: letting x go: down" in caplog.messages


def test_a_run_handed_over_as_its_slot_frees_is_not_left_marked_as_waiting() -> None:
    """`enqueue` reserved a place in the worker's queue (no slot free), and a slot
    freed before the run was handed over: it is driven at once, and nothing marks it
    as waiting for a slot afterwards (a mark left would keep this worker from taking
    the run again: a later hand-over, a poll's visit, a sweep's reaping)."""
    slots = _slots(_engine(), concurrency=1)

    class Inline:
        def submit(self, fn: Any, *args: Any) -> None:
            fn(*args)

    slots.open(Inline(), None)  # type: ignore[arg-type]
    slots._in_flight.add("busy")
    assert slots.reserve("handed", queue=True), "a place in its queue"
    assert slots._queued == {"handed"}
    slots._work(Task("busy", _idle))  # the slot frees before the hand-over
    driven: list[str] = []

    def drive() -> str:
        driven.append("handed")
        return "handed"

    assert slots.hand("handed", _drive_of(drive), lambda: None, "three")
    assert driven == ["handed"]
    assert (slots._in_flight, slots._queued, slots._handed) == (set(), set(), set())
    assert not slots.busy_with("handed")
    assert slots.reserve("handed", queue=False), "taken again when handed again"


def test_a_task_for_a_run_waiting_here_for_a_slot_is_refused_not_kept_twice() -> None:
    """A second task for a run already waiting in this worker's backlog (a poll's
    admission of a run a hand-over queued) is refused, so its caller gives its
    admission back; it is not kept, to drive the run twice."""
    slots = _slots(_engine(), concurrency=1)
    waiting = Task("r", _idle)
    slots._backlog.append(waiting)
    slots._queued.add("r")
    with ThreadPoolExecutor(1) as pool:
        slots.open(pool, None)
        assert slots.submit(Task("r", _idle), queue=True) is False
        assert list(slots._backlog) == [waiting]
        # Every slot busy: a visit (not to be queued) is refused, and not queued.
        slots._in_flight.add("busy")
        ran: list[str] = []
        assert slots.submit(Task("v", _drive_of(lambda: ran.append("v")))) is False
    assert (list(slots._backlog), ran, slots._queued) == ([waiting], [], {"r"})
