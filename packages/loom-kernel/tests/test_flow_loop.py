"""Async flows on one loop of another thread (a worker's, the async API caller's): the
loop never waits on a journal write or a sync step, and each drive's thread makes
them, so many runs' writes are in flight side by side."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
from loom_kernel import (
    AsyncContext,
    Engine,
    InvalidArgumentError,
    LoomError,
    MemoryStore,
    RetryPolicy,
    Status,
    StepFailedError,
    Worker,
    flow,
)
from loom_kernel._replay import _servant
from loom_kernel.spi import NewRecord


class HeldStepWrites(MemoryStore):
    """A store whose appends of step results wait for `release` (or time out)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.writing = threading.Event()  # set once a held write began
        self.waited: list[bool] = []
        self.threads: set[int] = set()

    def append(self, stream: str, expected: int, records: Sequence[NewRecord]) -> int:
        if any(record.kind == "STEP_COMPLETED" for record in records):
            self.threads.add(threading.get_ident())
            self.writing.set()
            self.waited.append(self.release.wait(5))
        return super().append(stream, expected, records)


async def instant() -> str:
    return "done"


@flow(name="loop.one_step")
async def one_step(ctx: AsyncContext, _input: Any) -> Any:
    return await ctx.step("s", instant)


def test_the_async_apis_journal_writes_never_hold_the_callers_loop() -> None:
    store = HeldStepWrites()
    engine = Engine(store, [one_step], listeners=[])

    async def main() -> Any:
        async def release_once_writing() -> None:
            while not store.writing.is_set():  # runs only while the loop is free
                await asyncio.sleep(0.001)
            store.release.set()

        releaser = asyncio.create_task(release_once_writing())
        done = await engine.start_async("loop.one_step")
        await releaser
        return done.result, threading.get_ident()

    result, loop_thread = asyncio.run(main())
    assert result == "done"
    assert store.waited == [True], "the loop ran while the step's result was written"
    assert loop_thread not in store.threads


def test_a_sync_step_of_an_async_flow_runs_off_the_callers_loop() -> None:
    loop_ran = threading.Event()

    @flow(name="loop.sync_step")
    async def sync_step(ctx: AsyncContext, _input: Any) -> Any:
        return await ctx.step("wait", lambda: loop_ran.wait(5))

    engine = Engine(MemoryStore(), [sync_step], listeners=[])

    async def main() -> Any:
        async def meanwhile() -> None:
            await asyncio.sleep(0.01)
            loop_ran.set()

        ticker = asyncio.create_task(meanwhile())
        done = await engine.start_async("loop.sync_step")
        await ticker
        return done.result

    assert asyncio.run(main()) is True


