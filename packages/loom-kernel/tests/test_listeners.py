"""Listeners: every queued delivery is made, even when one listener has a bug, and a
start returns the run as its listeners left it."""

from __future__ import annotations

from typing import Any

import pytest
from loom_kernel import Context, Engine, Execution, MemoryStore, Status, flow
from loom_kernel.testing import sandbox


@flow
def waits(ctx: Context, _input: Any) -> Any:
    return ctx.suspend("go")


def test_a_listener_bug_is_raised_after_every_queued_delivery_is_made() -> None:
    seen: list[tuple[str, str, str]] = []

    def resumer(engine: Engine, execution: Execution) -> None:
        seen.append(("resumer", execution.id, str(execution.status)))
        if execution.id == "second" and execution.status is Status.SUSPENDED:
            engine.resume("first", "hello")  # "first" completes: its delivery is queued

    def fragile(_engine: Engine, execution: Execution) -> None:
        seen.append(("fragile", execution.id, str(execution.status)))
        if execution.id == "second":
            raise ValueError("a listener bug")

    engine = Engine(MemoryStore(), [waits], listeners=[])
    engine.start("waits", key="first")  # parks before any listener is added
    engine.add_listener(resumer)
    engine.add_listener(fragile)
    with pytest.raises(ValueError, match="a listener bug"):
        engine.start("waits", key="second")
    assert ("resumer", "first", "completed") in seen
    assert ("fragile", "first", "completed") in seen, "the queued delivery was made"


@pytest.mark.usefixtures("flow_loop")
def test_start_returns_the_run_as_its_listeners_left_it() -> None:
    def approve_at_once(engine: Engine, execution: Any) -> None:
        if execution.status is Status.SUSPENDED and execution.waiting_on == "auto":
            engine.resume(execution.id, "yes")

    @flow(name="auto_approved", version="1")
    def auto_approved(ctx: Context, _input: Any) -> Any:
        return ctx.suspend("auto")

    box = sandbox(auto_approved, listeners=[approve_at_once])
    run = box.engine.start("auto_approved")
    assert (run.status, run.result) == (Status.COMPLETED, "yes")


def test_a_listener_bug_is_logged_with_its_traceback_as_it_happens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def fragile(_engine: Engine, _execution: Execution) -> None:
        raise ValueError("a listener bug")

    engine = Engine(MemoryStore(), [waits], listeners=[fragile])
    with caplog.at_level("ERROR", logger="loom"), pytest.raises(ValueError, match="bug"):
        engine.start("waits", key="k")
    (logged,) = [r for r in caplog.records if "failed" in r.getMessage()]
    assert "on 'k' failed" in logged.getMessage()
    assert logged.exc_info is not None, "the traceback is in the log"
