"""Async flows on one loop of another thread (the async API caller's): the loop never
waits on a journal write or a sync step, the drive's thread makes them; a caller's loop
that closes or stops mid-drive stops the drive, the journal as it was, and leaves none
of its flow code running or its calls unanswered."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import sys
import threading
import time
from collections.abc import Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest
from async_helpers import _slow_step, instant
from loom_kernel import (
    AsyncContext,
    Engine,
    LoomError,
    MemoryStore,
    RetryPolicy,
    Status,
    StepFailedError,
    flow,
)
from loom_kernel._replay import FlowPass, Unwind, _servant, drive_on_loop
from loom_kernel.spi import NewRecord


class HeldStepWrites(MemoryStore):
    """A store whose appends of step results wait for `release` (or time out)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.writing = threading.Event()  # set once a held write began
        self.waited: list[bool] = []
        self.threads: set[int] = set()

    def append(
        self, stream: str, expected: int, records: Sequence[NewRecord], *, sync: bool = True
    ) -> int:
        if any(record.kind == "STEP_COMPLETED" for record in records):
            self.threads.add(threading.get_ident())
            self.writing.set()
            self.waited.append(self.release.wait(5))
        return super().append(stream, expected, records, sync=sync)


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


_NESTED_STARTS = """
import asyncio, os
from loom_kernel import AsyncContext, Engine, MemoryStore, flow
from loom_kernel._replay import FLOW_LOOP, LoopThread

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


# -- the caller's loop closes or stops -------------------------------------------------


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


def test_a_call_refused_at_once_does_not_bring_a_held_cancel_forward() -> None:
    """A cancel held back by a call lands at the task's second await that is not a
    call, however many calls end meanwhile: one refused at once (its executor shut
    down) while the delivery is already due must not schedule a second look, which
    would count the same await twice and land the cancel one await early."""
    from concurrent.futures import ThreadPoolExecutor

    from loom_kernel._replay import LoopStoppedError, Servant
    from loom_kernel._replay._servant import unwrap

    loop = asyncio.new_event_loop()
    executor = ThreadPoolExecutor(1)
    servant = Servant(loop, executor)
    reached: list[str] = []

    async def run() -> list[Any]:
        task = asyncio.current_task()
        assert task is not None

        def cancel_during_the_call() -> str:
            loop.call_soon_threadsafe(task.cancel, "held")
            return "done"

        assert unwrap(await servant.call(cancel_during_the_call)) == "done"
        executor.shutdown(wait=True)
        with pytest.raises(LoopStoppedError):
            unwrap(await servant.call(print))  # refused without a wait
        try:
            for await_number in (1, 2, 3):
                reached.append(f"before await {await_number}")
                await asyncio.sleep(0)
        except asyncio.CancelledError as cancel:
            task.uncancel()
            return list(cancel.args)
        return []

    try:
        assert loop.run_until_complete(asyncio.wait_for(run(), 10)) == ["held"]
        assert reached == ["before await 1", "before await 2"]
    finally:
        executor.shutdown()
        loop.close()


def test_a_pass_asked_as_the_loop_closes_is_closed_not_left_never_awaited() -> None:
    """A worker's drive on its loop is cancelled (the loop is closing) while a sync part
    runs; that part asks for another pass of the flow's code: the pass never starts, its
    coroutine is closed (no "never awaited" warning later) and the drive unwinds."""

    class Passes:  # what drive_on_loop asks of a pass's context
        def served_by(self, servant: object) -> None:
            pass

        async def run(self, flow: Any) -> Any:
            return await flow

    async def first() -> str:
        return "first"

    async def second() -> str:
        return "second"

    later = second()
    in_part, go_on = threading.Event(), threading.Event()

    def drive() -> Generator[FlowPass, Any, str]:
        assert (yield FlowPass(cast(Any, Passes()), first())) == "first"
        in_part.set()  # a sync part, on the executor
        go_on.wait(10)
        try:
            yield FlowPass(cast(Any, Passes()), later)
        except Unwind as unwind:
            return f"unwound: {unwind.error}"
        return "the second pass ran"

    running = drive()
    asked = next(running)

    async def main() -> Any:
        with ThreadPoolExecutor(2) as executor:
            rest = drive_on_loop(running, asked, contextvars.copy_context(), executor)
            task = asyncio.ensure_future(rest)
            await asyncio.to_thread(in_part.wait, 10)
            task.cancel()  # as the worker's loop, closing, cancels its tasks
            await asyncio.sleep(0.05)
            go_on.set()
            return await task

    assert asyncio.run(main()) == (
        "unwound: the event loop running the flow is closing",
        None,
    )
    assert inspect.getcoroutinestate(later) == "CORO_CLOSED"