class BarrierOnStepWrites(MemoryStore):
    """A store whose step writes pass only `parties` at a time, all together."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(parties, timeout=10)

    def append(self, stream: str, expected: int, records: Sequence[NewRecord]) -> int:
        if any(record.kind == "STEP_COMPLETED" for record in records):
            self.barrier.wait()
        return super().append(stream, expected, records)


loops_seen: list[asyncio.AbstractEventLoop] = []


@flow(name="loop.shared")
async def shared(ctx: AsyncContext, _input: Any) -> Any:
    loops_seen.append(asyncio.get_running_loop())
    return await ctx.step("s", instant)


def test_a_workers_async_runs_share_its_loop_and_write_side_by_side() -> None:
    loops_seen.clear()
    store = BarrierOnStepWrites(4)  # passes only with 4 step writes in flight at once
    engine = Engine(store, [shared], listeners=[])
    with Worker(engine, concurrency=4, idle_poll=0.02):
        handles = [engine.enqueue("loop.shared", n, key=f"r{n}") for n in range(4)]
        assert [handle.result(timeout=20) for handle in handles] == ["done"] * 4
    assert len(loops_seen) == 4
    assert len({id(loop) for loop in loops_seen}) == 1, "one loop for every run"
    assert loops_seen[0].is_closed(), "the worker closed its loop as it stopped"


def test_a_cancel_while_a_ctx_call_is_journaled_is_not_delivered_as_on_a_held_loop() -> None:
    store = HeldStepWrites()

    @flow(name="loop.gives_up", version="1")
    async def gives_up(ctx: AsyncContext, _input: Any) -> Any:
        try:
            async with asyncio.timeout(0.05):
                return await ctx.step("s", instant)
        except TimeoutError:
            return "gave up"

    engine = Engine(store, [gives_up], listeners=[])

    async def main() -> Any:
        async def release_later() -> None:
            await asyncio.sleep(0.2)  # after the timeout, while the write is held
            store.release.set()

        releaser = asyncio.create_task(release_later())
        done = await engine.start_async("loop.gives_up", None, key="g")
        await releaser
        return done.result

    assert asyncio.run(main()) == "done", "the code saw the call end as the journal says"
    assert store.waited == [True]
    kinds = [record[1] for record in store.read("ex/g")]
    assert kinds == ["EXECUTION_STARTED", "STEP_COMPLETED", "EXECUTION_COMPLETED"]


@pytest.mark.usefixtures("flow_loop")
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


@pytest.mark.usefixtures("flow_loop")
def test_set_event_in_an_async_flow_publishes_on_either_loop() -> None:
    @flow(name="loop.publishes", version="1")
    async def publishes(ctx: AsyncContext, _input: Any) -> Any:
        await ctx.set_event("stage", "half")
        return await ctx.step("s", instant)

    engine = Engine(MemoryStore(), [publishes], listeners=[])
    assert engine.start("loop.publishes", None, key="p").result == "done"
    assert engine.get_event("p", "stage") == "half"


@pytest.mark.usefixtures("flow_loop")
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


class Crash(BaseException):
    """Cuts a step short, as a process dying in it would."""


@pytest.mark.usefixtures("flow_loop")
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


def test_an_async_step_that_exits_leaves_the_workers_loop_running_for_other_runs() -> None:
    started = threading.Event()

    @flow(name="loop.exits_async")
    async def exits_async(ctx: AsyncContext, _input: Any) -> Any:
        async def leave() -> None:
            sys.exit(3)

        return await ctx.step("s", leave)

    @flow(name="loop.bystander")
    async def bystander(ctx: AsyncContext, _input: Any) -> Any:
        async def wait() -> str:
            started.set()
            await asyncio.sleep(0.2)
            return "waited"

        return await ctx.step("w", wait)

    store = MemoryStore()
    engine = Engine(store, [exits_async, bystander], listeners=[])
    with Worker(engine, concurrency=2, idle_poll=0.02, grace=5) as worker:
        waiting = engine.enqueue("loop.bystander", None, key="b")
        assert started.wait(10)
        engine.enqueue("loop.exits_async", None, key="x")
        assert waiting.result(timeout=10) == "waited"
        assert not worker._slots.flows.loop.is_closed()  # type: ignore[union-attr]
    assert "STEP_COMPLETED" not in [record[1] for record in store.read("ex/x")]


def _leaves_a_thread(
    started: threading.Event, release: threading.Event, ended: threading.Event | None = None
) -> Any:
    def stray() -> None:
        started.set()
        release.wait(10)
        if ended is not None:
            time.sleep(0.5)  # still running when the stop would return without waiting
            ended.set()

    @flow(name="loop.leaves_a_thread")
    async def leaves_a_thread(ctx: AsyncContext, _input: Any) -> Any:
        async def step() -> str:
            with contextlib.suppress(TimeoutError):  # the thread goes on
                await asyncio.wait_for(asyncio.to_thread(stray), 0.01)
            return "left"

        return await ctx.step("s", step)

    return leaves_a_thread


def test_a_worker_stops_once_the_threads_its_async_flows_left_running_end() -> None:
    started, release, ended = threading.Event(), threading.Event(), threading.Event()
    engine = Engine(MemoryStore(), [_leaves_a_thread(started, release, ended)], listeners=[])
    worker = Worker(engine, concurrency=1, idle_poll=0.02).start()
    assert engine.enqueue("loop.leaves_a_thread", None, key="t").result(timeout=10) == "left"
    assert started.wait(10)
    stopping = threading.Thread(target=worker.stop)
    stopping.start()
    release.set()
    stopping.join(20)
    assert not stopping.is_alive()
    assert ended.is_set(), "as asyncio.run ends, the stop waited for the flows' thread"
    assert not worker._threads_left, "none outlived the stop: loom worker exits as usual"


def test_a_flows_thread_that_never_ends_holds_a_workers_stop_for_its_grace_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started, release = threading.Event(), threading.Event()
    engine = Engine(MemoryStore(), [_leaves_a_thread(started, release)], listeners=[])
    worker = Worker(engine, concurrency=1, idle_poll=0.02, grace=0.2).start()
    assert engine.enqueue("loop.leaves_a_thread", None, key="t").result(timeout=10) == "left"
    assert started.wait(10)
    try:
        worker.stop()  # returns, the thread still running
        assert "still run after 0.2 s" in caplog.text
        assert worker._threads_left, "loom worker then exits at once (os._exit)"
    finally:
        release.set()


def test_a_workers_runs_that_start_children_from_async_steps_do_not_starve_its_executor() -> None:
    count = min(32, (os.cpu_count() or 1) + 4) + 1  # more than asyncio's default executor

    @flow(name="loop.child")
    async def child(ctx: AsyncContext, number: int) -> Any:
        async def work() -> int:
            return await asyncio.to_thread(lambda: number)

        return await ctx.step("work", work)

    @flow(name="loop.parent")
    async def parent(ctx: AsyncContext, number: int) -> Any:
        async def start() -> Any:
            return (await ctx.engine.start_async("loop.child", number, key=f"c{number}")).result

        return await ctx.step("start", start)

    engine = Engine(MemoryStore(), [child, parent], listeners=[])
    with Worker(engine, concurrency=count + 1, idle_poll=0.02):
        handles = [engine.enqueue("loop.parent", n, key=f"p{n}") for n in range(count)]
        assert [handle.result(timeout=20) for handle in handles] == list(range(count))


def test_a_sync_step_raising_stop_iteration_on_the_drives_thread_fails_as_itself() -> None:
    def stops() -> None:
        raise StopIteration("none left")

    @flow(name="loop.stops")
    async def stopping(ctx: AsyncContext, _input: Any) -> Any:
        try:
            await ctx.step("s", stops, retry=RetryPolicy(attempts=1))
        except StepFailedError as exc:
            return exc.error_type
        return "no failure"

    engine = Engine(MemoryStore(), [stopping], listeners=[])

    async def main() -> Any:
        return (await engine.start_async("loop.stops")).result

    assert asyncio.run(main()) == "StopIteration"


def test_a_sync_step_that_exits_leaves_the_workers_loop_running_for_other_runs() -> None:
    loops_seen.clear()

    @flow(name="loop.exits")
    async def exits(ctx: AsyncContext, _input: Any) -> Any:
        loops_seen.append(asyncio.get_running_loop())
        return await ctx.step("s", sys.exit, 3)

    store = MemoryStore()
    engine = Engine(store, [exits, shared], listeners=[])
    with Worker(engine, concurrency=2, idle_poll=0.02) as worker:
        engine.enqueue("loop.exits", None, key="x")
        deadline = time.monotonic() + 10
        while not loops_seen and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)  # the exit has unwound
        assert engine.enqueue("loop.shared", None, key="y").result(timeout=10) == "done"
        assert worker.stats.failures >= 1  # each visit of it exits again
    assert worker.stats.in_flight == 0, "the exit freed its slot"
    assert loops_seen[0] is loops_seen[1], "the second run ran on the same, living loop"
    exited = engine.get("x")
    assert exited.status is Status.RUNNING, "a step cut short journals nothing"
    assert "STEP_COMPLETED" not in [record[1] for record in store.read("ex/x")]


@pytest.mark.usefixtures("flow_loop")
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


@pytest.mark.usefixtures("flow_loop")
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


@pytest.mark.usefixtures("flow_loop")
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


def test_the_callers_loop_closing_mid_drive_stops_the_run_without_failing_it() -> None:
    pauses = [5.0]  # the first drive's: longer than its caller's loop lives

    @flow(name="loop.waits", version="1")
    async def waits(ctx: AsyncContext, _input: Any) -> Any:
        await ctx.step("a", instant)
        await asyncio.sleep(pauses.pop() if pauses else 0)
        return await ctx.step("b", instant)

    store = MemoryStore()
    engine = Engine(store, [waits], listeners=[])

    async def main() -> None:
        asyncio.create_task(engine.start_async("loop.waits", None, key="w"))  # noqa: RUF006
        await asyncio.sleep(0.2)  # returns: asyncio.run cancels the flow's task

    asyncio.run(main())  # it ends once the drive does (awaited by the task left, see _threads)
    assert [record[1] for record in store.read("ex/w")] == ["EXECUTION_STARTED", "STEP_COMPLETED"]
    assert Engine(store, [waits], listeners=[]).recover() == ["w"]
    assert engine.get("w").result == "done"


def test_a_pass_left_waiting_for_its_steps_as_the_loop_closes_ends_as_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The code returned with a step still running: the pass waits for it, to journal
    it, and the closing loop cancels the flow's task meanwhile. The task ends
    cancelled, as asyncio expects of a task it cancels as it shuts down (with
    anything else it reports an unhandled exception); the drive's next pass, on the
    journal, finishes the run."""

    @flow(name="loop.leaves_a_step", version="1")
    async def leaves_a_step(ctx: AsyncContext, _input: Any) -> Any:
        asyncio.ensure_future(ctx.step("s", _slow_step))  # noqa: RUF006
        await asyncio.sleep(0.01)  # the step's task starts it
        return "early"

    store = MemoryStore()
    engine = Engine(store, [leaves_a_step], listeners=[])

    async def main() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(engine.start_async("loop.leaves_a_step", key="l"), 0.05)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
    assert "unhandled exception" not in caplog.text
    assert engine.get("l").result == "early"


