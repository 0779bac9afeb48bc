"""Who drives the run a message wakes: the sender; a worker its nudge has look again (a
sender that does not drive, or lacks the run's flow or its version, leaves the wake to
one); recover, for a sender that stopped before the wake; or whoever releases the run's
lock. A send or resume from inside a step never waits for ever on a run another drive
holds."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from loom_kernel import Context, Engine, MemoryStore, Status, flow
from loom_kernel._coordination import partition_of
from loom_kernel._engine import parts_of
from loom_kernel.testing import FakeClock
from message_helpers import FLOWS, _engine, two


def test_a_send_that_does_not_drive_leaves_the_wake_to_a_worker() -> None:
    from loom_kernel import Worker

    store = MemoryStore()
    engine = Engine(store, FLOWS, listeners=[], lease=600.0)  # sweeps are 5 minutes apart
    with Worker(Engine(store, FLOWS, listeners=[], lease=600.0), idle_poll=0.02) as worker:
        engine.start("inbox.two", None, key="w")
        deadline = time.monotonic() + 10
        while worker.stats.visited == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the worker has seen the run parked
        parts_of(engine).delivery.deliver = lambda _id: pytest.fail("the sender drove it")  # type: ignore[method-assign,assignment,misc]
        engine.send("w", "one", drive=False)
        engine.send("w", "two", drive=False)
        assert engine.handle("w").result(timeout=10) == ["one", "two"]


def test_a_worker_without_the_code_leaves_a_waiting_message_alone_and_writes_nothing() -> None:
    """Its visits find the message but cannot deliver it: a nudge from each would have
    the next poll visit again, an index record per poll for as long as no worker with
    the code runs. The sender's nudge is what has those workers look."""
    from loom_kernel import Worker

    @flow(name="inbox.unrelated")
    def unrelated(ctx: Context, _input: Any) -> Any:
        return None

    store = MemoryStore()
    engine = _engine(store)
    engine.start("inbox.two", None, key="x")
    engine.send("x", "one", drive=False)
    hints = f"runs/open/{partition_of('x')}"
    lacking = Engine(store, [unrelated], listeners=[], lease=600.0)
    with Worker(lacking, idle_poll=0.02) as worker:
        deadline = time.monotonic() + 10
        while worker.stats.visited == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        head = store.head(hints)
        time.sleep(0.3)  # about fifteen polls
        assert store.head(hints) == head, "its visits wrote to the run index"
        assert worker.stats.visited == 1
    with Worker(Engine(store, FLOWS, listeners=[], lease=600.0), idle_poll=0.02):
        engine.send("x", "two", drive=False)
        assert engine.handle("x").result(timeout=10) == ["one", "two"]


def test_a_second_nudge_stamped_like_the_first_still_has_the_worker_look() -> None:
    """Two nudges from a clock that did not move (a coarse clock, one stepped back, or
    two engines at one instant) are two index records: a worker that saw the first
    looks again at the second, instead of waiting for its next sweep (half a lease)."""
    from loom_kernel import Worker

    store, clock = MemoryStore(), FakeClock()  # the sender's clock never moves
    sender = _engine(store, clock)
    sender.start("inbox.two", None, key="x")
    with Worker(Engine(store, FLOWS, listeners=[], lease=600.0), idle_poll=0.02) as worker:
        sender.send("x", "one", drive=False)  # a nudge stamped at the sender's now
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
            sender.get("x").status is Status.SUSPENDED
            and len(sender.state("x").resume_keys) == 1
            and worker.stats.in_flight == 0
        ):
            time.sleep(0.01)
        assert len(sender.state("x").resume_keys) == 1, "the first message was not delivered"
        time.sleep(0.3)  # about fifteen polls: the worker has seen the first nudge's hint
        sender.send("x", "two", drive=False)  # a second nudge, stamped the same
        assert sender.handle("x").result(timeout=5) == ["one", "two"]


def test_an_engine_without_the_flow_sends_and_leaves_the_wake_to_one_that_has_it() -> None:
    store = MemoryStore()
    worker = _engine(store)
    web = Engine(store, [], listeners=[])  # a web process: no flows
    worker.start("inbox.two", None, key="w")
    assert web.send("w", "one") == 1, "sent, whatever the wake"
    assert web.recover() == [], "not its flow: left alone"
    assert worker.recover() == ["w"]
    assert worker.state("w").resume_payloads[0]["message"] == "one"


