"""await_child and friends: results, failures, fan-out, and every wake-up interleaving."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from loom_kernel import Context, Engine, Execution, MemoryStore, Status, flow
from loom_kernel._engine import parts_of
from loom_kernel.spi import JournalStore
from loom_kernel.testing import FakeClock
from loom_orchestration import (
    ChildCancelledError,
    ChildFailedError,
    await_any,
    await_child,
    await_children,
    start_child,
)
from loom_orchestration import _children as children_module


@flow
def double(ctx: Context, value: int) -> int:
    return ctx.step("double", lambda: value * 2)  # type: ignore[no-any-return]


@flow
def approval(ctx: Context, request: Any) -> Any:
    decision = ctx.suspend("decide")
    return {"request": request, "decision": decision}


@flow
def broken(ctx: Context, _input: Any) -> Any:
    raise ValueError("card declined")


@flow
def parent(ctx: Context, value: int) -> Any:
    return {"child": await_child(ctx, double, value), "after": ctx.step("after", lambda: "ok")}


@flow
def asks_for_approval(ctx: Context, request: Any) -> Any:
    return await_child(ctx, approval, request)


@flow
def tolerant(ctx: Context, _input: Any) -> Any:
    try:
        await_child(ctx, broken, None)
    except ChildFailedError as exc:
        return {"caught": exc.error_type, "message": exc.error_message, "said": str(exc)}
    return "unreachable"


@flow
def cancel_tolerant(ctx: Context, _input: Any) -> Any:
    try:
        await_child(ctx, approval, "x")
    except ChildCancelledError as exc:
        return {"cancelled": exc.child_id, "reason": exc.reason}
    return "unreachable"


FLOWS = [double, approval, broken, parent, asks_for_approval, tolerant, cancel_tolerant]


def _engine(store: JournalStore | None = None) -> Engine:
    return Engine(store or MemoryStore(), FLOWS, clock=FakeClock())


class DeferringEngine(Engine):
    """Queues each 'parked or ended' check instead of running it, while `deferring`."""

    def __init__(self, immediate: list[bool]) -> None:
        super().__init__(MemoryStore(), FLOWS, clock=FakeClock())
        self.deferring = True
        self.immediate = immediate  # per check, in order: run it now, as a live process would
        self.pending: list[Execution] = []
        driver = parts_of(self).driver
        settled = driver.settled

        def deferred(
            execution: Execution, delivered: Callable[[Execution], None] | None = None
        ) -> Execution:
            if self.deferring and not (self.immediate and self.immediate.pop(0)):
                self.pending.append(execution)
                return execution
            return settled(execution, delivered)

        driver.settled = deferred  # type: ignore[method-assign]


def _resumes(engine: Engine, execution_id: str) -> list[Any]:
    return engine.state(execution_id).resume_payloads


def test_child_that_ends_inline_wakes_the_parent() -> None:
    engine = _engine()
    done = engine.start("parent", 21, key="p")
    assert done.status is Status.COMPLETED
    assert done.result == {"child": 42, "after": "ok"}
    assert engine.get("p/c0").parent == "p"
    assert len(_resumes(engine, "p")) == 1


def test_parent_waits_for_a_child_at_a_human_gate() -> None:
    engine = _engine()
    waiting = engine.start("asks_for_approval", {"amount": 5}, key="req")
    assert waiting.waiting_on == "child:req/c0"
    assert engine.get("req/c0").waiting_on == "decide"
    fresh = _engine(engine.store)  # another process resumes the child
    fresh.resume("req/c0", "yes")
    done = engine.get("req")
    assert done.status is Status.COMPLETED
    assert done.result == {"request": {"amount": 5}, "decision": "yes"}


def test_child_failure_and_cancellation_reach_the_parent() -> None:
    engine = _engine()
    assert engine.start("tolerant", key="t").result == {
        "caught": "ValueError",
        "message": "card declined",
        "said": "child 't/c0' failed: ValueError: card declined",
    }
    engine.start("cancel_tolerant", key="ct")
    engine.cancel("ct/c0", "no longer needed")
    assert engine.get("ct").result == {"cancelled": "ct/c0", "reason": "no longer needed"}


def test_a_replayed_parent_finds_the_same_child() -> None:
    engine = _engine()
    engine.start("asks_for_approval", "r", key="rp")
    for _ in range(3):
        _engine(engine.store).recover()
    assert [e.id for e in engine.executions()] == ["rp", "rp/c0"]


def test_the_child_survives_its_parent_and_can_still_be_resumed() -> None:
    @flow
    def fire_and_forget(ctx: Context, _input: Any) -> str:
        return start_child(ctx, approval, "later")

    engine = _engine()
    engine.register(fire_and_forget)
    done = engine.start("fire_and_forget", key="ff")
    assert done.status is Status.COMPLETED
    child = engine.get(done.result)
    assert child.status is Status.SUSPENDED
    assert engine.resume(child.id, "approved").result == {
        "request": "later",
        "decision": "approved",
    }


def test_a_cancelled_parents_abandoned_child_it_journaled_lives_on() -> None:
    """A parent cancelled after it journaled a child's start with the default
    on_parent_close="abandon": the child was known to it and was meant to outlive it,
    so it is left as it was (only children it never journaled go with it)."""

    @flow
    def starts_then_waits(ctx: Context, _input: Any) -> Any:
        child = start_child(ctx, approval, "kept")
        return [child, ctx.suspend("never")]

    engine = _engine()
    engine.register(starts_then_waits)
    waiting = engine.start("starts_then_waits", key="sw")
    assert waiting.status is Status.SUSPENDED
    (child,) = [run for run in engine.executions(prefix="sw/") if run.parent == "sw"]
    assert engine.cancel("sw").status is Status.CANCELLED
    assert engine.get(child.id).status is Status.SUSPENDED, "abandoned: it lives on"
    assert engine.resume(child.id, "yes").result == {"request": "kept", "decision": "yes"}


def test_on_parent_close_cancel_cancels_the_children() -> None:
    @flow
    def strict_parent(ctx: Context, _input: Any) -> str:
        return start_child(ctx, approval, "x", on_parent_close="cancel")

    engine = _engine()
    engine.register(strict_parent)
    done = engine.start("strict_parent", key="sp")
    assert engine.get(done.result).status is Status.CANCELLED


def test_await_children_and_await_any() -> None:
    @flow
    def fan_out(ctx: Context, _input: Any) -> Any:
        everyone = await_children(ctx, [(double, 1), (double, 2), (double, 3)])
        first = await_any(ctx, [(approval, "a"), (approval, "b")])
        return {"all": everyone, "first": first}

    engine = _engine()
    engine.register(fan_out)
    waiting = engine.start("fan_out", key="fo")
    assert waiting.waiting_on == "any:fo/c3|fo/c4"
    engine.resume("fo/c4", "b wins")
    engine.resume("fo/c3", "a too late")
    done = engine.get("fo")
    assert done.result == {
        "all": [2, 4, 6],
        "first": ["fo/c4", {"request": "b", "decision": "b wins"}],
    }
    assert len(_resumes(engine, "fo")) == 4  # three children, then one for the any-gate


def test_await_children_waits_for_every_child_then_raises_for_the_first_failed() -> None:
    """What docs/orchestration.md says: one child failing neither cancels the others nor
    wakes the parent early; once all have ended it raises for the first that failed,
    in the given order, and the others' results stay in their own runs."""

    @flow
    def fan_out_fails(ctx: Context, _input: Any) -> Any:
        try:
            return await_children(ctx, [(approval, "slow"), (broken, None), (broken, 2)])
        except ChildFailedError as exc:
            return {"failed": exc.child_id, "type": exc.error_type}

    engine = _engine()
    engine.register(fan_out_fails)
    waiting = engine.start("fan_out_fails", key="ff")
    assert waiting.status is Status.SUSPENDED, "a failed child does not end the wait"
    assert [engine.get(f"ff/c{i}").status for i in range(3)] == [
        Status.SUSPENDED,
        Status.FAILED,
        Status.FAILED,
    ]
    engine.resume("ff/c0", "approved")  # the last child ends: now the parent raises
    done = engine.get("ff")
    assert done.result == {"failed": "ff/c1", "type": "ValueError"}
    assert engine.get("ff/c0").result == {"request": "slow", "decision": "approved"}