def _tick() -> int:
    time.sleep(0.01)
    return 1


@pytest.mark.usefixtures("flow_loop")
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


@pytest.mark.usefixtures("flow_loop")
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


def test_the_callers_loop_closing_while_a_pass_waits_for_a_step_ends_without_a_hang() -> None:
    def slow() -> str:
        time.sleep(0.5)
        return "slow"

    @flow(name="loop.waits_for_step", version="1")
    async def waits_for_step(ctx: AsyncContext, _input: Any) -> Any:
        task = asyncio.ensure_future(ctx.step("slow", slow))
        await asyncio.sleep(0.02)  # the pass ends, to run again once the step is journaled
        return await task

    store = MemoryStore()
    engine = Engine(store, [waits_for_step], listeners=[])

    async def main() -> None:
        asyncio.create_task(engine.start_async("loop.waits_for_step", None, key="w"))  # noqa: RUF006
        await asyncio.sleep(0.2)  # returns while the step runs

    finished = threading.Event()

    def run_the_caller() -> None:
        asyncio.run(main())
        finished.set()

    threading.Thread(target=run_the_caller, daemon=True).start()
    assert finished.wait(20), "the caller's asyncio.run returned"
    kinds = [record[1] for record in store.read("ex/w")]
    assert kinds[:2] == ["EXECUTION_STARTED", "STEP_COMPLETED"], "the running step was journaled"
    assert "EXECUTION_FAILED" not in kinds


