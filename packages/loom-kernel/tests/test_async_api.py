"""The engine's async API: a drive never holds the caller's event loop, and an async
flow's code runs on the caller's loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
from loom_kernel import (
    AsyncContext,
    Context,
    Engine,
    ExecutionEndedError,
    InvalidArgumentError,
    MemoryStore,
    ResultTimeoutError,
    Status,
    flow,
)
from loom_kernel._replay import _servant, call_threads

T = TypeVar("T")
loops: list[asyncio.AbstractEventLoop] = []


@flow(name="api.on_loop")
async def on_loop(ctx: AsyncContext, _input: Any) -> Any:
    loops.append(asyncio.get_running_loop())
    first = await ctx.step("first", lambda: "one")
    message = await ctx.receive(timeout=60)
    return [first, message]


@flow(name="api.fails")
def fails(ctx: Context, _input: Any) -> Any:
    raise ValueError("no")


FLOWS = [on_loop, fails]


def test_start_async_of_a_sync_flow_never_holds_the_loop() -> None:
    loop_ran = threading.Event()

    @flow(name="api.needs_the_loop")
    def needs_the_loop(ctx: Context, _input: Any) -> Any:
        # Passes only if the caller's loop runs while this step does.
        return ctx.step("wait", lambda: loop_ran.wait(10))

    engine = Engine(MemoryStore(), [needs_the_loop], listeners=[])

    async def main() -> Any:
        async def meanwhile() -> None:
            await asyncio.sleep(0.01)
            loop_ran.set()

        ticker = asyncio.create_task(meanwhile())
        done = await engine.start_async("api.needs_the_loop")
        await ticker
        return done.result

    assert asyncio.run(main()) is True


def test_an_async_flow_runs_on_the_callers_loop_and_its_api_is_awaitable() -> None:
    loops.clear()
    engine = Engine(MemoryStore(), FLOWS, listeners=[])

    async def main() -> Any:
        caller = asyncio.get_running_loop()
        parked = await engine.start_async("api.on_loop", None, key="l")
        assert parked.status is Status.SUSPENDED
        await engine.send_async("l", "hi")
        handle = engine.handle("l")
        assert await handle.result_async(timeout=10) == ["one", "hi"]
        assert all(loop is caller for loop in loops), "every pass ran on the caller's loop"
        return len(loops)

    assert asyncio.run(main()) == 2


def test_an_async_flow_on_the_callers_loop_may_await_longer_than_a_loop_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_servant, "LOOP_CHECK", 0.01)  # the drive looks at the loop often

    @flow(name="api.slow")
    async def slow(ctx: AsyncContext, _input: Any) -> Any:
        return await ctx.step("slow", lambda: asyncio.sleep(0.15, result="slept"))

    engine = Engine(MemoryStore(), [slow], listeners=[])

    async def main() -> Any:
        return (await engine.start_async("api.slow")).result

    assert asyncio.run(main()) == "slept", "a running loop is no reason to stop the drive"


def test_resume_async_get_event_async_and_failures() -> None:
    @flow(name="api.gate")
    def gate(ctx: Context, _input: Any) -> Any:
        ctx.set_event("stage", "waiting")
        return ctx.suspend("go")

    engine = Engine(MemoryStore(), [*FLOWS, gate], listeners=[])

    async def main() -> None:
        await engine.start_async("api.gate", None, key="g")
        assert await engine.get_event_async("g", "stage") == "waiting"
        assert (await engine.resume_async("g", 5, on="go")).result == 5
        await engine.start_async("api.fails", None, key="f")
        with pytest.raises(ExecutionEndedError, match="ValueError"):
            await engine.handle("f").result_async(timeout=1)
        engine.enqueue("api.gate", None, key="never")
        with pytest.raises(ResultTimeoutError):
            await engine.handle("never").wait_async(timeout=0.05)

    asyncio.run(main())


def test_async_starts_at_once_run_side_by_side_on_threads() -> None:
    together = threading.Barrier(4, timeout=10)  # passes only if 4 drives run at once
    threads: set[int] = set()

    @flow(name="api.together")
    def side_by_side(ctx: Context, _input: Any) -> Any:
        threads.add(threading.get_ident())
        return ctx.step("s", lambda: together.wait() >= 0)

    engine = Engine(MemoryStore(), [side_by_side], listeners=[])

    async def main() -> list[Any]:
        done = await asyncio.gather(*(engine.start_async("api.together", n) for n in range(4)))
        return [execution.result for execution in done]

    assert asyncio.run(main()) == [True] * 4
    assert threading.get_ident() not in threads


def test_async_flows_nested_three_deep_under_start_async_do_not_deadlock() -> None:
    """The parent runs on the caller's loop; its inline child on a helper thread's loop;
    the grandchild must not be sent back to the caller's loop, which waits."""

    @flow(name="api.grandchild")
    async def grandchild(ctx: AsyncContext, value: int) -> Any:
        return await ctx.step("add", lambda: value + 1)

    @flow(name="api.child")
    async def child(ctx: AsyncContext, value: int) -> Any:
        started = await ctx.step("start", lambda: ctx.engine.start("api.grandchild", value).result)
        return started

    @flow(name="api.parent")
    async def parent(ctx: AsyncContext, value: int) -> Any:
        return await ctx.step("start", lambda: ctx.engine.start("api.child", value).result)

    engine = Engine(MemoryStore(), [grandchild, child, parent], listeners=[])
    outcome: list[Any] = []

    def main() -> None:
        async def run() -> Any:
            return (await engine.start_async("api.parent", 1)).result

        outcome.append(asyncio.run(run()))

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    thread.join(30)
    assert outcome == [2], "finished, not deadlocked"


