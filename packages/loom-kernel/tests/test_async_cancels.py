"""Timeouts and cancels in async flows, on either loop (a loop per drive, or one loop of
another thread): a timeout or a cancel that lands while a step runs never cuts the step
short; it is held back to the flow's next await with its message, lands nowhere once
its block was left, and a flow that survives a cancel of its own task goes on."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from async_helpers import _slow_step
from loom_kernel import AsyncContext, Engine, MemoryStore, flow
from loom_kernel.testing import sandbox

pytestmark = pytest.mark.usefixtures("flow_loop")


def test_a_timeout_around_a_sync_step_changes_nothing_on_either_loop() -> None:
    ran: list[str] = []

    def slow() -> str:
        ran.append("slow")
        time.sleep(0.15)
        return "done"

    @flow(name="loop.timed", version="1")
    async def timed(ctx: AsyncContext, _input: Any) -> Any:
        try:
            async with asyncio.timeout(0.02):
                return await ctx.step("s", slow)
        except TimeoutError:
            return "timed out"

    engine = Engine(MemoryStore(), [timed], listeners=[])
    assert engine.start("loop.timed").result == "done"
    assert ran == ["slow"], "the step ran once"


def _tick() -> int:
    time.sleep(0.01)
    return 1


def test_a_timeout_that_lands_during_a_step_ends_the_loop_at_its_next_await_on_either_loop() -> (
    None
):
    @flow(name="loop.polls", version="1")
    async def polls(ctx: AsyncContext, _input: Any) -> Any:
        count = 0
        try:
            async with asyncio.timeout(0.1):
                while count < 200:  # ended by the timeout, long before
                    await ctx.step(f"t{count}", _tick)
                    count += 1
                    await asyncio.sleep(0)
        except TimeoutError:
            return "timed out"
        return "never timed out"

    engine = Engine(MemoryStore(), [polls], listeners=[])
    assert engine.start("loop.polls").result == "timed out"


def test_a_timeout_due_during_a_step_whose_block_is_left_at_once_lands_nowhere() -> None:
    @flow(name="loop.left_in_time", version="1")
    async def left_in_time(ctx: AsyncContext, _input: Any) -> Any:
        try:
            async with asyncio.timeout(0.02):
                await ctx.step("s", _slow_step)
                await asyncio.sleep(0)  # the task wakes first, then the timer would run
                return "no timeout"
        except TimeoutError:
            return "timed out"

    engine = Engine(MemoryStore(), [left_in_time], listeners=[])
    assert engine.start("loop.left_in_time").result == "no timeout"


def test_a_cancel_held_back_by_a_step_keeps_its_message_and_lands_at_the_next_await() -> None:
    @flow(name="loop.told", version="1")
    async def told(ctx: AsyncContext, _input: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().call_later(0.02, task.cancel, "my reason")
        try:
            await ctx.step("s", _slow_step)
            await asyncio.sleep(0.01)
        except asyncio.CancelledError as cancel:
            task.uncancel()
            return list(cancel.args)
        return "not cancelled"

    engine = Engine(MemoryStore(), [told], listeners=[])
    assert engine.start("loop.told").result == ["my reason"]


def test_a_withdrawn_cancel_after_a_task_group_is_not_delivered_later() -> None:
    async def boom() -> None:
        raise ValueError("child")

    @flow(name="loop.after_group", version="1")
    async def after_group(ctx: AsyncContext, _input: Any) -> Any:
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(boom())
        except* ValueError:
            pass  # 3.11 leaves this task's cancel count at 1 here
        async with asyncio.timeout(0.02):
            result = await ctx.step("s", _slow_step)
        for _ in range(3):  # where a held cancel would land (its second await)
            await asyncio.sleep(0)
        return result

    engine = Engine(MemoryStore(), [after_group], listeners=[])
    assert engine.start("loop.after_group").result == "slow"


def test_an_async_flow_that_survives_a_cancel_of_its_own_task_goes_on() -> None:
    import asyncio

    @flow(name="self_cancel", version="1")
    async def self_cancel(ctx: AsyncContext, _input: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            task.uncancel()
        await asyncio.sleep(0)  # the cancel was delivered once, not again
        return await ctx.step("after", lambda: "went on")

    box = sandbox(self_cancel)
    assert box.engine.start("self_cancel", key="c").result == "went on"