def test_a_child_driven_inline_by_a_sync_step_outlives_the_callers_loop() -> None:
    async def slow() -> int:
        await asyncio.sleep(0.3)
        return 1

    @flow(name="loop.kid", version="1")
    async def kid(ctx: AsyncContext, _input: Any) -> Any:
        return await ctx.step("a", slow)

    @flow(name="loop.spawner", version="1")
    async def spawner(ctx: AsyncContext, _input: Any) -> Any:
        def spawn() -> Any:
            return ctx.engine.start("loop.kid", None, key="kid").result

        return await ctx.step("spawn", spawn, retry=RetryPolicy(attempts=1))

    store = MemoryStore()
    engine = Engine(store, [spawner, kid], listeners=[])

    async def main() -> None:
        asyncio.create_task(engine.start_async("loop.spawner", None, key="p"))  # noqa: RUF006
        await asyncio.sleep(0.1)  # returns while the child's step awaits

    asyncio.run(main())
    assert engine.get("kid").status is Status.COMPLETED, "the child ran on a loop of its own"
    assert "STEP_FAILED" not in [record[1] for record in store.read("ex/p")]


def _slow_step() -> str:
    time.sleep(0.2)
    return "slow"


@pytest.mark.usefixtures("flow_loop")
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


@pytest.mark.usefixtures("flow_loop")
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