# -- interleavings ---------------------------------------------------------------
#
# Listeners are deferred into a queue; a hypothesis-chosen schedule then interleaves
# the two sides' actions (start the parent, finish the child) with the checks each
# side makes afterwards, in any order, delivered twice, or lost to a crash.

Op = tuple[str, int]


@settings(max_examples=200, deadline=None)
@given(
    gated_child=st.booleans(),
    immediate=st.lists(st.booleans(), max_size=6),
    schedule=st.lists(
        st.tuples(st.sampled_from(["act", "check", "repeat", "crash"]), st.integers(0, 5)),
        max_size=14,
    ),
)
def test_every_interleaving_wakes_the_parent_exactly_once(
    gated_child: bool, immediate: list[bool], schedule: list[Op]
) -> None:
    engine = DeferringEngine(immediate)
    pending = engine.pending
    done_checks: list[Execution] = []

    flow_name = "asks_for_approval" if gated_child else "parent"
    actions: list[Callable[[], Execution]] = [lambda: engine.start(flow_name, 4, key="P")]
    if gated_child:
        actions.append(lambda: engine.resume("P/c0", "approved"))
    crashed = False
    for op, pick in schedule:
        if op == "act" and actions:
            actions.pop(0)()
        elif op == "check" and pending:
            execution = pending.pop(pick % len(pending))
            children_module.settle(engine, execution)
            done_checks.append(execution)
        elif op == "repeat" and done_checks:  # a notifier that crashed and re-delivers
            children_module.settle(engine, done_checks[pick % len(done_checks)])
        elif op == "crash" and pending:  # the process died before this check ran
            pending.pop(pick % len(pending))
            crashed = True
    for action in actions:
        action()
    if not crashed:
        while pending:  # everyone still gets to make their checks, in order
            children_module.settle(engine, pending.pop(0))
        assert engine.get("P").status is Status.COMPLETED, "a wake-up was lost without a crash"
    else:
        pending.clear()
        engine.deferring = False  # the recovering process runs the real listeners
        engine.recover()
    parent_view = engine.get("P")
    assert parent_view.status is Status.COMPLETED
    expected = (
        {"request": 4, "decision": "approved"} if gated_child else {"child": 8, "after": "ok"}
    )
    assert parent_view.result == expected
    gate_resumes = [
        p for p in _resumes(engine, "P") if isinstance(p, dict) and p.get("id") == "P/c0"
    ]
    assert len(gate_resumes) == 1, "the parent was woken exactly once"
    assert [e.id for e in engine.executions()] == ["P", "P/c0"], "exactly one child"


