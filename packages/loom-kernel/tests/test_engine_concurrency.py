"""Threads and one engine: no deadlock between unrelated runs, reads and cancels never
wait for a drive, and a cancel stops a run before its next step."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from loom_kernel import AsyncContext, Context, Engine, Execution, MemoryStore, Status, flow
from loom_kernel._engine._locks import KeyedLocks
from loom_kernel.spi import JournalStore

WAIT = 20.0  # seconds a thread may take before the test calls it stuck


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run `call` in a daemon thread (a deadlocked one cannot hang the test run)."""
    box: list[Any] = []

    def body() -> None:
        try:
            box.append(call())
        except BaseException as exc:  # handed to the test
            box.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, box


def _finished(thread: threading.Thread, box: list[Any], what: str) -> Any:
    thread.join(WAIT)
    assert not thread.is_alive(), f"{what} did not finish within {WAIT} s (a deadlock)"
    (value,) = box
    if isinstance(value, BaseException):
        raise value
    return value


def _crosswise_ids() -> tuple[str, str, str, str]:
    """Parent and child ids where each parent's old lock stripe (hash % 64) is the
    other parent's child's: the engine used to deadlock on exactly these."""
    stripe: dict[int, list[str]] = {}
    for number in range(100_000):
        stripe.setdefault(hash(f"p{number}") % 64, []).append(f"p{number}")
    for number in range(100_000):
        first = f"p{number}"
        child_of_first = f"{first}/c1"
        for second in stripe.get(hash(child_of_first) % 64, []):
            if second != first and hash(f"{second}/c1") % 64 == hash(first) % 64:
                return first, child_of_first, second, f"{second}/c1"
    raise AssertionError("no crosswise ids found")  # pragma: no cover


def test_two_parents_whose_children_hash_crosswise_do_not_deadlock() -> None:
    first, first_child, second, second_child = _crosswise_ids()
    both_parents_in = threading.Barrier(2, timeout=WAIT)

    @flow
    def child(ctx: Context, _input: Any) -> str:
        return "child done"

    @flow
    def parent(ctx: Context, _input: Any) -> Any:
        ctx.step("meet", both_parents_in.wait)  # each parent now holds its own lock
        return ctx.step(
            "child", lambda: ctx.engine.start("child", key=f"{ctx.execution_id}/c1").result
        )

    engine = Engine(MemoryStore(), [parent, child], listeners=[])
    runs = [_in_thread(partial(engine.start, "parent", key=key)) for key in (first, second)]
    for thread, box in runs:
        assert _finished(thread, box, "a parent").result == "child done"
    assert {engine.get(first_child).status, engine.get(second_child).status} == {Status.COMPLETED}


def test_an_async_flow_in_a_running_loop_can_look_at_its_own_run() -> None:
    @flow
    async def introspective(ctx: AsyncContext, _input: Any) -> Any:
        status = await ctx.step("look", lambda: str(ctx.engine.get(ctx.execution_id).status))
        return status

    engine = Engine(MemoryStore(), [introspective], listeners=[])

    async def caller() -> Execution:
        return engine.start("introspective")  # inside a running event loop

    thread, box = _in_thread(lambda: asyncio.run(caller()))
    assert _finished(thread, box, "the async flow").result == "running"


def _blocking_flow(entered: threading.Event, release: threading.Event, later: list[str]) -> Any:
    @flow
    def slow(ctx: Context, _input: Any) -> str:
        def wait() -> str:
            entered.set()
            assert release.wait(WAIT)
            return "first"

        ctx.step("first", wait)

        def second() -> str:
            later.append("second ran")
            return "second"

        ctx.step("second", second)
        return "done"

    return slow


class UncheckedHeadStore(MemoryStore):
    """A store whose head the engine does not look at before each step (as on S3)."""

    head_is_cheap = False