@pytest.mark.usefixtures("flow_loop")
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


def test_a_flow_on_a_loop_that_stops_mid_step_leaves_no_task_behind_when_it_runs_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_servant, "LOOP_CHECK", 0.01)  # the drive looks at the loop often

    @flow(name="loop.paused", version="1")
    async def paused(ctx: AsyncContext, _input: Any) -> Any:
        await ctx.step("a", _slow_step)
        return await ctx.step("b", instant)

    store = MemoryStore()
    engine = Engine(store, [paused], listeners=[])
    loop = asyncio.new_event_loop()
    try:
        main = loop.create_task(engine.start_async("loop.paused", None, key="p"))
        loop.run_until_complete(asyncio.sleep(0.05))  # the loop stops while step a runs
        time.sleep(1.0)  # the drive's thread sees it stopped (twice), and stops the drive
        with pytest.raises(LoomError, match="stopped during its drive"):
            loop.run_until_complete(main)
        left = asyncio.all_tasks(loop)
        if left:  # the flow's task, refused by the drive that is over: it ends
            loop.run_until_complete(asyncio.wait(left, timeout=5))
        assert all(task.done() for task in left)
    finally:
        loop.close()
    kinds = [record[1] for record in store.read("ex/p")]
    assert kinds == ["EXECUTION_STARTED"], "the journal as it was; the next drive goes on"


def test_a_flows_loop_stopped_by_an_interrupt_as_it_closes_still_cancels_and_closes() -> None:
    """A KeyboardInterrupt ends the loop after close() set its flag and before the stop
    it queued ran: that stop then runs inside the teardown's wait for the cancelled
    tasks, which must go on waiting rather than leave the loop open."""
    flows = _servant.LoopThread("test-interrupted", 2)
    started, cancelled = threading.Event(), threading.Event()

    async def slow_to_cancel() -> None:
        started.set()
        try:
            await asyncio.sleep(100)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # the queued stop lands in here
            cancelled.set()
            raise

    def interrupt_once_closing() -> None:
        while not flows._closing:
            time.sleep(0.001)
        time.sleep(0.05)  # close() queues its stop meanwhile
        raise KeyboardInterrupt

    asyncio.run_coroutine_threadsafe(slow_to_cancel(), flows.loop)
    assert started.wait(10)
    flows.loop.call_soon_threadsafe(interrupt_once_closing)
    flows.close()
    assert flows.loop.is_closed()
    assert cancelled.is_set()
    assert flows.join_threads(10)