def test_a_send_from_an_engine_without_the_flow_has_a_running_worker_deliver_it_at_once() -> None:
    """The send nudges the run in the run index: a worker that looked at the parked run
    before (and whose next sweep is half an hour away) looks again at its next poll."""
    from loom_kernel import Worker

    store = MemoryStore()
    owner = Engine(store, [two], listeners=[], lease=3600.0)
    handle = owner.enqueue("inbox.two", None, key="w")
    web = Engine(store, [], listeners=[])  # a web process: no flows
    with Worker(owner, idle_poll=0.02) as worker:
        deadline = time.monotonic() + 10
        while owner.get("w").status is not Status.SUSPENDED and time.monotonic() < deadline:
            time.sleep(0.01)
        visited = worker.stats.visited
        assert web.send("w", "one") == 1
        assert web.send("w", "two") == 2
        assert handle.result(timeout=10) == ["one", "two"]
        # The visit is counted once its drive is over, which may be just after the
        # run's end shows.
        deadline = time.monotonic() + 10
        while worker.stats.visited <= visited and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.stats.visited > visited, "looked at again"


def test_an_engine_with_another_version_of_the_flow_sends_and_leaves_the_wake_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run pinned to code the sending engine lacks (it has the flow, at another
    version) is not driven by that engine: the message waits, nothing is journaled,
    nothing fails, and the engine with the run's code delivers it."""

    @flow(name="inbox.pinned", version="1")
    def first_version(ctx: Context, _input: Any) -> Any:
        return ctx.receive("t")

    @flow(name="inbox.pinned", version="2")
    def second_version(ctx: Context, _input: Any) -> Any:
        return ["v2", ctx.receive("t")]

    store = MemoryStore()
    old = Engine(store, [first_version], listeners=[])
    new = Engine(store, [second_version], listeners=[])
    old.start("inbox.pinned", None, key="p")
    before = store.head("ex/p")
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert new.send("p", "hello", topic="t") == 1
    assert store.head("ex/p") == before, "nothing journaled by the engine without its code"
    assert [r.message for r in caplog.records] == []
    assert new.get("p").status is Status.SUSPENDED
    assert old.recover() == ["p"]
    assert old.get("p").result == "hello"


def test_recover_delivering_a_message_nobody_woke_the_run_for_tells_each_listener_once() -> None:
    seen: list[tuple[str, str]] = []

    def listener(_engine: Engine, execution: Any) -> None:
        seen.append((execution.id, execution.status.value))

    @flow(name="inbox.once", version="1")
    def once(ctx: Context, _input: Any) -> Any:
        return ctx.receive(timeout=60)

    engine = Engine(MemoryStore(), [once], listeners=[listener])
    engine.start("inbox.once", None, key="o")
    engine.send("o", "hi", drive=False)  # a sender that stopped before the wake
    seen.clear()
    assert engine.recover() == ["o"]
    assert seen == [("o", "suspended"), ("o", "completed")], "its park again, then its end once"
    assert engine.get("o").result == "hi"


# -- sends and resumes from inside a step ----------------------------------------------


_peers: list[Engine] = []
_both_in_step = threading.Barrier(2, timeout=10)


def _notify(other: str, me: str) -> int:
    _both_in_step.wait()  # both runs are in this step now, each holding its own lock
    return _peers[0].send(other, f"hello from {me}", topic="peer", key=f"{me}-1")


@flow(name="inbox.peer")
def peer(ctx: Context, names: list[str]) -> Any:
    me, other = names
    ctx.suspend("go")
    ctx.step("notify", _notify, other, me)
    return ctx.receive("peer", timeout=60)


