"""An async flow's ctx calls, on either loop: one made inside a step's function, from
another task than the flow's own or from a task left running after the pass is refused
and journals nothing; so is a step not yet started at a new gate, while a sleep that
woke is no unawaited call; a park inside a task group parks the run, set_event is no
gate, and a replay check stops at new work."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from async_helpers import instant
from loom_kernel import AsyncContext, Engine, InvalidArgumentError, MemoryStore, Status, flow
from loom_kernel.testing import FakeClock, sandbox

pytestmark = pytest.mark.usefixtures("flow_loop")


@pytest.mark.parametrize("call", ["suspend", "sleep", "set_event"])
def test_a_ctx_call_inside_an_async_step_function_is_refused_on_either_loop(call: str) -> None:
    @flow(name="loop.inside", version="1")
    async def inside(ctx: AsyncContext, _input: Any) -> Any:
        async def nested() -> None:
            if call == "suspend":
                await ctx.suspend("x")
            elif call == "sleep":
                await ctx.sleep(1)
            else:
                await ctx.set_event("k", 1)

        return await ctx.step("outer", nested)

    store = MemoryStore()
    with pytest.raises(InvalidArgumentError, match="inside the function of step 'outer'"):
        Engine(store, [inside], listeners=[]).start("loop.inside", None, key="i")
    assert [record[1] for record in store.read("ex/i")] == ["EXECUTION_STARTED"]


def test_a_ctx_call_inside_a_gathered_step_function_is_refused_as_inside_that_step() -> None:
    """The step's function runs in a task of gather's: the refusal names the step, not
    only "another task"."""

    @flow(name="loop.inside_gathered", version="1")
    async def inside_gathered(ctx: AsyncContext, _input: Any) -> Any:
        async def nested() -> None:
            await ctx.step("inner", instant)

        return await asyncio.gather(ctx.step("outer", nested), ctx.step("other", instant))

    store = MemoryStore()
    with pytest.raises(InvalidArgumentError, match="inside the function of step 'outer'"):
        Engine(store, [inside_gathered], listeners=[]).start("loop.inside_gathered", key="g")


@pytest.mark.parametrize("call", ["step", "gate"])
def test_a_ctx_call_from_a_task_left_running_after_the_pass_is_refused_on_either_loop(
    call: str,
) -> None:
    """A step, or a gate (a sleep), awaited by a task the flow left running is refused,
    and journals nothing after the run's end."""
    left: list[asyncio.Task[Any]] = []

    @flow(name="loop.leaves", version="1")
    async def leaves(ctx: AsyncContext, _input: Any) -> Any:
        async def later() -> Any:
            await asyncio.sleep(0.05)
            if call == "gate":
                return await ctx.sleep(1)
            return await ctx.step("late", instant)

        left.append(asyncio.ensure_future(later()))
        return "returned"

    store = MemoryStore()
    engine = Engine(store, [leaves], listeners=[])
    assert engine.start("loop.leaves", None, key="l").result == "returned"
    time.sleep(0.2)  # a shared loop goes on running the task
    assert [record[1] for record in store.read("ex/l")] == [
        "EXECUTION_STARTED",
        "EXECUTION_COMPLETED",
    ]
    task = left[0]
    if task.done() and not task.cancelled():  # a loop per drive cancelled it as it closed
        refused = getattr(task.exception(), "error", None)
        assert isinstance(refused, InvalidArgumentError), task.exception()
        assert "after the flow's pass ended" in str(refused)


def test_a_recorded_step_asked_for_from_another_task_is_refused_on_replay() -> None:
    import asyncio

    @flow(name="moved", version="1")
    async def recorded(ctx: AsyncContext, _input: Any) -> Any:
        first = await ctx.step("a", lambda: 1)
        return [first, await ctx.suspend("go")]

    @flow(name="moved", version="1")
    async def helper_task(ctx: AsyncContext, _input: Any) -> Any:
        async def helper() -> Any:
            return await ctx.step("a", lambda: 1)

        first = await asyncio.create_task(helper())
        return [first, await ctx.suspend("go")]

    box = sandbox(recorded)
    box.engine.start("moved", key="m")
    changed = Engine(box.store, [helper_task], listeners=[])
    with pytest.raises(InvalidArgumentError, match="another task than the flow's own"):
        changed.resume("m", "ok")


def test_a_sleep_awaited_in_a_task_of_its_own_is_refused_and_journals_nothing() -> None:
    import asyncio

    @flow(name="nap_in_a_task", version="1")
    async def nap_in_a_task(ctx: AsyncContext, _input: Any) -> Any:
        await asyncio.ensure_future(ctx.sleep(60))
        return "rested"

    box = sandbox(nap_in_a_task)
    with pytest.raises(InvalidArgumentError, match="another task than the flow's own"):
        box.engine.start("nap_in_a_task", key="t")
    assert [record.kind for record in box.store.read("ex/t")] == ["EXECUTION_STARTED"]
    assert box.store.streams("timers/") == []