_NESTED_STARTS = """
import asyncio, os
from loom_kernel import AsyncContext, Engine, MemoryStore, flow
from loom_kernel._replay._servant import FLOW_LOOP, LoopThread

async def instant():
    return "done"

@flow(name="inner", version="1")
async def inner(ctx: AsyncContext, _input):
    return await ctx.step("x", instant)

@flow(name="middle", version="1")
async def middle(ctx: AsyncContext, _input):
    async def in_a_thread():
        return await asyncio.to_thread(lambda: engine.start("inner", key="i").result)
    return await ctx.step("in_a_thread", in_a_thread)

@flow(name="outer", version="1")
async def outer(ctx: AsyncContext, _input):
    async def blocking_start():
        return engine.start("middle", key="m").result  # holds this loop meanwhile
    return await ctx.step("blocking_start", blocking_start)

engine = Engine(MemoryStore(), [inner, middle, outer], listeners=[])
FLOW_LOOP.set(LoopThread("flows", 8).loop)  # as under a worker or the async API
print(engine.start("outer", key="o").result, flush=True)
os._exit(0)
"""


def test_a_start_from_a_thread_of_a_run_a_blocked_loop_drives_aims_at_no_blocked_loop() -> None:
    """A step that blocks the flows' loop on a sync start drives that run on a helper
    thread, with a loop of its own; a start from a thread of that run
    (`asyncio.to_thread`) must not aim at the blocked loop, or it waits for it forever
    (in a process of its own: a regression hangs it, not the suite)."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _NESTED_STARTS],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "done"), done.stderr


@pytest.mark.usefixtures("flow_loop")
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


def test_a_drive_stopped_with_its_loop_leaves_no_flow_code_to_run_when_it_runs_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller's loop stops (not closed) mid-drive: the drive stops, the journal as
    it was, and the flow's coroutine is cancelled, so when the loop runs again later,
    none of that drive's code goes on without it."""
    from loom_kernel._replay import _servant

    monkeypatch.setattr(_servant, "LOOP_CHECK", 0.05)
    reached: list[str] = []

    @flow(name="loop.stopped", version="1")
    async def stopped(ctx: AsyncContext, _input: Any) -> Any:
        await ctx.step("a", instant)
        await asyncio.sleep(0.3)
        reached.append("after the sleep")
        return "done"

    store = MemoryStore()
    engine = Engine(store, [stopped], listeners=[])
    loop = asyncio.new_event_loop()
    try:
        starting = loop.create_task(engine.start_async("loop.stopped", None, key="s"))
        loop.run_until_complete(asyncio.sleep(0.1))  # the loop stops mid-drive
        time.sleep(0.5)  # the drive's thread sees the loop stopped, and stops
        loop.run_until_complete(asyncio.sleep(0.5))  # the loop runs again, past the sleep
        assert reached == [], "the stopped drive's code did not go on"
        with contextlib.suppress(BaseException):
            loop.run_until_complete(starting)
    finally:
        loop.close()
    assert [record[1] for record in store.read("ex/s")] == ["EXECUTION_STARTED", "STEP_COMPLETED"]


def test_a_call_handed_over_as_the_drive_ends_is_refused_not_left_unanswered() -> None:
    """A call the flow's code hands to the drive's thread just as the drive ends (a
    task it left running) gets `LoopStoppedError`: left unanswered, the task awaiting
    it would never end, and neither would its loop's shutdown."""
    from loom_kernel._replay import LoopStoppedError, Servant

    loop = asyncio.new_event_loop()
    try:
        servant = Servant(loop)
        answer: asyncio.Future[Any] = loop.create_future()
        servant._calls.put((None, print, (), answer))  # queued, never served
        servant._close()
        loop.run_until_complete(asyncio.wait_for(answer, 5))
        value, error = answer.result()
        assert value is None
        assert isinstance(error, LoopStoppedError)
    finally:
        loop.close()


def _drive_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("loom-drive")]