@pytest.mark.parametrize("store_class", [MemoryStore, UncheckedHeadStore])
def test_cancel_from_the_driving_engine_stops_the_run_before_its_next_step(
    store_class: type[JournalStore],
) -> None:
    entered, release = threading.Event(), threading.Event()
    later: list[str] = []
    slow = _blocking_flow(entered, release, later)
    engine = Engine(store_class(), [slow], listeners=[])
    drive, drive_box = _in_thread(lambda: engine.start("slow", key="slow-1"))
    assert entered.wait(WAIT)
    cancelling, cancel_box = _in_thread(lambda: engine.cancel("slow-1", "enough"))
    cancelled = _finished(cancelling, cancel_box, "the cancel")  # while the step still runs
    assert cancelled.status is Status.CANCELLED
    assert engine.get("slow-1").status is Status.CANCELLED, "a read does not wait for the drive"
    release.set()
    assert _finished(drive, drive_box, "the drive").status is Status.CANCELLED
    assert later == [], "no step starts after the cancel"
    assert sorted(engine.frames("slow-1")) == [], "the step in flight is not journaled"


def test_a_step_may_cancel_its_own_run() -> None:
    later: list[str] = []

    @flow
    def quitter(ctx: Context, _input: Any) -> str:
        ctx.step("quit", lambda: ctx.engine.cancel(ctx.execution_id, "from inside").id)
        ctx.step("after", later.append, "ran")
        return "done"

    engine = Engine(MemoryStore(), [quitter], listeners=[])
    thread, box = _in_thread(lambda: engine.start("quitter"))
    assert _finished(thread, box, "the run").status is Status.CANCELLED
    assert later == []


def test_a_key_held_by_one_thread_keeps_another_out_until_it_is_let_go() -> None:
    locks = KeyedLocks()
    release = threading.Event()
    held = threading.Event()
    entered = threading.Event()

    def first() -> None:
        with locks.hold("k"):
            held.set()
            release.wait(WAIT)

    def second() -> None:
        with locks.hold("k"):
            entered.set()

    holder, _ = _in_thread(first)
    assert held.wait(WAIT)
    waiter, _ = _in_thread(second)
    assert not entered.wait(0.2), "the second thread got in while the key was held"
    with locks.hold("other"):
        pass  # another key is free meanwhile
    release.set()
    assert entered.wait(WAIT), "the second thread got in once the key was let go"
    holder.join(WAIT)
    waiter.join(WAIT)
    assert len(locks) == 0


def test_keyed_locks_serialise_one_key_and_leave_nothing_behind() -> None:
    locks = KeyedLocks()
    inside: list[str] = []
    overlap: list[str] = []
    barrier = threading.Barrier(8)

    def worker(key: str) -> None:
        barrier.wait()
        for _ in range(200):
            with locks.hold(key):
                if key in inside:
                    overlap.append(key)
                inside.append(key)
                with locks.hold(key):  # reentrant in the same flow of control
                    pass
                inside.remove(key)

    threads = [threading.Thread(target=worker, args=(f"k{n % 2}",)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlap == []
    assert len(locks) == 0, "locks of keys no one holds are dropped"


def test_what_waits_for_a_release_runs_once_the_releasing_thread_holds_no_lock() -> None:
    """A callback that drives a run must not find its thread holding another run's
    lock (a parent's): it runs at the thread's outermost release."""
    locks = KeyedLocks()
    order: list[str] = []
    with locks.hold("parent"):
        with locks.hold("child"):
            assert locks.after_release("child", lambda: order.append("callback"))
        order.append("child released")
    order.append("parent released")
    assert order == ["child released", "callback", "parent released"]
    assert not locks.after_release("child", lambda: None), "nobody holds it now"
    assert len(locks) == 0


def test_callbacks_that_release_locks_run_one_after_another_never_nested() -> None:
    """Each would add stack frames: a chain of deliveries must not grow the stack."""
    locks = KeyedLocks()
    running: list[bool] = [False]
    seen: list[bool] = []

    def second() -> None:
        seen.append(running[0])

    def first() -> None:
        running[0] = True
        with locks.hold("x"):
            locks.after_release("x", second)
        running[0] = False

    with locks.hold("k"):
        locks.after_release("k", first)
    assert seen == [False], "the second ran after the first returned"
    assert len(locks) == 0
