"""Wake-up chains of any length run in a loop, not on the call stack, within the call."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from loom_kernel import Context, Engine, MemoryStore, Status, flow
from loom_kernel.testing import FakeClock
from loom_orchestration import (
    ChildSpec,
    SupervisorEscalationError,
    await_child,
    await_children,
    supervise_children,
)


@flow
def quick(ctx: Context, value: int) -> int:
    return value


@flow
def broken(ctx: Context, _input: Any) -> Any:
    raise RuntimeError("always fails")


@pytest.fixture
def shallow_stack() -> Any:
    """A recursion limit a nested delivery per child would exceed, however the tests run."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(600)
    yield
    sys.setrecursionlimit(limit)


@pytest.mark.usefixtures("shallow_stack")
def test_awaiting_400_inline_children_completes_within_start() -> None:
    @flow
    def fan_out(ctx: Context, count: int) -> Any:
        return sum(await_children(ctx, [(quick, value) for value in range(count)]))

    engine = Engine(MemoryStore(), [fan_out, quick], clock=FakeClock())
    done = engine.start("fan_out", 400)
    assert done.status is Status.COMPLETED
    assert done.result == sum(range(400))


@pytest.mark.usefixtures("shallow_stack")
def test_a_supervisor_escalates_within_the_call_however_high_its_intensity() -> None:
    @flow
    def supervisor(ctx: Context, _input: Any) -> Any:
        return supervise_children(ctx, [ChildSpec("b", broken)], intensity=400, period=1e9)

    engine = Engine(MemoryStore(), [supervisor, broken], clock=FakeClock())
    failed = engine.start("supervisor", key="sup")
    assert failed.status is Status.FAILED
    assert failed.error is not None
    assert failed.error.type == SupervisorEscalationError.__module__ + ".SupervisorEscalationError"
    assert engine.get("sup/b@400").status is Status.FAILED


@flow
def approval(ctx: Context, _input: Any) -> Any:
    return ctx.suspend("approve")


def test_an_engine_built_with_no_listeners_still_wakes_an_awaiting_parent() -> None:
    @flow
    def parent(ctx: Context, _input: Any) -> Any:
        return await_child(ctx, approval)

    engine = Engine(MemoryStore(), [parent, approval], clock=FakeClock(), listeners=[])
    run = engine.start("parent", key="p")
    assert run.waiting_on == "child:p/c0"
    engine.resume("p/c0", "yes")
    assert engine.get("p").status is Status.COMPLETED
    assert engine.get("p").result == "yes"
