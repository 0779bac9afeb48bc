"""Async flows: the same journal, and concurrent steps replay whatever order they finished in."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel import (
    AsyncContext,
    Engine,
    Flow,
    MemoryStore,
    RetryPolicy,
    Status,
    StepFailedError,
    flow,
)
from loom_kernel.testing import FakeClock

#: Each test runs with a loop per drive and on one loop of another thread.
pytestmark = pytest.mark.usefixtures("flow_loop")


class Crash(BaseException):
    """Stands in for the process dying mid-flow: nothing in the engine catches it."""


def test_async_flow_with_sync_and_async_steps() -> None:
    async def fetch(value: int) -> int:
        await asyncio.sleep(0)
        return value * 2

    @flow
    async def mixed(ctx: AsyncContext, value: int) -> Any:
        doubled = await ctx.step("fetch", fetch, value)
        plain = await ctx.step("plain", lambda: value + 1)
        gate = await ctx.suspend("approve")
        await ctx.sleep(0)
        return [doubled, plain, gate, ctx.now() > 0]

    store = MemoryStore()
    ex = Engine(store, [mixed]).start("mixed", 5)
    assert ex.waiting_on == "approve"
    done = Engine(store, [mixed]).resume(ex.id, "yes")
    assert done.result == [10, 6, "yes", True]


def test_async_flow_can_be_driven_from_inside_a_running_loop() -> None:
    @flow
    async def inner(ctx: AsyncContext, _input: Any) -> str:
        return await ctx.step("s", lambda: "ok")  # type: ignore[no-any-return]

    async def caller() -> Any:
        return Engine(MemoryStore(), [inner]).start("inner").result

    assert asyncio.run(caller()) == "ok"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    count=st.integers(2, 6),
    crash_after=st.integers(0, 5),
    seed=st.integers(),
)
def test_gathered_steps_replay_whatever_order_they_finished_in(
    count: int, crash_after: int, seed: int
) -> None:
    """DBOS's failure mode: checkpoints in completion order, then an unexpected-step error on
    recovery. Here a step's identity is its call order, so recovery after a crash between
    completions finds every finished step and runs only the rest."""
    ran: list[int] = []
    finished: list[int] = []
    crash = [crash_after]

    rng = random.Random(seed)

    async def work(number: int) -> int:
        for _ in range(rng.randint(0, 5)):  # a different finishing order on every run
            await asyncio.sleep(0)
        if len(finished) == crash[0]:
            crash[0] = -1
            raise Crash
        ran.append(number)
        finished.append(number)
        return number * 10

    @flow
    async def fan_out(ctx: AsyncContext, count: int) -> Any:
        results = await asyncio.gather(*(ctx.step(f"work-{n}", work, n) for n in range(count)))
        return list(results)

    store = MemoryStore()
    engine = Engine(store, [fan_out], clock=FakeClock(), retry=RetryPolicy(attempts=1))
    try:
        engine.start("fan_out", count, key="fan")
    except Crash:
        engine = Engine(store, [fan_out], clock=FakeClock(), retry=RetryPolicy(attempts=1))
        assert engine.recover() == ["fan"]
    done = engine.get("fan")
    assert done.status is Status.COMPLETED
    assert done.result == [n * 10 for n in range(count)]
    assert sorted(ran) == list(range(count)), "every step ran exactly once"
    completed = [r for r in store.read("ex/fan") if r.kind == "STEP_COMPLETED"]
    assert len(completed) == count, "no step journaled twice"


def test_async_step_failure_is_catchable() -> None:
    async def boom() -> None:
        raise RuntimeError("nope")

    @flow
    async def careful(ctx: AsyncContext, _input: Any) -> str:
        try:
            await ctx.step("boom", boom, retry=RetryPolicy(attempts=2, backoff=0))
        except Exception as exc:
            return type(exc).__name__
        return "unreachable"

    engine = Engine(MemoryStore(), [careful], sleep=lambda _s: None)
    assert engine.start("careful").result == "StepFailedError"


def test_an_async_flows_steps_are_tried_as_the_policy_says_and_count_their_tries() -> None:
    """Sync and async step functions alike: a first try that succeeds is attempt 1, a
    step that fails twice is tried a third time under attempts=3 and journals 3; one
    that keeps failing is tried exactly `attempts` times."""
    tries: dict[str, int] = {}

    def flaky(name: str, failures: int) -> Any:
        def run() -> str:
            tries[name] = tries.get(name, 0) + 1
            if tries[name] <= failures:
                raise RuntimeError(f"{name} try {tries[name]}")
            return name

        return run

    def asynchronous(call: Any) -> Any:
        async def run() -> Any:
            return call()

        return run

    policy = RetryPolicy(attempts=3, backoff=0)

    @flow(name="async.tries")
    async def tries_flow(ctx: AsyncContext, _input: Any) -> Any:
        done = [
            await ctx.step("first", flaky("first", 0), retry=policy),
            await ctx.step("third", flaky("third", 2), retry=policy),
            await ctx.step("a-third", asynchronous(flaky("a-third", 2)), retry=policy),
        ]
        try:
            await ctx.step("never", flaky("never", 99), retry=policy)
        except StepFailedError:
            done.append("failed")
        return done

    store = MemoryStore()
    engine = Engine(store, [tries_flow], sleep=lambda _s: None, listeners=[])
    run = engine.start("async.tries", key="t")
    assert run.result == ["first", "third", "a-third", "failed"]
    assert tries == {"first": 1, "third": 3, "a-third": 3, "never": 3}
    from loom_kernel.events import StepCompleted

    attempts = {
        entry.event.name: entry.event.attempts
        for entry in engine.history("t")
        if isinstance(entry.event, StepCompleted)
    }
    assert attempts == {"first": 1, "third": 3, "a-third": 3}


@pytest.mark.parametrize("payloads", [["a", "b", "c"]])
def test_async_multi_gate(payloads: list[str]) -> None:
    @flow
    async def gates(ctx: AsyncContext, _input: Any) -> Any:
        return [await ctx.suspend(f"g{n}") for n in range(3)]

    engine = Engine(MemoryStore(), [gates])
    ex = engine.start("gates")
    for payload in payloads:
        last = engine.resume(ex.id, payload)
    assert last.result == payloads


def _async_ship(with_patch: bool, ran: list[str]) -> Any:
    @flow(name="async_ship", version="1")
    async def ship(ctx: AsyncContext, _input: Any) -> Any:
        await ctx.step("pack", lambda: "packed")
        if with_patch and ctx.patched("insure"):
            await ctx.step("insure", lambda: ran.append("insured"))
        label = await ctx.suspend("label")
        return [label, await ctx.suspend("delivered")]

    return ship


def test_patched_in_an_async_flow_is_false_for_history_and_true_for_new_runs() -> None:
    ran: list[str] = []
    store = MemoryStore()
    old = Engine(store, [_async_ship(False, ran)]).start("async_ship", key="old")
    assert old.waiting_on == "label"
    engine = Engine(store, [_async_ship(True, ran)])
    assert engine.resume("old", "L1").waiting_on == "delivered"
    assert ran == [], "history from before the patch replays without the new step"
    new = engine.start("async_ship", key="new")
    assert ran == ["insured"]
    assert [f.name for f in engine.frames(new.id).values()] == [
        "pack",
        "loom.patched:insure",
        "insure",
    ]
    fresh = Engine(store, [_async_ship(True, ran)])
    fresh.resume("new", "L2")
    assert fresh.resume("new", "ok").result == ["L2", "ok"]
    assert ran == ["insured"], "a replay of the new run takes the patched branch again"


def test_a_typed_async_step_is_structured_again_when_it_replays() -> None:
    import attrs

    @attrs.frozen
    class Quote:
        price: int
        currency: str

    @flow(name="typed", version="1")
    async def typed(ctx: AsyncContext, _input: Any) -> Any:
        quote = await ctx.step("quote", lambda: Quote(10, "EUR"), returns=Quote)
        assert isinstance(quote, Quote)
        go = await ctx.suspend("go")
        return [quote.price, quote.currency, go]

    store = MemoryStore()
    Engine(store, [typed]).start("typed", key="t")
    done = Engine(store, [typed]).resume("t", "yes")  # a new engine: the step replays
    assert done.status is Status.COMPLETED, done.error
    assert done.result == [10, "EUR", "yes"]


def test_a_failure_out_of_a_task_group_fails_the_run_with_the_group() -> None:
    async def boom() -> None:
        raise ValueError("child failed")

    @flow(name="grouped_failure", version="1")
    async def grouped(ctx: AsyncContext, _input: Any) -> Any:
        await ctx.step("before", lambda: 1)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(boom())
        return "unreached"

    store = MemoryStore()
    failed = Engine(store, [grouped]).start("grouped_failure", key="f")
    assert failed.status is Status.FAILED
    assert failed.error is not None
    assert failed.error.type == "ExceptionGroup"
    assert [record.kind for record in store.read("ex/f")][-1] == "EXECUTION_FAILED"


def test_a_group_of_base_exceptions_out_of_a_flow_is_a_crash_not_a_failure() -> None:
    @flow(name="grouped_crash", version="1")
    async def grouped(ctx: AsyncContext, _input: Any) -> Any:
        await ctx.step("before", lambda: 1)
        raise BaseExceptionGroup("the process goes down", [Crash()])

    store = MemoryStore()
    with pytest.raises(BaseExceptionGroup) as caught:
        Engine(store, [grouped]).start("grouped_crash", key="c")
    assert caught.group_contains(Crash)
    assert Engine(store, [grouped]).get("c").status is Status.RUNNING
    assert [record.kind for record in store.read("ex/c")] == [
        "EXECUTION_STARTED",
        "STEP_COMPLETED",
    ]


def test_an_async_step_renamed_since_it_was_recorded_is_a_divergence() -> None:
    from loom_kernel import NonDeterminismError

    @flow(name="renamed", version="1")
    async def recorded(ctx: AsyncContext, _input: Any) -> Any:
        first = await ctx.step("quote", lambda: 10)
        return [first, await ctx.suspend("go")]

    @flow(name="renamed", version="1")
    async def changed(ctx: AsyncContext, _input: Any) -> Any:
        first = await ctx.step("price", lambda: 20)
        return [first, await ctx.suspend("go")]

    store = MemoryStore()
    Engine(store, [recorded]).start("renamed", key="r")
    with pytest.raises(NonDeterminismError, match=r"step #0 was recorded as 'quote'.*'price'"):
        Engine(store, [changed]).resume("r", "ok")
    assert [record.kind for record in store.read("ex/r")][-1] == "EXECUTION_SUSPENDED"


def test_a_flow_made_directly_is_driven_as_sync_unless_it_says_async() -> None:
    direct = Flow("direct", lambda ctx, number: ctx.step("double", lambda: number * 2))
    assert direct.is_async is False
    assert Engine(MemoryStore(), [direct], listeners=[]).start("direct", 21).result == 42