def test_two_runs_whose_steps_send_to_each_other_at_once_both_read_their_message() -> None:
    """A send from a step does not wait for a run another drive holds (it reads its
    inbox itself as it parks): two runs messaging each other never wait for ever."""
    _both_in_step.reset()
    engine = Engine(MemoryStore(), [peer], listeners=[])
    _peers[:] = [engine]
    engine.start("inbox.peer", ["A", "B"], key="A")
    engine.start("inbox.peer", ["B", "A"], key="B")
    threads = [
        threading.Thread(target=engine.resume, args=(name, None), kwargs={"on": "go"}, daemon=True)
        for name in "AB"
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not any(thread.is_alive() for thread in threads), "deadlocked"
    assert engine.get("A").result == "hello from B"
    assert engine.get("B").result == "hello from A"


def test_a_resume_from_a_step_waits_half_a_lease_for_a_run_another_drive_holds() -> None:
    """A resume from inside a step cannot know the run it waits for is not waiting for
    it: past half a lease it gives up with RunBusyError in the step, journaling
    nothing, instead of waiting for ever."""
    from loom_kernel import LoomError, RetryPolicy, RunBusyError

    release, busy = threading.Event(), threading.Event()

    def hold() -> bool:
        busy.set()
        return release.wait(20)

    @flow(name="inbox.holds")
    def holds(ctx: Context, _input: Any) -> Any:
        ctx.step("hold", hold)
        return ctx.suspend("go")

    @flow(name="inbox.resumes")
    def resumes(ctx: Context, _input: Any) -> Any:
        return ctx.step("resume", lambda: ctx.engine.resume("h", "x", on="go").status.value)

    engine = Engine(
        MemoryStore(), [holds, resumes], listeners=[], lease=0.4, retry=RetryPolicy(attempts=1)
    )
    holder = threading.Thread(target=engine.start, args=("inbox.holds",), kwargs={"key": "h"})
    holder.start()
    try:
        assert busy.wait(10)
        began = time.monotonic()
        run = engine.start("inbox.resumes", key="r")
        assert time.monotonic() - began < 10
        assert run.status is Status.FAILED
        assert run.error is not None
        assert "RunBusyError: execution 'h' was held by another drive of this engine for 0.2 s" in (
            run.error.message
        )
    finally:
        release.set()
        holder.join(20)
    assert engine.get("h").status is Status.SUSPENDED, "the resume journaled nothing"
    assert issubclass(RunBusyError, LoomError)


@flow(name="inbox.notifies")
def notifies(ctx: Context, target: str) -> Any:
    return ctx.step("send", lambda: ctx.engine.send(target, "hello", topic="t"))


@flow(name="inbox.listens_once")
def listens_once(ctx: Context, _input: Any) -> Any:
    return ctx.receive("t")


def _sender_and_its_target() -> Engine:
    """An engine whose run "t" is parked at its receive, and that hosts a flow whose
    step sends to a run."""
    engine = Engine(MemoryStore(), [notifies, listens_once], listeners=[])
    engine.start("inbox.listens_once", key="t")
    return engine


def test_a_send_from_a_step_to_a_run_held_by_something_else_is_delivered_at_its_release() -> None:
    """The target is parked at its receive, its lock held by something that will not
    read its inbox (a migration's replay, say): the send does not wait, and the
    message is delivered by whoever releases the lock, with no worker running."""
    released, holding = threading.Event(), threading.Event()
    engine = _sender_and_its_target()

    def hold_it() -> None:
        with parts_of(engine).driver.locks.hold("t"):
            holding.set()
            released.wait(10)

    holder = threading.Thread(target=hold_it)
    holder.start()
    try:
        assert holding.wait(10)
        began = time.monotonic()
        assert engine.start("inbox.notifies", "t", key="s").status is Status.COMPLETED
        assert time.monotonic() - began < 5, "the send did not wait for the lock"
        assert engine.get("t").status is Status.SUSPENDED, "still held: not delivered yet"
    finally:
        released.set()
        holder.join(10)
    assert engine.get("t").result == "hello", "delivered as the lock was released"
    assert len(parts_of(engine).driver.locks) == 0


def test_a_send_from_a_step_whose_wake_fails_is_logged_and_the_message_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The send landed; only waking the run failed (a store fault): the sending step
    goes on, the failure is logged, and the message waits for the next delivery."""
    from loom_kernel import StoreUnavailableError

    engine = _sender_and_its_target()
    delivery = parts_of(engine).delivery

    def failing(_execution_id: str, **_options: Any) -> Any:
        raise StoreUnavailableError("the store went away")

    delivery.deliver = failing  # type: ignore[method-assign,assignment]
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert engine.start("inbox.notifies", "t", key="s").status is Status.COMPLETED
    assert "t: a message was sent, its wake failed: the store went away" in caplog.text
    del delivery.deliver
    engine.recover()
    assert engine.get("t").result == "hello"