def test_redelivered_notice_never_feeds_a_later_gate() -> None:
    @flow
    def two_children(ctx: Context, _input: Any) -> Any:
        first = await_child(ctx, approval, 1)
        second = await_child(ctx, approval, 2)
        return [first["decision"], second["decision"]]

    engine = _engine()
    engine.register(two_children)
    engine.start("two_children", key="tc")
    engine.resume("tc/c0", "one")
    first_child = engine.get("tc/c0")
    for _ in range(
        3
    ):  # the first child's notice arrives again while the parent waits on the second
        children_module.settle(engine, first_child)
    assert engine.get("tc").waiting_on == "child:tc/c1"
    engine.resume("tc/c1", "two")
    assert engine.get("tc").result == ["one", "two"]


def test_start_child_refuses_a_bad_option() -> None:
    @flow
    def bad(ctx: Context, _input: Any) -> Any:
        return start_child(ctx, double, 1, on_parent_close="maybe")  # type: ignore[call-overload]

    engine = _engine()
    engine.register(bad)
    failed = engine.start("bad")
    assert failed.status is Status.FAILED
    assert failed.error is not None
    assert "on_parent_close is 'abandon' or 'cancel'" in failed.error.message


@flow(name="child_or_message")
def child_or_message(ctx: Context, request: Any) -> Any:
    from loom_orchestration import child_gate

    child = start_child(ctx, approval, request)
    woken = ctx.wait_first(gates=[child_gate(child)], topics=["withdraw"], timeout=600)
    return [woken.kind, woken.name, woken.value]


def test_wait_first_on_a_child_a_message_and_a_deadline() -> None:
    clock = FakeClock()
    store = MemoryStore()
    engine = Engine(store, [*FLOWS, child_or_message], clock=clock)
    engine.start("child_or_message", "a", key="by-child")
    assert engine.get("by-child").gates == ("child:by-child/c0",)
    engine.resume("by-child/c0", "yes")  # the child ends: its end resumes the parent's gate
    kind, name, outcome = engine.get("by-child").result
    assert (kind, name) == ("gate", "child:by-child/c0")
    assert (outcome["status"], outcome["result"]["decision"]) == ("completed", "yes")

    engine.start("child_or_message", "b", key="by-message")
    engine.send("by-message", "never mind", topic="withdraw")
    assert engine.get("by-message").result == ["message", "withdraw", "never mind"]
    engine.resume("by-message/c0", "late")  # the parent has moved on: nothing to deliver
    assert engine.get("by-message/c0").status is Status.COMPLETED

    engine.start("child_or_message", "c", key="by-deadline")
    clock.advance(600)
    engine.fire_due_timers()
    assert engine.get("by-deadline").result == ["timeout", None, None]

    engine.start("child_or_message", "d", key="ended-first")
    engine.resume("ended-first/c0", "quick")
    fresh = Engine(store, [*FLOWS, child_or_message], clock=clock)
    for execution_id in ("by-child", "by-message", "by-deadline", "ended-first"):
        fresh.replay_check(execution_id)
    assert engine.get("ended-first").result[0] == "gate"