@pytest.mark.parametrize("gate", ["suspend", "sleep"])
def test_a_step_not_yet_started_at_a_new_gate_is_refused_on_either_loop(gate: str) -> None:
    @flow(name="loop.unstarted", version="1")
    async def unstarted(ctx: AsyncContext, _input: Any) -> Any:
        task = asyncio.ensure_future(ctx.step("s", instant))
        await (ctx.suspend("x") if gate == "suspend" else ctx.sleep(60))
        return await task

    store = MemoryStore()
    with pytest.raises(InvalidArgumentError, match="never awaited before the flow parked"):
        Engine(store, [unstarted], listeners=[]).start("loop.unstarted", None, key="u")
    assert [record[1] for record in store.read("ex/u")] == ["EXECUTION_STARTED"]


def test_an_async_sleep_that_woke_is_not_taken_for_an_unawaited_call_at_the_next_gate() -> None:

    @flow(name="two_naps", version="1")
    async def two_naps(ctx: AsyncContext, _input: Any) -> Any:
        await ctx.sleep(30)
        await ctx.sleep(30)
        return "rested twice"

    clock = FakeClock()
    box = sandbox(two_naps, clock=clock)
    run = box.engine.start("two_naps")
    clock.advance(31)
    assert box.engine.fire_due_timers() == [run.id]
    assert box.engine.get(run.id).status is Status.SUSPENDED, "parked at the second nap"
    clock.advance(31)
    box.engine.fire_due_timers()
    assert box.engine.get(run.id).result == "rested twice"


def test_a_park_inside_a_task_group_parks_the_run_on_either_loop() -> None:
    @flow(name="loop.grouped", version="1")
    async def grouped(ctx: AsyncContext, _input: Any) -> Any:
        async with asyncio.TaskGroup() as group:
            group.create_task(ctx.step("a", instant))
        async with asyncio.TaskGroup():
            await ctx.sleep(60)
        return "woke"

    store = MemoryStore()
    parked = Engine(store, [grouped], listeners=[]).start("loop.grouped", None, key="g")
    assert parked.status is Status.SUSPENDED
    assert [record[1] for record in store.read("ex/g")][-1] == "EXECUTION_SUSPENDED"


def test_set_event_in_an_async_flow_publishes_on_either_loop() -> None:
    @flow(name="loop.publishes", version="1")
    async def publishes(ctx: AsyncContext, _input: Any) -> Any:
        await ctx.set_event("stage", "half")
        return await ctx.step("s", instant)

    engine = Engine(MemoryStore(), [publishes], listeners=[])
    assert engine.start("loop.publishes", None, key="p").result == "done"
    assert engine.get_event("p", "stage") == "half"


def test_a_set_event_beside_a_step_not_yet_started_is_no_gate_on_either_loop() -> None:
    """set_event parks nothing: a step the flow started but has not awaited yet is
    no reason to refuse it or to end the pass."""

    @flow(name="loop.publishes", version="1")
    async def publishes(ctx: AsyncContext, _input: Any) -> Any:
        task = asyncio.ensure_future(ctx.step("s", instant))
        await ctx.set_event("k", 1)
        return await task

    engine = Engine(MemoryStore(), [publishes], listeners=[])
    view = engine.start("loop.publishes", None, key="p")
    assert (view.status, view.result) == (Status.COMPLETED, "done")
    assert engine.get_event("p", "k") == 1


class Crash(BaseException):
    """Cuts a step short, as a process dying in it would."""


def test_a_replay_check_stops_at_new_work_on_either_loop() -> None:
    crash = [True]

    def second() -> str:
        if crash:
            crash.clear()
            raise Crash
        return "b"

    @flow(name="loop.checked", version="1")
    async def checked(ctx: AsyncContext, _input: Any) -> Any:
        first = await ctx.step("a", instant)
        task = asyncio.ensure_future(ctx.step("b", second))
        await asyncio.sleep(0)
        return [first, await task]

    store = MemoryStore()
    engine = Engine(store, [checked], listeners=[])
    with pytest.raises(InvalidArgumentError, match="cut short by Crash"):
        engine.start("loop.checked", None, key="c")
    journal = store.read("ex/c")
    assert [record[1] for record in journal] == ["EXECUTION_STARTED", "STEP_COMPLETED"]
    engine.replay_check("c")  # the history replays; it stops at step b, writing nothing
    assert store.read("ex/c") == journal
