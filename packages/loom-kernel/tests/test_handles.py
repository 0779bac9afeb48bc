"""Run handles (`_engine/_handles.py`): a handle to an invalid id is refused at once;
`result` raises for a run that failed or was cancelled, sees a run another engine
finishes, and wakes as soon as a drive of its own engine ends the run, sleeping
between its looks rather than spinning."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from loom_kernel import (
    Context,
    Engine,
    ExecutionEndedError,
    InvalidIdError,
    MemoryStore,
    Worker,
    flow,
)
from loom_kernel._engine import parts_of
from worker_helpers import _engine, at_gate, effects, gate

pytestmark = pytest.mark.usefixtures("fresh_effects")


@pytest.mark.usefixtures("flow_loop")
@pytest.mark.parametrize("bad", ["a//b", "../x", 7])
def test_a_handle_to_an_invalid_id_is_refused_at_once(bad: Any) -> None:
    engine = Engine(MemoryStore(), [], listeners=[])
    with pytest.raises(InvalidIdError):
        engine.handle(bad)


def test_a_failed_or_cancelled_run_raises_from_result() -> None:
    store = MemoryStore()
    engine = _engine(store)
    failed = engine.enqueue("broken")
    cancelled = engine.enqueue("three", "c")
    engine.cancel(cancelled.id, "changed my mind")
    with (
        Worker(_engine(store), idle_poll=0.05),
        pytest.raises(ExecutionEndedError, match="failed: ValueError: no") as caught,
    ):
        failed.result(timeout=10)
    assert (caught.value.status, caught.value.error_type) == ("failed", "ValueError")
    with pytest.raises(ExecutionEndedError, match="cancelled: changed my mind"):
        cancelled.result(timeout=0)
    assert not effects


def test_a_result_with_no_timeout_sees_a_run_another_engine_finishes() -> None:
    """Nothing in this engine says when another engine ends the run: with no timeout
    the handle still looks again, at growing pauses, and returns."""
    store = MemoryStore()
    waiting = _engine(store)
    handle = waiting.enqueue("slow", "o")
    results: list[Any] = []
    waiter = threading.Thread(target=lambda: results.append(handle.result()), daemon=True)
    waiter.start()
    with Worker(_engine(store), idle_poll=0.02):
        assert at_gate.wait(10)
        gate.set()
        waiter.join(10)
    assert results == ["o:after"]


def test_a_handle_wakes_when_a_drive_of_its_engine_ends_the_run_not_at_its_next_look(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("loom_kernel._engine._handles._FIRST_WAIT", 60.0)  # looks a minute apart
    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, idle_poll=0.02):
        handle = engine.enqueue("slow", "w", key="woken")
        threading.Timer(0.1, gate.set).start()
        assert handle.result(timeout=30) == "w:after"


def test_a_handle_does_not_wait_when_the_run_ended_between_its_look_and_its_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("loom_kernel._engine._handles._FIRST_WAIT", 60.0)  # looks a minute apart

    @flow(name="parks", version="1")
    def parks(ctx: Context, _input: Any) -> Any:
        return ctx.suspend("go")

    engine = Engine(MemoryStore(), [parks], listeners=[])
    engine.start("parks", key="p")
    driver = parts_of(engine).driver
    looked = driver.execution

    def look_then_finish(execution_id: str) -> Any:
        view = looked(execution_id)
        if not view.status.finished:
            engine.resume("p", "done")  # a drive of the engine ends it after the look
        return view

    waits: list[float | None] = []
    real_wait = driver._finishes.wait

    def wait(timeout: float | None = None) -> bool:
        waits.append(timeout)
        return real_wait(0)

    monkeypatch.setattr(driver, "execution", look_then_finish)
    monkeypatch.setattr(driver._finishes, "wait", wait)
    assert engine.handle("p").result(timeout=120) == "done"
    assert waits == [], "it waited for a finish that had already happened"


@pytest.mark.usefixtures("flow_loop")
def test_a_handle_waiting_on_a_run_driven_here_sleeps_between_its_looks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It sleeps until this engine ends a run (or its next look is due), not spins."""
    running, go = threading.Event(), threading.Event()

    def wait_for_go() -> bool:
        running.set()
        return go.wait(10)

    @flow(name="waits_for_go")
    def waits_for_go(ctx: Context, _input: Any) -> Any:
        return ctx.step("go", wait_for_go)

    engine = Engine(MemoryStore(), [waits_for_go], listeners=[])
    driver = threading.Thread(target=engine.start, args=("waits_for_go",), kwargs={"key": "w"})
    driver.start()
    try:
        assert running.wait(10)
        handle = engine.handle("w")
        looks = [0]
        real_get = engine.get

        def counted(execution_id: str) -> Any:
            looks[0] += 1
            return real_get(execution_id)

        monkeypatch.setattr(engine, "get", counted)
        threading.Timer(0.3, go.set).start()
        assert handle.result(timeout=10) is True
    finally:
        go.set()
        driver.join(10)
    assert looks[0] < 100, looks[0]