@flow(name="quick_child_first")
def quick_child_first(ctx: Context, value: int) -> Any:
    from loom_orchestration import child_gate

    child = start_child(ctx, double, value)  # ends inline, before the parent parks
    return ctx.wait_first(gates=[child_gate(child)], topics=["stop"]).value["result"]


def test_wait_first_on_a_child_that_ended_before_the_parent_parked() -> None:
    engine = Engine(MemoryStore(), [*FLOWS, quick_child_first], clock=FakeClock())
    assert engine.start("quick_child_first", 4, key="q").result == 8


@flow(name="awaits_then_waits_first")
def awaits_then_waits_first(ctx: Context, request: Any) -> Any:
    from loom_orchestration import child_gate

    child = start_child(ctx, approval, request)
    first = ctx.suspend(child_gate(child))  # as await_child does
    again = ctx.wait_first(gates=[child_gate(child)], timeout=100)
    return [first["status"], again.kind, again.value["status"]]


def test_wait_first_on_a_child_awaited_before_still_gets_its_outcome() -> None:
    engine = Engine(MemoryStore(), [*FLOWS, awaits_then_waits_first], clock=FakeClock())
    engine.start("awaits_then_waits_first", "x", key="twice")
    engine.resume("twice/c0", "ok")
    assert engine.get("twice").result == ["completed", "gate", "completed"]


def test_children_run_side_by_side_on_a_workers_slots() -> None:
    import threading

    from loom_kernel import Worker

    together = threading.Barrier(4, timeout=10)  # passes only if the 4 children run at once

    @flow(name="meets")
    def meets(ctx: Context, number: int) -> Any:
        return ctx.step("meet", lambda: together.wait() >= 0 and number)

    @flow(name="fans_out")
    def fans_out(ctx: Context, count: int) -> Any:
        return await_children(ctx, [(meets, n) for n in range(count)])

    engine = Engine(MemoryStore(), [meets, fans_out], listeners=[])
    with Worker(engine, concurrency=5, idle_poll=0.05):
        handle = engine.enqueue("fans_out", 4, key="fan")
        assert handle.result(timeout=20) == [0, 1, 2, 3]


def test_async_children_of_an_async_parent_run_side_by_side_on_the_workers_loop() -> None:
    import asyncio
    import time

    from loom_kernel import AsyncContext, Worker

    arrived: list[asyncio.AbstractEventLoop] = []

    async def meet(number: int) -> int:
        arrived.append(asyncio.get_running_loop())
        deadline = time.monotonic() + 10
        while len(arrived) < 4 and time.monotonic() < deadline:  # all 4 at once, or fail
            await asyncio.sleep(0.001)
        assert len(arrived) >= 4, "the children did not run side by side"
        return number

    @flow(name="meets_async")
    async def meets_async(ctx: AsyncContext, number: int) -> Any:
        return await ctx.step("meet", meet, number)

    @flow(name="fans_out_async")
    async def fans_out_async(ctx: AsyncContext, count: int) -> Any:
        return await await_children(ctx, [(meets_async, n) for n in range(count)])

    engine = Engine(MemoryStore(), [meets_async, fans_out_async], listeners=[])
    with Worker(engine, concurrency=5, idle_poll=0.05):
        handle = engine.enqueue("fans_out_async", 4, key="fan")
        assert handle.result(timeout=20) == [0, 1, 2, 3]
    assert len({id(loop) for loop in arrived}) == 1, "every child ran on the worker's one loop"


@flow(name="async_parent")
async def async_parent(ctx: Any, value: int) -> Any:
    from loom_orchestration import child_gate

    one = await await_child(ctx, double, value)
    many = await await_children(ctx, [(double, 1), (double, 2)])
    first, result = await await_any(ctx, [(approval, "a"), (double, 3)])
    started = await start_child(ctx, approval, "later")
    woken = await ctx.wait_first(gates=[child_gate(started)], timeout=60)
    return [one, many, first, result, woken.value["result"]["decision"]]


def test_orchestration_is_awaitable_in_async_flows() -> None:
    engine = Engine(MemoryStore(), [*FLOWS, async_parent], clock=FakeClock())
    parked = engine.start("async_parent", 5, key="ap")
    assert parked.status is Status.SUSPENDED
    engine.resume("ap/c5", "yes")
    done = engine.get("ap")
    assert done.result == [10, [2, 4], "ap/c4", 6, "yes"], done
    engine.replay_check("ap")


