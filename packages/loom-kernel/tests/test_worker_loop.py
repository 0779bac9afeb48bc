"""A worker's one loop for its async runs: the runs share it and their writes are in
flight side by side, a run whose code awaits holds no thread, a step that exits leaves
the loop running for the others, and a stop waits for the threads the flows left
running (for its grace at most) and releases awaiting runs for another worker."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures.thread import _worker as _pool_worker
from typing import Any

import pytest
from async_helpers import instant
from loom_kernel import AsyncContext, Engine, MemoryStore, Status, Worker, flow
from loom_kernel._replay import Servant
from loom_kernel.spi import NewRecord


class BarrierOnStepWrites(MemoryStore):
    """A store whose step writes pass only `parties` at a time, all together."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(parties, timeout=10)

    def append(
        self, stream: str, expected: int, records: Sequence[NewRecord], *, sync: bool = True
    ) -> int:
        if any(record.kind == "STEP_COMPLETED" for record in records):
            self.barrier.wait()
        return super().append(stream, expected, records, sync=sync)


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


def test_a_workers_loop_closes_as_it_stops_though_the_event_loop_policy_changed() -> None:
    """A program that sets a policy while a worker runs (installing uvloop's, say) leaves
    the loop's thread with no current loop in the new policy: its stop still cancels
    what the flows left and closes the loop."""
    loops_seen.clear()
    engine = Engine(MemoryStore(), [shared], listeners=[])
    previous = asyncio.get_event_loop_policy()
    try:
        with Worker(engine, concurrency=2, idle_poll=0.02):
            assert engine.enqueue("loop.shared", 1, key="r").result(timeout=20) == "done"
            asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
    finally:
        asyncio.set_event_loop_policy(previous)
    assert loops_seen[0].is_closed(), "the worker closed its loop as it stopped"


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


def test_a_sync_step_that_exits_leaves_the_workers_loop_running_for_other_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The exit is the drive's failure, said as such (not a cancel of the flow's task,
    which the step's caller got meanwhile), and the loop goes on for other runs."""
    loops_seen.clear()

    @flow(name="loop.exits")
    async def exits(ctx: AsyncContext, _input: Any) -> Any:
        loops_seen.append(asyncio.get_running_loop())
        return await ctx.step("s", sys.exit, 3)

    store = MemoryStore()
    engine = Engine(store, [exits, shared], listeners=[])
    with (
        caplog.at_level("WARNING", logger="loom"),
        Worker(engine, concurrency=2, idle_poll=0.02) as worker,
    ):
        engine.enqueue("loop.exits", None, key="x")
        deadline = time.monotonic() + 10
        while not loops_seen and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)  # the exit has unwound
        assert engine.enqueue("loop.shared", None, key="y").result(timeout=10) == "done"
        assert worker.stats.failures >= 1  # each visit of it exits again
    assert worker.stats.in_flight == 0, "the exit freed its slot"
    assert loops_seen[0] is loops_seen[1], "the second run ran on the same, living loop"
    said = [r for r in caplog.records if r.getMessage() == "loom: working on x failed"]
    assert said, caplog.text
    assert all(r.exc_info is not None and r.exc_info[0] is SystemExit for r in said)
    assert "cancelled" not in caplog.text
    exited = engine.get("x")
    assert exited.status is Status.RUNNING, "a step cut short journals nothing"
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


def _drive_threads(besides: Iterable[threading.Thread] = ()) -> list[threading.Thread]:
    """The pool threads of workers, but those in `besides` (left by earlier tests)."""
    earlier = set(besides)
    return [
        t for t in threading.enumerate() if t.name.startswith("loom-drive") and t not in earlier
    ]


def _busy_drive_threads(besides: Iterable[threading.Thread], wait: float = 5.0) -> list[str]:
    """The pool threads doing work rather than waiting for it, once none is, or after
    `wait` seconds (a thread that just handed back its work is idle a moment later)."""
    deadline = time.monotonic() + wait
    while True:
        frames = sys._current_frames()
        busy = [
            t.name
            for t in _drive_threads(besides)
            if t.ident in frames and frames[t.ident].f_code is not _pool_worker.__code__
        ]
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.01)


def _threads_serving_a_flow() -> list[str]:
    """The threads blocked making the calls of one flow until its code is done."""
    serving = []
    for ident, frame in sys._current_frames().items():
        walked: Any = frame
        while walked is not None:
            if walked.f_code is Servant.serve.__code__:
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
    earlier = _drive_threads()  # another test's pool may still be winding down
    with Worker(engine, concurrency=runs, idle_poll=0.02) as worker:
        handles = []
        try:
            for number in range(runs):  # one at a time: each start finds the pool idle
                handles.append(engine.enqueue("loop.awaiting", number, key=f"a{number}"))
                assert arrived.acquire(timeout=10)
            assert worker.stats.in_flight == runs, "every run holds its slot"
            assert _threads_serving_a_flow() == []
            assert _busy_drive_threads(besides=earlier) == []
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


def test_an_async_run_on_a_workers_loop_publishes_its_events() -> None:
    """`ctx.set_event` hands its write to the executor that serves the run's calls:
    made there on the flow's behalf, it is the flow's own call, not another task's."""

    @flow(name="loop.publishes")
    async def publishes(ctx: AsyncContext, _input: Any) -> Any:
        await ctx.set_event("stage", "half")
        await ctx.step("s", instant)
        await ctx.set_event("stage", "whole")
        return "published"

    engine = Engine(MemoryStore(), [publishes], listeners=[])
    with Worker(engine, concurrency=2, idle_poll=0.02):
        assert engine.enqueue("loop.publishes", None, key="p").result(timeout=20) == "published"
    assert engine.get_events("p") == {"stage": "whole"}
