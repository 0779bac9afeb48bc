"""Concurrent steps in async flows: what the code decides never depends on timing.

A step takes its position where the flow's own code calls ctx.step; the code never
sees one concurrent step finish while another still runs (the pass ends, the running
steps are journaled, and the code runs again on the journal). Each test checks the
first run against a replay on the same journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loom_kernel import (
    AsyncContext,
    ConflictError,
    Context,
    InvalidArgumentError,
    LoomError,
    MemoryStore,
    Status,
    StepFailedError,
    Worker,
    flow,
)
from loom_kernel.testing import sandbox

#: Each test runs with a loop per drive and on one loop of another thread.
pytestmark = pytest.mark.usefixtures("flow_loop")

calls: list[str] = []


async def work(name: str, delay: float) -> str:
    calls.append(name)
    await asyncio.sleep(delay)
    return name


def _replayed(box: Any, execution_id: str) -> Any:
    """The run parked at gate "end" after its first pass: resume it on a new engine."""
    assert box.engine.get(execution_id).waiting_on == "end"
    first = list(calls)
    done = box.new_engine().resume(execution_id, "ok")
    assert done.status is Status.COMPLETED, done
    assert calls == first, "no step ran again"
    return done.result


@settings(max_examples=25, deadline=None)
@given(delays=st.lists(st.sampled_from([0.0, 0.001, 0.003]), min_size=2, max_size=4))
def test_first_completed_decides_the_same_on_the_first_run_and_on_replay(
    delays: list[float],
) -> None:
    @flow(name="race", version="1")
    async def race(ctx: AsyncContext, _input: Any) -> Any:
        tasks = [
            asyncio.ensure_future(ctx.step(f"s{n}", work, f"s{n}", delay))
            for n, delay in enumerate(delays)
        ]
        done, _pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        seen = sorted(task.result() for task in done)
        await ctx.suspend("end")
        return seen

    calls.clear()
    box = sandbox(race)
    run = box.engine.start("race", key="r")
    assert run.status is Status.SUSPENDED
    first = box.engine.get("r")
    assert len(calls) == len(delays), "every step ran once"
    assert _replayed(box, "r") == sorted(f"s{n}" for n in range(len(delays)))
    assert first.position == box.store.head("ex/r") - 2  # the resume and the end only


@settings(max_examples=25, deadline=None)
@given(delays=st.lists(st.sampled_from([0.0, 0.001, 0.003]), min_size=2, max_size=4))
def test_as_completed_yields_the_same_order_on_the_first_run_and_on_replay(
    delays: list[float],
) -> None:
    @flow(name="stream", version="1")
    async def stream(ctx: AsyncContext, _input: Any) -> Any:
        steps = [ctx.step(f"s{n}", work, f"s{n}", delay) for n, delay in enumerate(delays)]
        order = [await next_done for next_done in asyncio.as_completed(steps)]
        await ctx.step("use", lambda: order[0])
        await ctx.suspend("end")
        return order

    calls.clear()
    box = sandbox(stream)
    box.engine.start("stream", key="s")
    recorded = box.engine.get("s")
    replayed = _replayed(box, "s")
    assert sorted(replayed) == sorted(f"s{n}" for n in range(len(delays)))
    assert recorded.status is Status.SUSPENDED
    use = next(record for record in box.store.read("ex/s") if b'"use"' in record[2])
    assert replayed[0].encode() in use[2], "the step after the loop saw the replayed order"


def test_a_task_group_of_steps_runs_each_once_and_replays() -> None:
    @flow(name="group", version="1")
    async def group(ctx: AsyncContext, _input: Any) -> Any:
        async with asyncio.TaskGroup() as tasks:
            slow = tasks.create_task(ctx.step("slow", work, "slow", 0.005))
            fast = tasks.create_task(ctx.step("fast", work, "fast", 0.0))
        await ctx.suspend("end")
        return [slow.result(), fast.result()]

    calls.clear()
    box = sandbox(group)
    box.engine.start("group", key="g")
    assert sorted(calls) == ["fast", "slow"]
    assert _replayed(box, "g") == ["slow", "fast"]


def test_a_gathered_failure_waits_for_its_siblings_before_the_flow_sees_it() -> None:
    async def broken() -> str:
        raise ValueError("no")

    @flow(name="fails", version="1")
    async def fails(ctx: AsyncContext, _input: Any) -> Any:
        try:
            await asyncio.gather(ctx.step("bad", broken), ctx.step("slow", work, "slow", 0.005))
        except StepFailedError as exc:
            caught = exc.step
        await ctx.suspend("end")
        return caught

    calls.clear()
    box = sandbox(fails)
    box.engine.start("fails", key="f")
    assert calls == ["slow"], "the sibling finished and was journaled, not cancelled"
    assert _replayed(box, "f") == "bad"


def test_a_timeout_around_a_step_does_not_cut_it_short() -> None:
    @flow(name="ask", version="1")
    async def ask(ctx: AsyncContext, _input: Any) -> Any:
        try:
            answer = await asyncio.wait_for(ctx.step("call", work, "call", 0.05), timeout=0.001)
        except TimeoutError:
            answer = "timed out"
        await ctx.suspend("end")
        return answer

    calls.clear()
    box = sandbox(ask)
    box.engine.start("ask", key="a")
    assert _replayed(box, "a") == "call", "the step ran to its end and its result counts"


@pytest.mark.parametrize("shape", ["gathered branches", "a task of its own"])
def test_a_step_called_in_another_task_is_refused_at_the_first_run(shape: str) -> None:
    async def branch(ctx: AsyncContext, tag: str) -> list[str]:
        return [await ctx.step(f"{tag}{n}", work, f"{tag}{n}", 0.001) for n in (1, 2)]

    @flow(name="branches", version="1")
    async def branches(ctx: AsyncContext, _input: Any) -> Any:
        if shape == "gathered branches":
            return await asyncio.gather(branch(ctx, "a"), branch(ctx, "b"))
        return await asyncio.create_task(branch(ctx, "a"))

    calls.clear()
    box = sandbox(branches)
    with pytest.raises(InvalidArgumentError, match="another task than the flow's own"):
        box.engine.start("branches", key="b")
    assert calls == [], "refused before any step ran"
    assert [record[1] for record in box.store.read("ex/b")] == ["EXECUTION_STARTED"]


def test_a_sync_step_cut_short_by_a_base_exception_stops_the_run() -> None:
    class Stop(BaseException):
        pass

    def interrupted() -> None:
        raise Stop

    @flow(name="stopped", version="1")
    def stopped(ctx: Context, _input: Any) -> Any:
        with contextlib.suppress(Stop):
            ctx.step("call", interrupted)
        return ctx.step("after", lambda: "went on")

    box = sandbox(stopped)
    with pytest.raises(InvalidArgumentError, match="cut short by Stop"):
        box.engine.start("stopped", key="s")
    assert [record[1] for record in box.store.read("ex/s")] == ["EXECUTION_STARTED"]


def test_a_step_cancelled_before_it_starts_is_refused_as_never_awaited() -> None:
    @flow(name="cancels", version="1")
    async def cancels(ctx: AsyncContext, _input: Any) -> Any:
        task = asyncio.ensure_future(ctx.step("call", work, "call", 1.0))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return await ctx.step("after", lambda: "went on")

    calls.clear()
    box = sandbox(cancels)
    with pytest.raises(InvalidArgumentError, match="never awaited"):
        box.engine.start("cancels", key="c")
    assert "after" not in [record[1] for record in box.store.read("ex/c")]


@pytest.mark.parametrize("in_a_worker", [False, True])
def test_a_step_in_a_task_that_never_started_is_refused_with_nothing_logged(
    caplog: pytest.LogCaptureFixture, in_a_worker: bool
) -> None:
    """A step wrapped in a task the flow never awaits, and which has not started when
    the flow returns: refused as never awaited; its task ends cancelled, without
    running the step, and asyncio logs no "Task exception was never retrieved"."""
    import gc
    import warnings

    tasks: list[asyncio.Future[Any]] = []

    @flow(name="forgets", version="1")
    async def forgets(ctx: AsyncContext, _input: Any) -> Any:
        tasks.append(asyncio.ensure_future(ctx.step("call", work, "call", 0.0)))
        return "returned"

    calls.clear()
    box = sandbox(forgets, listeners=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if in_a_worker:
            with Worker(box.engine, idle_poll=0.02):
                box.engine.enqueue("forgets", key="f")
                deadline = time.monotonic() + 20
                while not (tasks and tasks[0].done()) and time.monotonic() < deadline:
                    time.sleep(0.01)
        else:
            with pytest.raises(InvalidArgumentError, match="never awaited before the flow ret"):
                box.engine.start("forgets", key="f")
        gc.collect()
    assert tasks[0].cancelled()
    assert calls == []
    assert "never retrieved" not in caplog.text
    assert not [w for w in caught if "never awaited" in str(w.message)]
    assert box.engine.get("f").status is Status.RUNNING, "refused: the journal as it was"


class UncheckedHeadStore(MemoryStore):
    """A store whose head the engine does not look at before each step (as on S3)."""

    head_is_cheap = False


@pytest.mark.parametrize("store_class", [MemoryStore, UncheckedHeadStore])
def test_a_store_error_while_a_pass_settles_ends_the_drive_and_runs_nothing_again(
    store_class: type[MemoryStore], caplog: pytest.LogCaptureFixture
) -> None:
    """...and the step's task, which the flow never awaits, ends with the stop taken as
    seen: asyncio logs no "Task exception was never retrieved" about it."""
    import gc

    box_holder: list[Any] = []

    async def cancelled_meanwhile() -> str:
        calls.append("slow")
        await asyncio.sleep(0.005)
        box_holder[0].new_engine().cancel("c", reason="elsewhere")  # moves the head
        return "slow"

    @flow(name="moved", version="1")
    async def moved(ctx: AsyncContext, _input: Any) -> Any:
        steps = [
            asyncio.ensure_future(ctx.step("slow", cancelled_meanwhile)),
            asyncio.ensure_future(ctx.step("fast", work, "fast", 0.0)),
        ]
        await asyncio.wait(steps, return_when=asyncio.FIRST_COMPLETED)
        return "done"

    calls.clear()
    box = sandbox(moved, store=store_class())
    box_holder.append(box)
    try:
        run = box.engine.start("moved", key="c")
    except ConflictError:
        run = box.engine.get("c")
    assert calls.count("slow") == 1, "the step whose append was refused did not run again"
    assert run.status is Status.CANCELLED
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_a_pass_that_would_run_again_having_journaled_nothing_stops_instead_of_looping() -> None:
    @flow(name="spins", version="1")
    async def spins(ctx: AsyncContext, _input: Any) -> Any:
        raise ctx._replay_again()  # what a bug in the kernel's pass bookkeeping would do

    box = sandbox(spins)
    with pytest.raises(LoomError, match="journaled nothing"):
        box.engine.start("spins", key="s")
    assert [record[1] for record in box.store.read("ex/s")] == ["EXECUTION_STARTED"]


@pytest.mark.parametrize("call", ["now", "random", "uuid"])
def test_a_journaled_value_asked_in_another_task_is_refused(call: str) -> None:
    """`ctx.now()`, `ctx.random()` and `ctx.uuid()` take a position as a step does:
    asked from a task of its own, the position would depend on timing."""

    async def branch(ctx: AsyncContext) -> Any:
        await asyncio.sleep(0)
        return getattr(ctx, call)()

    @flow(name="values", version="1")
    async def values(ctx: AsyncContext, _input: Any) -> Any:
        return await asyncio.create_task(branch(ctx))

    box = sandbox(values)
    with pytest.raises(InvalidArgumentError, match="another task than the flow's own"):
        box.engine.start("values", key="v")
    assert [record[1] for record in box.store.read("ex/v")] == ["EXECUTION_STARTED"]


def test_a_flow_that_looks_at_a_concurrent_step_after_its_own_decides_alike_on_replay() -> None:
    import asyncio

    async def work(name: str, delay: float) -> str:
        await asyncio.sleep(delay)
        return name

    @flow(name="peek", version="1")
    async def peek(ctx: AsyncContext, _input: Any) -> Any:
        quick = asyncio.ensure_future(ctx.step("quick", work, "quick", 0.0))
        await ctx.step("slower", work, "slower", 0.01)
        branch = "done" if quick.done() else "pending"
        await ctx.step(branch, lambda: branch)
        await quick
        await ctx.suspend("end")
        return branch

    box = sandbox(peek)
    box.engine.start("peek", key="p")
    assert box.new_engine().resume("p", "ok").status is Status.COMPLETED