def test_a_child_started_while_the_engines_worker_stops_runs_inline() -> None:
    import threading

    from loom_kernel import Worker

    release, held = threading.Event(), threading.Event()

    def hold() -> bool:
        held.set()
        return release.wait(10)

    @flow(name="holds_a_slot")
    def holds_a_slot(ctx: Context, _input: Any) -> Any:
        return ctx.step("hold", hold)

    engine = Engine(MemoryStore(), [*FLOWS, holds_a_slot], clock=FakeClock())
    worker = Worker(engine, concurrency=2, idle_poll=0.05, grace=10).start()
    engine.enqueue("holds_a_slot", None, key="busy")
    assert held.wait(5)
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    while not worker._stopping.is_set():  # stopping: the busy run keeps it in its grace
        pass
    done = engine.start("parent", 3, key="p")  # its child cannot go to the worker
    assert done.result == {"child": 6, "after": "ok"}
    release.set()
    stopper.join(10)


def test_a_child_awaited_twice_gives_its_outcome_to_each_wait() -> None:
    """As a Temporal child handle: each park at a child's gate gets its outcome, the
    second from a child that ended long before."""
    from loom_orchestration import child_gate

    @flow
    def waits_twice(ctx: Context, _input: Any) -> Any:
        child = start_child(ctx, approval, "x")
        first = ctx.suspend(child_gate(child))
        second = ctx.suspend(child_gate(child))
        return [first["result"]["decision"], second["result"]["decision"]]

    engine = _engine()
    engine.register(waits_twice)
    engine.start("waits_twice", key="w")
    engine.resume("w/c0", "yes")
    assert engine.get("w").result == ["yes", "yes"]
    children_module.settle(engine, engine.get("w/c0"))  # a notice again: a no-op
    assert len(_resumes(engine, "w")) == 2


def test_a_stray_resume_of_a_parent_waiting_for_its_child_leaves_it_waiting() -> None:
    """A resume meant for the child, sent to the parent, is not a child's outcome: the
    parent parks at the gate again, and the child's end still wakes it."""
    engine = _engine()
    engine.start("asks_for_approval", "r", key="p")
    assert engine.get("p").waiting_on == "child:p/c0"
    engine.resume("p", "approved")
    assert engine.get("p").waiting_on == "child:p/c0"
    engine.resume("p/c0", "yes")
    assert engine.get("p").result == {"request": "r", "decision": "yes"}
    _engine(engine.store).replay_check("p")


def test_a_run_with_a_childs_id_that_is_not_its_child_is_not_adopted() -> None:
    from loom_kernel import RetryPolicy
    from loom_orchestration import ChildIdTakenError

    engine = Engine(MemoryStore(), FLOWS, clock=FakeClock(), retry=RetryPolicy(attempts=1))
    engine.start("approval", "someone else's", key="p/c0")  # no parent
    run = engine.start("asks_for_approval", "r", key="p")
    assert run.status is Status.FAILED
    assert run.error is not None
    assert ChildIdTakenError.__name__ in run.error.message
    assert "is not a child of 'p'" in run.error.message


def test_a_parent_cancelled_while_it_starts_a_child_leaves_no_orphan() -> None:
    """The cancel lands while the start step runs (the child started, the step not yet
    journaled): the parent never knew of the child, so its end cancels it."""
    engine = _engine()

    @flow
    def starts_then_waits(ctx: Context, _input: Any) -> Any:
        return await_child(ctx, approval, "x", on_parent_close="cancel")

    original = engine.dispatch

    def start_then_cancel(*args: Any, **kwargs: Any) -> Any:
        started = original(*args, **kwargs)
        engine.cancel("o", "meanwhile")
        return started

    engine.dispatch = start_then_cancel  # type: ignore[method-assign]
    engine.register(starts_then_waits)
    engine.start("starts_then_waits", key="o")
    assert engine.get("o").status is Status.CANCELLED
    assert engine.get("o/c0").status is Status.CANCELLED


def test_bad_children_lists_fail_the_parent_with_a_loom_error() -> None:
    @flow
    def bad(ctx: Context, shape: str) -> Any:
        children: Any = {"bare": [double], "three": [(double, 1, 2)], "str": "double"}[shape]
        return await_children(ctx, children) if shape != "three" else await_any(ctx, children)

    engine = _engine()
    engine.register(bad)
    for shape in ("bare", "three", "str"):
        run = engine.start("bad", shape)
        assert run.status is Status.FAILED
        assert run.error is not None
        assert run.error.type == "loom_kernel.InvalidArgumentError"