def _threads_serving_a_flow() -> list[str]:
    """The threads blocked making the calls of one flow until its code is done."""
    serving = []
    for ident, frame in sys._current_frames().items():
        walked: Any = frame
        while walked is not None:
            if walked.f_code is _servant.Servant.serve.__code__:
                serving.append(str(ident))
                break
            walked = walked.f_back
    return serving


def _awaiting_flow(
    name: str, arrived: threading.Semaphore, go: threading.Event, ran: list[tuple[str, int]]
) -> Any:
    def noted(step: str, number: int, value: int) -> int:
        ran.append((step, number))
        return value

    @flow(name=name)
    async def awaiting(ctx: AsyncContext, number: int) -> Any:
        first = await ctx.step("before", lambda: noted("before", number, number))
        arrived.release()
        while not go.is_set():  # awaits on the loop, holding no thread of its own
            await asyncio.sleep(0.005)
        return await ctx.step("after", lambda: noted("after", number, first + 1))

    return awaiting


def test_a_workers_async_runs_hold_no_thread_while_their_code_awaits() -> None:
    """A slot of a worker is a thread for a sync flow and a task of its loop for an
    async one: twenty runs awaiting at once hold none of its pool's threads (each held
    one, serving its flow, before), and their steps still run once each."""
    arrived, go = threading.Semaphore(0), threading.Event()
    ran: list[tuple[str, int]] = []
    awaiting = _awaiting_flow("loop.awaiting", arrived, go, ran)
    engine = Engine(MemoryStore(), [awaiting], listeners=[])
    runs = 20
    with Worker(engine, concurrency=runs, idle_poll=0.02) as worker:
        handles = []
        try:
            for number in range(runs):  # one at a time: each start finds the pool idle
                handles.append(engine.enqueue("loop.awaiting", number, key=f"a{number}"))
                assert arrived.acquire(timeout=10)
            assert worker.stats.in_flight == runs, "every run holds its slot"
            assert _threads_serving_a_flow() == []
            assert len(_drive_threads()) <= 3, [t.name for t in _drive_threads()]
        finally:
            go.set()  # a failure above still lets the worker stop
        assert [handle.result(timeout=20) for handle in handles] == [n + 1 for n in range(runs)]
    assert sorted(ran) == sorted(
        [("before", n) for n in range(runs)] + [("after", n) for n in range(runs)]
    )


def test_a_workers_stop_releases_its_awaiting_async_runs_for_another_to_finish() -> None:
    """Runs awaiting on a stopping worker's loop go on for its grace, are released at
    their next step (the stop returns once they are), and another worker finishes them,
    each step once."""
    arrived, go = threading.Semaphore(0), threading.Event()
    ran: list[tuple[str, int]] = []
    awaiting = _awaiting_flow("loop.released", arrived, go, ran)
    store = MemoryStore()
    first = Engine(store, [awaiting], listeners=[], worker_id="first")
    runs = 5
    worker = Worker(first, concurrency=runs, idle_poll=0.02, grace=0.1).start()
    handles = [first.enqueue("loop.released", n, key=f"r{n}") for n in range(runs)]
    for _ in range(runs):
        assert arrived.acquire(timeout=10)
    stopping = threading.Thread(target=worker.stop)
    stopping.start()
    stopping.join(0.5)
    assert stopping.is_alive(), "a run's code still awaits: the stop waits for it"
    go.set()
    stopping.join(20)
    assert not stopping.is_alive()
    assert [first.get(h.id).status for h in handles] == [Status.RUNNING] * runs
    assert ("after", 0) not in ran, "released before its next step"
    second = Engine(store, [awaiting], listeners=[], worker_id="second")
    with Worker(second, concurrency=runs, idle_poll=0.02):
        results = [second.handle(h.id).result(timeout=20) for h in handles]
    assert results == [n + 1 for n in range(runs)]
    assert sorted(ran) == sorted(
        [("before", n) for n in range(runs)] + [("after", n) for n in range(runs)]
    ), "each step once, across the two workers"
