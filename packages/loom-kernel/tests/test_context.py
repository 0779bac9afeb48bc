"""What a flow's ctx tells it: its input, the position the next step takes (the same on
every run), and the values it records (now, random, uuid, patched), journaled as steps
taken at the first attempt."""

from __future__ import annotations

from typing import Any

import pytest
from loom_kernel import Context, flow
from loom_kernel.testing import sandbox

pytestmark = pytest.mark.usefixtures("flow_loop")


def test_ctx_input_is_the_runs_input() -> None:
    @flow(name="echo_input", version="1")
    def echo_input(ctx: Context, _input: Any) -> Any:
        return ctx.input

    box = sandbox(echo_input)
    assert box.engine.start("echo_input", {"a": [1, 2]}).result == {"a": [1, 2]}


def test_ctx_position_is_the_index_the_next_step_takes_on_every_run() -> None:
    seen: list[list[int]] = []

    @flow(name="positions", version="1")
    def positions(ctx: Context, _input: Any) -> Any:
        at = [ctx.position]
        ctx.step("one", lambda: 1)
        at.append(ctx.position)
        ctx.step("two", lambda: 2)
        at.append(ctx.position)
        seen.append(at)
        ctx.suspend("go")
        return at

    box = sandbox(positions, listeners=[])
    box.engine.start("positions", key="p")
    assert box.engine.resume("p").result == [0, 1, 2]
    assert seen == [[0, 1, 2], [0, 1, 2]], "the same on the replay"


def test_a_recorded_value_is_journaled_as_taken_at_the_first_attempt() -> None:
    from loom_kernel.events import StepCompleted

    @flow(name="records_values", version="1")
    def records_values(ctx: Context, _input: Any) -> Any:
        return [ctx.now(), ctx.random(), ctx.uuid(), ctx.patched("p")]

    box = sandbox(records_values, listeners=[])
    box.engine.start("records_values", key="r")
    steps = [e.event for e in box.engine.history("r") if isinstance(e.event, StepCompleted)]
    assert [(step.name, step.attempts) for step in steps] == [
        ("loom.now", 1),
        ("loom.random", 1),
        ("loom.uuid", 1),
        (steps[3].name, 1),
    ]