def _with_one_default_thread(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run `main()` under `asyncio.run`, the loop's default executor one thread: the
    async API must not depend on it."""

    async def run() -> T:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        return await main()

    return asyncio.run(run())


def test_a_flow_awaiting_a_run_it_starts_async_never_waits_for_a_thread() -> None:
    """Ten parents at once, each awaiting in a step the start of a child: on a shared
    executor of a few threads, the parents held them all and the children waited for
    one forever."""

    @flow(name="api.kid")
    async def kid(ctx: AsyncContext, value: int) -> Any:
        return await ctx.step("double", _double, value)

    @flow(name="api.starts_a_kid")
    async def starts_a_kid(ctx: AsyncContext, value: int) -> Any:
        return await ctx.step("kid", _kid_result, ctx.engine, value)

    engine = Engine(MemoryStore(), [kid, starts_a_kid], listeners=[])

    async def main() -> list[Any]:
        parents = (engine.start_async("api.starts_a_kid", n) for n in range(10))
        done = await asyncio.wait_for(asyncio.gather(*parents), 30)
        return [execution.result for execution in done]

    assert _with_one_default_thread(main) == [2 * n for n in range(10)]


async def _double(value: int) -> int:
    return 2 * value


async def _kid_result(engine: Engine, value: int) -> Any:
    return (await engine.start_async("api.kid", value)).result


def test_async_starts_run_side_by_side_however_many_beyond_the_default_executor() -> None:
    """Twenty async runs at once, each waiting in its step until all twenty are there."""
    count = 20
    arrived = 0
    everyone: asyncio.Event | None = None

    async def meet() -> int:
        nonlocal arrived
        assert everyone is not None
        arrived += 1
        if arrived == count:
            everyone.set()
        await everyone.wait()
        return arrived

    @flow(name="api.meet")
    async def meeting(ctx: AsyncContext, _input: Any) -> Any:
        return await ctx.step("meet", meet)

    engine = Engine(MemoryStore(), [meeting], listeners=[])

    async def main() -> list[Any]:
        nonlocal everyone
        everyone = asyncio.Event()
        starts = (engine.start_async("api.meet") for _ in range(count))
        done = await asyncio.wait_for(asyncio.gather(*starts), 30)
        return [execution.result for execution in done]

    assert _with_one_default_thread(main) == [count] * count


def test_the_async_api_works_while_the_default_executor_is_busy() -> None:
    engine = Engine(MemoryStore(), FLOWS, listeners=[])
    release = threading.Event()

    async def main() -> Any:
        busy = asyncio.ensure_future(asyncio.to_thread(release.wait, 60))  # its one thread
        try:
            await asyncio.wait_for(engine.start_async("api.on_loop", key="w"), 30)
            waiting = asyncio.ensure_future(engine.handle("w").result_async(timeout=30))
            looking = asyncio.ensure_future(engine.get_event_async("w", "none", timeout=0.2))
            await asyncio.wait_for(engine.send_async("w", "hello"), 30)
            return await asyncio.wait_for(asyncio.gather(waiting, looking), 10)
        finally:
            release.set()
            await busy

    assert _with_one_default_thread(main) == [["one", "hello"], None]


def test_get_event_async_waits_between_looks_on_the_loop_holding_no_thread() -> None:
    @flow(name="api.publishes_later")
    def publishes_later(ctx: Context, _input: Any) -> Any:
        ctx.suspend("go")
        ctx.set_event("stage", "published")
        return ctx.suspend("end")

    engine = Engine(MemoryStore(), [publishes_later], listeners=[])
    threads = call_threads()

    async def main() -> list[Any]:
        await engine.start_async("api.publishes_later", key="p")
        waits = [
            asyncio.ensure_future(engine.get_event_async("p", "stage", timeout=30))
            for _ in range(5)
        ]
        deadline = time.monotonic() + 10
        while not threads.wait_quiet(0):  # five waits, and now and then no call at all
            assert time.monotonic() < deadline, "a thread was held through the wait"
            await asyncio.sleep(0.01)
        assert not any(wait.done() for wait in waits)
        await engine.resume_async("p", on="go")
        return await asyncio.wait_for(asyncio.gather(*waits), 30)

    assert asyncio.run(main()) == ["published"] * 5
    with pytest.raises(InvalidArgumentError, match="timeout"):
        asyncio.run(engine.get_event_async("p", "stage", timeout=-1))


@flow(name="api.parks")
def parks(ctx: Context, value: Any) -> Any:
    ctx.step("noted", lambda: value)
    ctx.set_event("seen", value)
    return ctx.suspend("go")


#: The calls that read or write the store: each has an `_async` twin (the rule in
#: `_engine/_twins.py`); the calls that touch no store have none.
STORE_CALLS = [
    *("start", "enqueue", "dispatch", "fork", "resume", "send", "cancel", "fire_due_timers"),
    *("recover", "get", "state", "frames", "history", "executions", "get_event"),
    *("get_events", "inbox", "queue", "replay_check", "resume_as", "compact", "gc"),
]
PURE_CALLS = ["register", "hosts", "newest", "stream_of", "handle", "add_listener"]


def test_every_call_that_touches_the_store_has_an_async_twin_and_no_other_does() -> None:
    for name in STORE_CALLS:
        assert asyncio.iscoroutinefunction(getattr(Engine, f"{name}_async")), name
    for name in PURE_CALLS:
        assert not hasattr(Engine, f"{name}_async"), name
    public = {name for name in dir(Engine) if not name.startswith("_")}
    twins = {name.removesuffix("_async") for name in public if name.endswith("_async")}
    assert twins == set(STORE_CALLS), "the rule, applied to all"

    engine = Engine(MemoryStore(), [parks], listeners=[])

    async def main() -> None:
        loop_thread = threading.get_ident()
        run = await engine.start_async("api.parks", 7, key="p")
        assert run.waiting_on == "go"
        assert (await engine.get_async("p")).id == "p"
        assert (await engine.state_async("p")).input == 7
        assert [frame.name for frame in (await engine.frames_async("p")).values()] == [
            "noted",
            "loom.event:seen",
        ]
        assert len(await engine.history_async("p")) == 4
        listing = await engine.executions_async(status="suspended")
        assert [execution.id for execution in listing] == ["p"], "a list, read on a thread"
        assert await engine.get_events_async("p") == {"seen": 7}
        assert await engine.get_event_async("p", "seen") == 7
        await engine.replay_check_async("p")
        assert await engine.compact_async("p") == 4
        assert (await engine.resume_async("p", "yes")).result == "yes"
        handle = await engine.enqueue_async("api.parks", 8, key="q")
        assert (await engine.cancel_async(handle.id, "not needed")).status is Status.CANCELLED
        assert await engine.recover_async() == []
        assert await engine.fire_due_timers_async() == []
        assert threading.get_ident() == loop_thread

    asyncio.run(main())


def test_an_async_twin_calls_a_subclasss_override() -> None:
    calls: list[str] = []

    class Audited(Engine):
        def get(self, execution_id: str) -> Any:
            calls.append(execution_id)
            return super().get(execution_id)

    engine = Audited(MemoryStore(), [parks], listeners=[])
    engine.start("api.parks", 1, key="a")
    asyncio.run(engine.get_async("a"))
    assert calls == ["a"]
