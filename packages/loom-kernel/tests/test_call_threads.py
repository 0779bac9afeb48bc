"""The async API's threads: a call never waits for another, idle threads are reused
and end, and a call its caller gave up on is awaited to its end by the loop."""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from loom_kernel import AsyncContext, Context, Engine, MemoryStore, Worker, flow
from loom_kernel._replay import CallThreads, call_threads, in_a_thread, let_go


def _eventually(condition: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_calls_one_after_another_reuse_one_thread() -> None:
    threads = CallThreads("reuse", linger=30)
    seen = {threads.run(threading.get_ident).result(10) for _ in range(20)}
    assert len(seen) == 1
    assert threads.threads() == 1


def test_calls_at_once_each_get_a_thread_however_many() -> None:
    count = 40
    together = threading.Barrier(count, timeout=10)  # passes only if all run at once
    threads = CallThreads("many", linger=30)
    futures = [threads.run(together.wait) for _ in range(count)]
    assert sorted(future.result(10) for future in futures) == list(range(count))
    assert threads.threads() == count


def test_a_call_that_raises_gives_its_error_and_the_thread_serves_on() -> None:
    threads = CallThreads("errors", linger=30)

    def fails() -> None:
        raise ValueError("no")

    def interrupted() -> None:
        raise KeyboardInterrupt

    assert isinstance(threads.run(fails).exception(10), ValueError)
    assert isinstance(threads.run(interrupted).exception(10), KeyboardInterrupt)
    assert threads.run(lambda: "served").result(10) == "served"
    assert threads.threads() == 1


def test_idle_threads_end_after_their_linger() -> None:
    threads = CallThreads("linger", linger=0.05)
    together = threading.Barrier(3, timeout=10)
    for future in [threads.run(together.wait) for _ in range(3)]:
        future.result(10)
    _eventually(lambda: threads.threads() == 0)
    assert threads.run(lambda: "again").result(10) == "again", "a new thread when none is left"


def test_wait_quiet_waits_for_the_calls_in_flight() -> None:
    threads = CallThreads("quiet", linger=30)
    release = threading.Event()
    future = threads.run(lambda: release.wait(10))
    assert not threads.wait_quiet(0.05)
    release.set()
    assert threads.wait_quiet(10)
    assert future.result(0) is True


def test_bursts_against_threads_giving_up_run_every_call_exactly_once() -> None:
    """Idle threads end within a millisecond, so calls are often handed to a thread
    as it gives up: each must still run, once."""
    threads = CallThreads("bursts", linger=0.001)
    rng = random.Random(7)
    ran: list[int] = []
    lock = threading.Lock()

    def call(number: int) -> int:
        with lock:
            ran.append(number)
        if rng.random() < 0.3:
            time.sleep(0.0005)
        return number

    number = 0
    futures = []
    for _ in range(300):
        for _ in range(rng.randint(1, 6)):
            futures.append(threads.run(lambda n=number: call(n)))  # type: ignore[misc]
            number += 1
        time.sleep(rng.choice([0.0, 0.0005, 0.001, 0.002]))
    assert [future.result(10) for future in futures] == list(range(number))
    assert sorted(ran) == list(range(number)), "each call ran exactly once"
    assert threads.wait_quiet(10)
    _eventually(lambda: threads.threads() == 0)


def test_a_call_handed_to_a_thread_as_its_wait_runs_out_is_still_run() -> None:
    """The race the bursts above make now and then, made every time: the call comes
    in as the idle thread's wait for one runs out, before it gives up."""
    threads = CallThreads("handed", linger=30)
    real = threads._calls
    handed: list[Future[Any]] = []

    class RunsOutAsACallComes:
        def put(self, item: Any) -> None:
            real.put(item)

        def get(self, timeout: float) -> Any:
            if not handed:
                handed.append(threads.run(lambda: "handed"))  # to this thread, idle now
                raise queue.Empty
            return real.get(timeout=timeout)

    threads._calls = RunsOutAsACallComes()  # type: ignore[assignment]
    assert threads.run(lambda: "first").result(10) == "first"
    _eventually(lambda: bool(handed))
    assert handed[0].result(10) == "handed"
    assert threads.threads() == 1, "the same thread ran it"


def test_a_call_cancelled_before_a_thread_takes_it_never_runs() -> None:
    threads = CallThreads("cancel", linger=30)
    assert threads.run(lambda: "first").result(10) == "first"  # one thread, idle now
    real = threads._calls
    held: list[Any] = []

    class Held:
        def put(self, item: Any) -> None:
            held.append(item)

        def get(self, timeout: float) -> Any:
            return real.get(timeout=timeout)

    threads._calls = Held()  # type: ignore[assignment]
    ran: list[str] = []
    future = threads.run(lambda: ran.append("ran"))
    assert future.cancel(), "not taken yet: it can be cancelled"
    real.put(held.pop())  # the idle thread takes it now
    assert threads.wait_quiet(10)
    assert ran == []
    threads._calls = real
    assert threads.run(lambda: "after").result(10) == "after"
    assert threads.threads() == 1


def test_a_new_thread_refused_by_the_system_is_a_clear_error_and_leaves_no_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads = CallThreads("refused", linger=30)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        threads.run(lambda: None)
    monkeypatch.undo()
    assert threads.threads() == 0
    assert threads.wait_quiet(0), "no call counted in flight"
    assert threads.run(lambda: "fine").result(10) == "fine"


def test_asyncio_run_returns_once_a_drive_whose_caller_gave_up_has_ended(
    tmp_path: Path,
) -> None:
    """As it waited for `asyncio.to_thread`'s threads: the drive ends before the
    interpreter's shutdown, where a step using a thread pool would fail (pools refuse
    new work then), and before a store closed after `asyncio.run` is closed."""
    script = textwrap.dedent(
        """
        import asyncio, time
        from concurrent.futures import ThreadPoolExecutor
        from loom_kernel import Context, Engine, MemoryStore, flow

        def uses_a_pool():
            with ThreadPoolExecutor(1) as pool:
                return pool.submit(lambda: "fetched").result()

        @flow(name="slow")
        def slow(ctx: Context, _input: object) -> object:
            ctx.step("nap", lambda: time.sleep(0.5))
            return ctx.step("fetch", uses_a_pool)

        engine = Engine(MemoryStore(), [slow], listeners=[])

        async def main() -> None:
            try:
                await asyncio.wait_for(engine.start_async("slow", key="s"), 0.05)
            except asyncio.TimeoutError:
                print("gave up")

        asyncio.run(main())
        print(engine.get("s").status.value, engine.get("s").result)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["gave up", "completed fetched"], done.stdout


def test_asyncio_run_waits_for_a_start_left_running_when_its_main_returns() -> None:
    """A start whose task asyncio.run itself cancels as it shuts down (fire and
    forget): the drive is awaited all the same, and ends before asyncio.run returns."""

    @flow(name="threads.slow")
    def slow(ctx: Context, _input: Any) -> Any:
        ctx.step("nap", lambda: time.sleep(0.3))
        return ctx.step("after", lambda: "done")

    engine = Engine(MemoryStore(), [slow], listeners=[])

    async def main() -> None:
        asyncio.get_running_loop().create_task(engine.start_async("threads.slow", key="s"))
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert engine.get("s").result == "done"


def test_a_call_awaited_to_its_end_logs_no_failure_its_caller_saw(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def fails() -> None:
        raise ValueError("seen")

    async def main() -> None:
        with pytest.raises(ValueError, match="seen"):
            await in_a_thread(fails)
        await asyncio.sleep(0.01)  # the task awaiting it to its end is done

    with caplog.at_level(logging.WARNING, logger="loom"):
        asyncio.run(main())
    assert "stopped awaiting" not in caplog.text


def test_a_call_its_caller_gave_up_on_is_awaited_through_cancels_and_its_failure_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()

    def blocked() -> None:
        assert release.wait(10)
        raise ValueError("failed late")

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(in_a_thread(blocked), 0.05)
        (guard,) = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        guard.cancel()  # as asyncio.run cancels what is left: it goes on awaiting
        await asyncio.sleep(0.05)
        assert not guard.done()
        release.set()
        await asyncio.wait_for(guard, 10)

    with caplog.at_level(logging.WARNING, logger="loom"):
        asyncio.run(main())
    assert "a call its caller stopped awaiting failed: ValueError: failed late" in caplog.text


def test_a_loop_let_go_stops_awaiting_and_wait_quiet_bounds_the_wait_for_its_calls() -> None:
    """A worker's loop: its teardown does not wait for the calls its tasks gave up on;
    its stop waits for them by tag, for a bounded time."""
    release = threading.Event()
    loop = asyncio.new_event_loop()

    async def gives_up() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(in_a_thread(release.wait, 10), 0.05)

    try:
        loop.run_until_complete(gives_up())
        let_go(loop)
        left = asyncio.all_tasks(loop)
        assert len(left) == 1
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.wait_for(asyncio.gather(*left), 10))
        assert not call_threads().wait_quiet(0.05, tag=loop), "the call still runs"
        assert call_threads().wait_quiet(0, tag=object()), "another tag's count is its own"
        release.set()
        assert call_threads().wait_quiet(10, tag=loop)
    finally:
        release.set()
        loop.close()


def test_a_forked_child_starts_with_no_threads_of_its_parents_and_calls_again() -> None:
    script = textwrap.dedent(
        """
        import asyncio, os, threading
        from loom_kernel._replay._threads import call_threads, in_a_thread

        release = threading.Event()
        threads = call_threads()
        threads.run(lambda: "warm").result(10)  # an idle thread, in the parent only
        threads.run(lambda: release.wait(10))  # and a call in flight
        pid = os.fork()
        if pid == 0:
            fresh = call_threads()
            called = asyncio.run(asyncio.wait_for(in_a_thread(lambda: 7), 10))
            ok = fresh is not threads and called == 7
            ok = ok and fresh.wait_quiet(10)
            os._exit(0 if ok else 1)
        release.set()
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


def test_a_worker_stop_waits_a_bounded_time_for_a_start_async_its_flow_gave_up_on() -> None:
    """A step of a worker's async flow gives up on the child it started: the child's
    drive goes on; the stop waits for it for `grace` only, and says it is left."""
    release = threading.Event()

    @flow(name="threads.child")
    def child(ctx: Context, _input: Any) -> Any:
        return ctx.step("long", lambda: release.wait(30))

    async def kick(engine: Engine) -> str:
        try:
            await asyncio.wait_for(engine.start_async("threads.child", key="c"), 0.1)
        except TimeoutError:
            return "gave up"
        return "waited"

    @flow(name="threads.parent")
    async def parent(ctx: AsyncContext, _input: Any) -> Any:
        return await ctx.step("kick", kick, ctx.engine)

    engine = Engine(MemoryStore(), [child, parent], listeners=[])
    worker = Worker(engine, grace=0.2).start()
    try:
        assert engine.enqueue("threads.parent", key="p").result(timeout=30) == "gave up"
        began = time.monotonic()
        worker.stop()
        assert time.monotonic() - began < 20, "bounded by the grace, not by the child"
        assert worker._threads_left
    finally:
        release.set()
        worker.stop()
    assert engine.handle("c").result(timeout=30) is True


def test_a_loop_closed_under_a_call_leaves_nothing_held_once_the_call_ends() -> None:
    from loom_kernel._replay import _threads

    release = threading.Event()
    loop = asyncio.new_event_loop()
    before = len(_threads._awaiting)

    async def gives_up() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(in_a_thread(release.wait, 10), 0.05)

    loop.run_until_complete(gives_up())
    loop.close()  # its task awaiting the call never runs again
    assert len(_threads._awaiting) == before + 1
    release.set()
    assert call_threads().wait_quiet(10, tag=loop)
    _eventually(lambda: len(_threads._awaiting) == before)


def test_a_process_exits_after_a_worker_stop_left_a_start_async_that_never_ends() -> None:
    """The stop's wait for the flows' calls runs on a daemon thread: a call that never
    returns holds neither the stop past its grace nor the interpreter's exit."""
    script = textwrap.dedent(
        """
        import asyncio, threading
        from loom_kernel import AsyncContext, Context, Engine, MemoryStore, Worker, flow

        began, never = threading.Event(), threading.Event()

        @flow(name="child")
        def child(ctx: Context, _input: object) -> object:
            return ctx.step("forever", lambda: (began.set(), never.wait()))

        async def kick(engine: Engine) -> str:
            try:
                await asyncio.wait_for(engine.start_async("child", key="c"), 0.1)
            except TimeoutError:
                return "gave up"
            return "waited"

        @flow(name="parent")
        async def parent(ctx: AsyncContext, _input: object) -> object:
            return await ctx.step("kick", kick, ctx.engine)

        engine = Engine(MemoryStore(), [child, parent], listeners=[])
        worker = Worker(engine, grace=0.2).start()
        print(engine.enqueue("parent", key="p").result(timeout=30))
        assert began.wait(30)
        worker.stop()
        print("stopped", bool(worker._threads_left))
        """
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
        )
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the process did not exit after its worker stopped: {hung.stdout!r}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["gave up", "stopped True"], done.stdout


def test_calls_in_flight_are_counted_one_by_one() -> None:
    """Two calls of a tag in flight, one ends: the tag is not quiet until the other
    does (and the untagged count holds both)."""
    threads = CallThreads("counted", linger=30)
    tag = object()
    first, second = threading.Event(), threading.Event()
    calls = [threads.run(first.wait, tag), threads.run(second.wait, tag)]
    try:
        first.set()
        calls[0].result(10)
        assert not threads.wait_quiet(0.05, tag=tag), "one is still in flight"
        assert not threads.wait_quiet(0.05), "so is it without a tag"
    finally:
        second.set()
    calls[1].result(10)
    assert threads.wait_quiet(10, tag=tag)
    assert threads.wait_quiet(10)


def test_an_idle_thread_keeps_nothing_of_its_last_call_alive() -> None:
    import gc
    import weakref

    class Argument:
        """What a call was given (a large request, say)."""

    threads = CallThreads("forgets", linger=30)
    argument = Argument()
    gone = weakref.ref(argument)
    assert threads.run([argument].__len__).result(10) == 1
    del argument

    def collected() -> bool:
        gc.collect()
        return gone() is None

    _eventually(collected)
    assert threads.threads() == 1, "the thread is still there, idle"
