"""Messages and deadlines: a run's inbox (send, receive), gates with a timeout, the
first of several things, and published progress (set_event, get_event)."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel import (
    AsyncContext,
    Context,
    Engine,
    ExecutionNotFoundError,
    GateTimeoutError,
    InvalidArgumentError,
    MemoryStore,
    NotSuspendedError,
    RunFinishedError,
    Status,
    Woken,
    flow,
)
from loom_kernel._coordination import partition_of
from loom_kernel._engine import parts_of
from loom_kernel._replay import drive_here
from loom_kernel.events import ExecutionSuspended
from loom_kernel.spi import JournalStore, NewRecord, SchemaError
from loom_kernel.testing import FakeClock


@flow(name="inbox.two")
def two(ctx: Context, topic: str | None) -> Any:
    return [ctx.receive(topic), ctx.receive(topic)]


@flow(name="inbox.gated")
def gated(ctx: Context, _input: Any) -> Any:
    ctx.suspend("go")
    return [ctx.receive(), ctx.receive(timeout=0)]


@flow(name="inbox.patient")
def patient(ctx: Context, timeout: float) -> Any:
    first = ctx.receive("t", timeout=timeout)
    second = ctx.receive("t", timeout=timeout)
    return [first, second]


@flow(name="inbox.deadline")
def deadline(ctx: Context, timeout: float) -> Any:
    try:
        return ctx.suspend("approve", timeout=timeout)
    except GateTimeoutError as exc:
        return f"timed out after {exc.timeout:g} ({exc.execution_id}, {exc.gate}): {exc}"


@flow(name="inbox.first")
def first(ctx: Context, gates: list[str]) -> Any:
    woken = ctx.wait_first(gates=gates, topics=["cancel"], timeout=60)
    return [woken.kind, woken.name, woken.value]


@flow(name="inbox.progress")
def progress(ctx: Context, steps: int) -> Any:
    for index in range(steps):
        ctx.step(f"s{index}", lambda: None)
        ctx.set_event("done", index + 1)
    ctx.suspend("finish")
    return "finished"


FLOWS = [two, gated, patient, deadline, first, progress]


def _engine(store: JournalStore, clock: FakeClock | None = None, **options: Any) -> Engine:
    return Engine(store, FLOWS, clock=clock or FakeClock(), listeners=[], **options)


# -- send and receive ------------------------------------------------------------------


def test_a_message_sent_to_a_parked_receive_wakes_it_and_drives_it_on() -> None:
    engine = _engine(MemoryStore())
    assert engine.start("inbox.two", None, key="r").topics == (None,)
    assert engine.send("r", "one") == 1
    assert engine.get("r").status is Status.SUSPENDED, "parked at its second receive"
    engine.send("r", {"n": 2})
    assert engine.get("r").result == ["one", {"n": 2}]


def test_a_message_sent_before_the_receive_waits_in_the_inbox() -> None:
    engine = _engine(MemoryStore())
    engine.start("inbox.gated", None, key="g")
    engine.send("g", "early")  # parked at a gate, not at a receive: kept, not refused
    assert engine.get("g").waiting_on == "go"
    engine.resume("g", None)
    assert engine.get("g").result == ["early", None]


def test_messages_are_received_in_send_order_per_topic() -> None:
    engine = _engine(MemoryStore())
    engine.start("inbox.two", "a", key="t")
    engine.send("t", "b1", topic="b")
    engine.send("t", "a1", topic="a")
    engine.send("t", "b2", topic="b")
    engine.send("t", "a2", topic="a")
    assert engine.get("t").result == ["a1", "a2"]


def test_a_resend_with_the_same_key_is_a_no_op_even_after_the_run_finished() -> None:
    engine = _engine(MemoryStore())
    engine.start("inbox.two", None, key="k")
    assert engine.send("k", "once", key="m1") == 1
    assert engine.send("k", "twice", key="m1") == 1
    assert engine.get("k").status is Status.SUSPENDED
    engine.send("k", "other", key="m2")
    assert engine.get("k").result == ["once", "other"]
    assert engine.send("k", "again", key="m2") == 2, "finished: still a no-op, not an error"


def test_resends_that_both_landed_are_delivered_once() -> None:
    store = MemoryStore()
    engine = _engine(store)
    engine.start("inbox.two", None, key="d")
    # Two senders that both looked before either appended: both records land.
    parts_of(engine).driver.inbox.append("d", None, "same", "first")
    parts_of(engine).driver.inbox.append("d", None, "same", "second")
    parts_of(engine).driver.inbox.append("d", None, None, "third")
    engine.recover()
    assert engine.get("d").result == ["first", "third"]


def test_sending_to_a_finished_run_is_refused_and_journals_nothing() -> None:
    store = MemoryStore()
    engine = _engine(store)
    engine.start("inbox.deadline", 0, key="done")
    assert engine.get("done").status is Status.COMPLETED
    with pytest.raises(RunFinishedError, match="nothing was sent"):
        engine.send("done", "late")
    assert store.head("inbox/done") == 0


def test_a_send_that_races_the_runs_end_is_reported_not_lost() -> None:
    class EndsMeanwhile(MemoryStore):
        def _append(self, stream: str, expected: int, records: Any) -> int:
            if stream == "inbox/race" and engine.get("race").status is Status.SUSPENDED:
                engine.resume("race", "now")  # the run ends while the message is sent
            return super()._append(stream, expected, records)

    store = EndsMeanwhile()
    engine = _engine(store)
    engine.start("inbox.deadline", 600, key="race")
    with pytest.raises(RunFinishedError, match="inbox position 1") as caught:
        engine.send("race", "too late")
    assert caught.value.position == 1


def test_bad_sends_are_refused_with_clear_errors() -> None:
    engine = _engine(MemoryStore())
    engine.start("inbox.two", None, key="b")
    with pytest.raises(ExecutionNotFoundError):
        engine.send("nobody", "x")
    for options in ({"topic": ""}, {"topic": 3}, {"key": ""}, {"key": b"k"}, {"topic": "t" * 201}):
        with pytest.raises(InvalidArgumentError):
            engine.send("b", "x", **options)
    with pytest.raises(InvalidArgumentError):
        engine.send("b", object())
    assert engine.get("b").status is Status.SUSPENDED


def test_a_resume_cannot_feed_a_receive() -> None:
    engine = _engine(MemoryStore())
    engine.start("inbox.two", None, key="n")
    with pytest.raises(NotSuspendedError, match=r"engine\.send delivers it"):
        engine.resume("n", "sneaky")


# -- deadlines ------------------------------------------------------------------------


def test_a_receive_that_times_out_returns_none_and_a_later_message_waits_for_the_next() -> None:
    clock = FakeClock()
    engine = _engine(MemoryStore(), clock)
    engine.start("inbox.patient", 30, key="p")
    assert engine.get("p").wake_at == clock() + 30
    clock.advance(31)
    assert engine.fire_due_timers() == ["p"]
    engine.send("p", "after", topic="t")
    assert engine.get("p").result == [None, "after"]
    assert engine.fire_due_timers() == [], "the second receive's deadline is obsolete"


def test_a_message_before_the_deadline_wins_and_the_timer_does_nothing() -> None:
    clock = FakeClock()
    engine = _engine(MemoryStore(), clock)
    engine.start("inbox.patient", 30, key="p")
    engine.send("p", "in time", topic="t")
    clock.advance(31)
    engine.fire_due_timers()  # the second receive times out
    assert engine.get("p").result == ["in time", None]


def test_a_gate_with_a_timeout_returns_its_payload_or_raises_in_the_flow() -> None:
    clock = FakeClock()
    engine = _engine(MemoryStore(), clock)
    engine.start("inbox.deadline", 10, key="yes")
    assert engine.resume("yes", "approved").result == "approved"
    engine.start("inbox.deadline", 10, key="no")
    clock.advance(10)
    engine.fire_due_timers()
    assert engine.get("no").result == (
        "timed out after 10 (no, approve): execution 'no': gate 'approve' was not resumed "
        "within 10 s"
    )
    clock.advance(100)
    assert engine.fire_due_timers() == []
    for execution_id in ("yes", "no"):
        _engine(engine.store, clock).replay_check(execution_id)


def test_a_timer_cannot_wake_a_gate_with_no_deadline() -> None:
    engine = _engine(MemoryStore())
    engine.start("inbox.two", None, key="nt")
    with pytest.raises(NotSuspendedError, match="it waits on"):
        drive_here(parts_of(engine).delivery.resuming("nt", None, "timer:0", timer=True))


# -- the first of several things ----------------------------------------------------------


def test_wait_first_returns_what_came_first_and_replays_it() -> None:
    clock = FakeClock()
    engine = _engine(MemoryStore(), clock)
    engine.start("inbox.first", ["approve", "reject"], key="gate")
    assert engine.get("gate").gates == ("approve", "reject")
    assert engine.get("gate").topics == ("cancel",)
    engine.resume("gate", {"by": "ann"}, on="reject")
    engine.start("inbox.first", ["approve"], key="message")
    engine.send("message", "stop", topic="cancel")
    engine.start("inbox.first", ["approve"], key="timeout")
    clock.advance(60)
    engine.fire_due_timers()
    engine.start("inbox.first", ["approve"], key="alone")
    engine.resume("alone", 1)  # one gate: `on` may be left out
    results = {i: engine.get(i).result for i in ("gate", "message", "timeout", "alone")}
    assert results == {
        "gate": ["gate", "reject", {"by": "ann"}],
        "message": ["message", "cancel", "stop"],
        "timeout": ["timeout", None, None],
        "alone": ["gate", "approve", 1],
    }
    for execution_id in results:
        _engine(engine.store, clock).replay_check(execution_id)


def test_wait_first_refuses_a_resume_it_cannot_place() -> None:
    engine = _engine(MemoryStore())
    engine.start("inbox.first", ["approve", "reject"], key="w")
    with pytest.raises(NotSuspendedError, match="say which with on="):
        engine.resume("w", "?")
    with pytest.raises(NotSuspendedError, match="not 'other'"):
        engine.resume("w", "?", on="other")
    assert engine.get("w").status is Status.SUSPENDED


@pytest.mark.parametrize(
    ("gates", "topics", "timeout"),
    [
        ("approve", (), None),
        ((), "t", None),
        ((), (), None),
        (("a", "a"), (), 1),
        (("loom.x",), (), 1),
        ({"a"}, (), None),  # a set, a dict: not an order the journal can keep
        ((), {"t": 1}, None),
    ],
)
def test_wait_first_refuses_a_wait_that_cannot_be_recorded_clearly(
    gates: Any, topics: Any, timeout: Any
) -> None:
    @flow(name="inbox.misused")
    def misused(ctx: Context, _input: Any) -> Any:
        return ctx.wait_first(gates=gates, topics=topics, timeout=timeout)

    engine = Engine(MemoryStore(), [misused], listeners=[])
    with pytest.raises(InvalidArgumentError):
        engine.start("inbox.misused", None)


# -- races and crashes --------------------------------------------------------------------


def test_a_message_sent_while_the_receive_was_parking_is_read_by_the_run_itself() -> None:
    """The sender looks at the run before its park lands (it is running: the sender
    leaves the message to it); the run looks at the inbox after its park lands."""

    class SendWhileParking(MemoryStore):
        sent = False

        def _append(self, stream: str, expected: int, records: Any) -> int:
            parking = any(r.kind == ExecutionSuspended.KIND for r in records)
            if stream == "ex/race" and parking and not self.sent:
                self.sent = True
                other.send("race", "meanwhile")  # another process: the run is running
            return super()._append(stream, expected, records)

    store = SendWhileParking()
    engine = _engine(store)
    other = _engine(store)
    engine.start("inbox.two", None, key="race")
    payloads = engine.state("race").resume_payloads
    assert [p["message"] for p in payloads] == ["meanwhile"], "the first receive took it"
    engine.send("race", "next")
    assert engine.get("race").result == ["meanwhile", "next"]


def test_a_sender_that_stopped_after_appending_is_covered_by_recover() -> None:
    store = MemoryStore()
    engine = _engine(store)
    engine.start("inbox.two", None, key="c")
    parts_of(engine).driver.inbox.append(
        "c", None, None, "orphan"
    )  # the sender died before the wake
    assert engine.get("c").status is Status.SUSPENDED
    assert engine.recover() == ["c"]
    assert engine.get("c").status is Status.SUSPENDED, "at its second receive"
    assert engine.state("c").resume_payloads[0]["message"] == "orphan"


def test_two_senders_at_once_deliver_every_message_once_in_each_senders_order() -> None:
    @flow(name="inbox.collect")
    def collect(ctx: Context, count: int) -> Any:
        return [ctx.receive() for _ in range(count)]

    store = MemoryStore()
    engines = [Engine(store, [collect], listeners=[]) for _ in range(3)]
    engines[0].start("inbox.collect", 40, key="many")
    barrier = threading.Barrier(2)

    def send(sender: int) -> None:
        barrier.wait()
        for index in range(20):
            engines[sender + 1].send("many", [sender, index], key=f"{sender}-{index}")

    threads = [threading.Thread(target=send, args=(sender,)) for sender in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    received = engines[0].get("many").result
    assert received is not None
    assert sorted(map(tuple, received)) == [(s, i) for s in (0, 1) for i in range(20)]
    for sender in (0, 1):
        assert [i for s, i in received if s == sender] == list(range(20))


class Crash(BaseException):
    """The process dies here: nothing in the engine catches it."""


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("send"), st.sampled_from(["a", "b"]), st.integers(0, 6)),
            st.tuples(st.just("resend"), st.integers(0, 30)),
            st.tuples(st.just("tick"), st.integers(1, 40)),
            st.tuples(st.just("crash_on_step"), st.integers(0, 3)),
            st.tuples(
                st.just("recover"),
            ),
        ),
        max_size=30,
    )
)
def test_every_message_is_received_once_in_order_per_topic_and_replays_the_same(
    operations: list[Any],
) -> None:
    @flow(name="inbox.loop")
    def loop(ctx: Context, _input: Any) -> Any:
        got = []
        for index in range(12):
            topic = "a" if index % 3 else "b"
            value = ctx.receive(topic, timeout=25)
            got.append(ctx.step(f"got{index}", lambda v=value, t=topic: [t, v]))
        return got

    class Crashing(MemoryStore):
        crash_at: int | None = None

        def _append(self, stream: str, expected: int, records: Any) -> int:
            if self.crash_at is not None and stream == "ex/loop" and expected >= self.crash_at:
                self.crash_at = None
                raise Crash
            return super()._append(stream, expected, records)

    clock = FakeClock()
    store = Crashing()
    engine = Engine(store, [loop], clock=clock, listeners=[])
    engine.start("inbox.loop", None, key="loop")
    sent: list[tuple[str, int]] = []
    keys: list[str] = []
    for operation in operations:
        try:
            if operation[0] == "send":
                _, topic, number = operation
                key = f"m{len(keys)}"
                keys.append(key)
                if engine.get("loop").status.finished:
                    continue
                sent.append((topic, number))  # sent once in the inbox, even if a crash follows
                engine.send("loop", number, topic=topic, key=key)
            elif operation[0] == "resend" and keys:
                engine.send("loop", "dup", key=keys[operation[1] % len(keys)])
            elif operation[0] == "tick":
                clock.advance(operation[1])
                engine.fire_due_timers()
            elif operation[0] == "crash_on_step":
                store.crash_at = engine.get("loop").position + operation[1]
            else:
                engine = Engine(store, [loop], clock=clock, listeners=[])  # a new process
                engine.recover()
        except Crash:
            engine = Engine(store, [loop], clock=clock, listeners=[])
        except RunFinishedError:
            pass
    store.crash_at = None
    engine = Engine(store, [loop], clock=clock, listeners=[])
    engine.recover()
    state = engine.state("loop")
    received = [frame.result for _, frame in sorted(state.steps.items())]
    messages = [(topic, value) for topic, value in received if value is not None]
    for topic in ("a", "b"):
        got = [value for t, value in messages if t == topic]
        wanted = [value for t, value in sent if t == topic]
        assert got == wanted[: len(got)], "in send order, none twice, none skipped"
    positions = [p["position"] for p in state.resume_payloads if isinstance(p, dict)]
    assert len(positions) == len(set(positions)), "no inbox message consumed twice"
    engine.replay_check("loop")


# -- published progress -----------------------------------------------------------------


def test_set_event_publishes_the_latest_value_and_a_replay_publishes_nothing() -> None:
    store = MemoryStore()
    engine = _engine(store)
    assert engine.get_event("nothing-yet", "done") is None
    engine.start("inbox.progress", 3, key="pr")
    assert engine.get_event("pr", "done") == 3
    assert engine.get_events("pr") == {"done": 3}
    assert store.head("events/pr") == 3
    _engine(store).resume("pr", None)  # a replay in a new engine
    assert store.head("events/pr") == 3
    assert engine.get("pr").result == "finished"


def test_get_event_waits_for_a_value_or_gives_up() -> None:
    engine = Engine(MemoryStore(), FLOWS, listeners=[])
    engine.start("inbox.two", None, key="slow")
    assert engine.get_event("slow", "done", timeout=0.05) is None
    timer = threading.Timer(0.05, lambda: parts_of(engine).driver.published.set("slow", "done", 7))
    timer.start()
    assert engine.get_event("slow", "done", timeout=10) == 7
    timer.join()
    with pytest.raises(InvalidArgumentError):
        engine.get_event("slow", "done", timeout=-1)


def test_an_event_value_that_is_not_json_stops_the_run() -> None:
    @flow(name="inbox.bad_event")
    def bad_event(ctx: Context, _input: Any) -> Any:
        ctx.set_event("k", object())

    engine = Engine(MemoryStore(), [bad_event], listeners=[])
    with pytest.raises(InvalidArgumentError):
        engine.start("inbox.bad_event", None)


# -- async flows ------------------------------------------------------------------------


def test_async_flows_receive_wait_and_publish() -> None:
    @flow(name="inbox.async")
    async def async_flow(ctx: AsyncContext, _input: Any) -> Any:
        message = await ctx.receive("t", timeout=5)
        await ctx.set_event("got", message)
        woken: Woken = await ctx.wait_first(gates=["go"], timeout=5)
        try:
            await ctx.suspend("never", timeout=5)
        except GateTimeoutError:
            late = "late"
        return [message, woken.kind, late]

    clock = FakeClock()
    engine = Engine(MemoryStore(), [async_flow], clock=clock, listeners=[])
    engine.start("inbox.async", None, key="as")
    engine.send("as", "hello", topic="t")
    assert engine.get_event("as", "got") == "hello"
    engine.resume("as", None, on="go")
    clock.advance(5)
    engine.fire_due_timers()
    assert engine.get("as").result == ["hello", "gate", "late"]
    Engine(engine.store, [async_flow], clock=clock, listeners=[]).replay_check("as")


# -- the docs' example ---------------------------------------------------------------------


def test_the_approval_with_escalation_example() -> None:
    paged: list[str] = []

    @flow(name="approval")
    def approval(ctx: Context, order: str) -> Any:
        decision = ctx.receive("decision", timeout=3600)  # an hour for the approver
        if decision is None:
            ctx.step("escalate", lambda: paged.append(order))
            decision = ctx.receive("decision", timeout=86400)  # a day for the manager
        return decision or "expired"

    clock = FakeClock()
    engine = Engine(MemoryStore(), [approval], clock=clock, listeners=[])
    engine.start("approval", "order-7", key="order-7")
    engine.start("approval", "order-8", key="order-8")
    engine.send("order-7", "approved", topic="decision", key="ann-1")
    clock.advance(3600)
    engine.fire_due_timers()
    assert paged == ["order-8"]
    engine.send("order-8", "rejected", topic="decision", key="bob-1")
    assert engine.get("order-7").result == "approved"
    assert engine.get("order-8").result == "rejected"


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


# -- races between engines (an adversarial review) -------------------------------------


@flow(name="inbox.two_deadlines")
def two_deadlines(ctx: Context, _input: Any) -> Any:
    answers = []
    for gate, seconds in (("a", 10), ("b", 100)):
        try:
            answers.append(ctx.suspend(gate, timeout=seconds))
        except GateTimeoutError:
            answers.append("timeout")
    return answers


@flow(name="inbox.receive_then_gate")
def receive_then_gate(ctx: Context, _input: Any) -> Any:
    first = ctx.receive("t", timeout=10)
    try:
        second = ctx.suspend("b", timeout=100)
    except GateTimeoutError:
        second = "timeout"
    return [first, second]


@pytest.mark.parametrize("flow_name", ["inbox.two_deadlines", "inbox.receive_then_gate"])
def test_a_timer_of_a_gate_passed_meanwhile_never_wakes_the_next_gate(flow_name: str) -> None:
    """Engine X finds gate 0's deadline due; before its wake, engine Y passes gate 0
    (a resume, a message) and the run parks at gate 1, which has a deadline too."""
    store, clock = MemoryStore(), FakeClock()
    flows = [*FLOWS, two_deadlines, receive_then_gate]
    x = Engine(store, flows, clock=clock, listeners=[])
    y = Engine(store, flows, clock=clock, listeners=[])
    x.start(flow_name, None, key="run")
    clock.advance(10)
    found_due = parts_of(x).delivery.timer_state

    def passed_meanwhile(entry: Any, now: float) -> Any:
        due = found_due(entry, now)
        if entry.gate == 0 and due is True:
            if flow_name == "inbox.two_deadlines":
                y.resume("run", "in time", on="a")
            else:
                y.send("run", "in time", topic="t")
            assert y.get("run").waiting_on == "b"
        return due

    parts_of(x).delivery.timer_state = passed_meanwhile  # type: ignore[method-assign]
    x.fire_due_timers()
    assert x.get("run").waiting_on == "b", "gate b's deadline is 90 s away"
    y.resume("run", "later", on="b")
    assert x.get("run").result == ["in time", "later"]
    x.replay_check("run")


def test_resume_keys_of_the_kernels_own_are_refused() -> None:
    engine = _engine(MemoryStore())
    engine.start("inbox.deadline", 60, key="r")
    for key in ("timer:0", "loom.inbox:1", "loom.anything"):
        with pytest.raises(InvalidArgumentError, match="kernel's own"):
            engine.resume("r", "x", key=key)
    assert engine.resume("r", "yes", key="mine").result == "yes"


def test_a_keyed_send_racing_its_own_resend_is_not_reported_unread() -> None:
    store = MemoryStore()
    first, second = _engine(store), _engine(store)
    first.start("inbox.gated", None, key="k")
    first.resume("k", None)  # at its receive
    appended = parts_of(second).driver.inbox.append

    def resent_meanwhile(execution_id: str, topic: Any, key: Any, message: Any) -> int:
        first.send("k", message, key=key)  # lands (and is read) before this copy
        return appended(execution_id, topic, key, message)

    parts_of(second).driver.inbox.append = resent_meanwhile  # type: ignore[method-assign]
    assert second.send("k", "hello", key="k1") == 1, "the first copy's position"
    assert second.get("k").result == ["hello", None]


def test_a_message_in_the_inbox_beats_a_deadline_whose_timer_fires_late() -> None:
    clock = FakeClock()
    engine = _engine(MemoryStore(), clock)
    engine.start("inbox.patient", 10, key="p")
    clock.advance(5)
    engine.send("p", "in time", topic="t", drive=False)  # no worker woke it
    clock.advance(6)
    engine.fire_due_timers()
    assert engine.state("p").resume_payloads[0]["message"] == "in time"


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


def test_a_deadline_hint_of_a_gate_passed_in_time_is_dropped_when_it_falls_due() -> None:
    clock = FakeClock()
    engine = Engine(MemoryStore(), [two_deadlines], clock=clock, listeners=[])
    engine.start("inbox.two_deadlines", None, key="d")
    engine.resume("d", "in time", on="a")  # parked at gate b now, its deadline 100 s off
    clock.advance(11)
    offered: list[str] = []

    def wake(entry: Any) -> Any:
        offered.append(entry.execution_id)
        return parts_of(engine).delivery.timer_state(entry, clock())

    parts_of(engine).driver.timers.fire_due(clock(), wake)
    parts_of(engine).driver.timers.fire_due(clock(), wake)
    assert offered == ["d"], "obsolete: dropped the first time it was offered"


@pytest.mark.parametrize("bad", [123, "", "a//b", "../x"])
def test_the_message_and_event_calls_refuse_a_bad_id_before_it_becomes_a_key(bad: Any) -> None:
    from loom_kernel import InvalidIdError

    engine = _engine(MemoryStore())
    for call in (
        lambda: engine.send(bad, "m"),
        lambda: engine.get_event(bad, "k"),
        lambda: engine.get_events(bad),
    ):
        with pytest.raises(InvalidIdError):
            call()


@pytest.mark.parametrize("bad", [["a"], {"a": 1}, 7])
def test_reading_a_run_refuses_an_id_that_is_not_a_str_before_any_lookup(bad: Any) -> None:
    from loom_kernel import InvalidIdError

    engine = _engine(MemoryStore())
    for call in (lambda: engine.get(bad), lambda: engine.state(bad), lambda: engine.cancel(bad)):
        with pytest.raises(InvalidIdError):
            call()


def test_a_value_that_cannot_be_published_stops_the_drive_before_it_is_journaled() -> None:
    from loom_kernel import StoreUnavailableError

    store = MemoryStore()
    engine = _engine(store)

    def down(*_args: Any) -> None:
        raise StoreUnavailableError("the store went away")

    parts_of(engine).driver.published.set = down  # type: ignore[method-assign,assignment]
    with pytest.raises(StoreUnavailableError):
        engine.start("inbox.progress", 3, key="down")
    assert engine.get("down").status is Status.RUNNING, "stopped, not failed or ended"
    names = [getattr(entry.event, "name", "") for entry in engine.history("down")]
    assert not any(name.startswith("loom.event:") for name in names), "nothing journaled"


def test_an_inbox_that_cannot_be_read_stops_the_drive_at_the_receive() -> None:
    """A receive that cannot look at the inbox neither parks (a message already there
    would wait for a wake nobody sends) nor passes: the drive stops on the store's
    error, and the run stays running for the next drive."""
    from loom_kernel import StoreUnavailableError

    engine = _engine(MemoryStore())

    def down(*_args: Any) -> None:
        raise StoreUnavailableError("the inbox went away")

    parts_of(engine).driver.inbox.next_for = down  # type: ignore[method-assign,assignment]
    with pytest.raises(StoreUnavailableError, match="the inbox went away"):
        engine.start("inbox.two", None, key="down")
    assert engine.get("down").status is Status.RUNNING, "stopped, not parked"
    assert [type(entry.event).__name__ for entry in engine.history("down")] == ["ExecutionStarted"]


# -- damaged inboxes and published values ----------------------------------------------

_DAMAGED_MESSAGES = [
    ("loom.other", b'{"topic": null, "key": null, "message": 1}', "unknown kind"),
    ("loom.message", b"{not json", "a damaged message"),
    ("loom.message", b'{"topic": 7, "key": null, "message": 1}', "topic and key"),
    ("loom.message", b'{"topic": null, "key": ["k"], "message": 1}', "topic and key"),
    ("loom.message", b'{"topic": null, "key": null}', "message"),
    ("loom.message", b"[1, 2]", "a damaged message"),
]


@pytest.mark.parametrize(("kind", "payload", "says"), _DAMAGED_MESSAGES)
def test_a_damaged_message_is_reported_and_the_run_stays_where_it_was(
    kind: str, payload: bytes, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore()
    engine = _engine(store)
    assert engine.start("inbox.two", None, key="r").waiting_on == "loom.receive:null"
    store.append("inbox/r", 0, [NewRecord(kind, payload, 0.0)])
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert engine.send("r", "hello") == 2
    assert "a damaged message" in caplog.text
    assert says in caplog.text
    assert "'inbox/r', position 1" in caplog.text
    execution = engine.get("r")
    assert (execution.status, execution.position) == (Status.SUSPENDED, 2), "nothing consumed"
    hints = [json.loads(r.payload) for r in store.read(f"runs/open/{partition_of('r')}")]
    nudge = {"id": "r", "flow": "inbox.two", "by": None, "nudge": True}
    assert nudge in hints, "workers look again"


@pytest.mark.parametrize("payload", [{"topic": None}, "hello", {"gate": "g"}])
def test_a_receive_resumed_with_a_damaged_payload_is_a_schema_error(payload: Any) -> None:
    from loom_kernel._core import encode_event
    from loom_kernel.events import ExecutionResumed

    store = MemoryStore()
    engine = _engine(store)
    engine.start("inbox.two", None, key="r")  # parked at its first receive
    resumed = ExecutionResumed(payload, "loom.message:1", None)
    store.append("ex/r", store.head("ex/r"), [encode_event(resumed, 0.0)])  # a bad tool
    with pytest.raises(SchemaError, match=r"gate #0 of 'r' was resumed with"):
        _engine(store).recover()
    kinds = [record.kind for record in store.read("ex/r")]
    assert kinds[3:] == ["EXECUTION_CLAIMED"], "the takeover, and nothing after it"


@pytest.mark.parametrize(
    ("kind", "payload"),
    [
        ("loom.other", b'{"key": "done", "value": 1}'),
        ("loom.event", b"{not json"),
        ("loom.event", b'{"key": 7, "value": 1}'),
        ("loom.event", b'{"key": "done"}'),
        ("loom.event", b'"done"'),
    ],
)
def test_a_damaged_published_value_is_a_schema_error_naming_where(
    kind: str, payload: bytes
) -> None:
    store = MemoryStore()
    engine = _engine(store)
    engine.start("inbox.progress", 1, key="p")
    assert engine.get_event("p", "done") == 1
    store.append("events/p", 1, [NewRecord(kind, payload, 0.0)])
    with pytest.raises(SchemaError, match="a damaged published value") as caught:
        engine.get_event("p", "done")
    assert (caught.value.stream, caught.value.position) == ("events/p", 2)


def test_get_event_waiting_returns_what_a_run_published_as_it_finished() -> None:
    engine = _engine(MemoryStore())
    engine.start("inbox.progress", 1, key="p")
    engine.resume("p", "go")
    assert engine.get("p").status is Status.COMPLETED
    real = parts_of(engine).driver.published.values
    reads: list[str] = []

    def racing(execution_id: str) -> dict[str, Any]:
        reads.append(execution_id)  # the first read is from before the run published
        return {} if len(reads) == 1 else real(execution_id)

    parts_of(engine).driver.published.values = racing  # type: ignore[method-assign]
    assert engine.get_event("p", "done", timeout=5) == 1, "read again once it finished"
    assert reads == ["p", "p"]


def test_the_inboxes_and_published_values_kept_parsed_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from loom_kernel._coordination import _inbox, _published

    monkeypatch.setattr(_inbox, "_KEPT", 3)
    monkeypatch.setattr(_published, "_KEPT", 3)
    engine = _engine(MemoryStore())
    for number in range(5):
        engine.start("inbox.two", None, key=f"p{number}")
        engine.send(f"p{number}", "hello")  # the run reads its inbox
        engine.start("inbox.progress", 1, key=f"p{number}-progress")
        assert engine.get_event(f"p{number}-progress", "done") == 1
    inboxes = parts_of(engine).driver.inbox._folds.kept()
    assert inboxes == ["inbox/p2", "inbox/p3", "inbox/p4"], "the least recent dropped"
    kept = parts_of(engine).driver.published._folds.kept()
    assert kept == ["events/p2-progress", "events/p3-progress", "events/p4-progress"], (
        "the least recent dropped"
    )
    assert engine.get_event("p0-progress", "done") == 1, "read again from the store"


# -- sends and resumes from inside a step -----------------------------------------------

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


@pytest.mark.parametrize("reason", [5, {"why": 1}, ["x"], "caf\udce9"])
def test_a_cancel_or_a_migration_with_a_reason_that_is_not_text_is_refused(reason: Any) -> None:
    store = MemoryStore()
    engine = _engine(store)
    engine.start("inbox.two", None, key="r")
    head = store.head("ex/r")
    with pytest.raises(InvalidArgumentError, match="a reason"):
        engine.cancel("r", reason=reason)
    with pytest.raises(InvalidArgumentError, match="a reason"):
        engine.resume_as("r", "inbox.two", reason=reason)
    assert store.head("ex/r") == head, "nothing journaled"
    assert _engine(store).get("r").status is Status.SUSPENDED, "still readable"


def test_a_topic_or_an_event_key_with_no_utf8_form_is_refused() -> None:
    store = MemoryStore()
    engine = _engine(store)
    engine.start("inbox.two", None, key="s")
    with pytest.raises(InvalidArgumentError, match="lone surrogate"):
        engine.send("s", "x", topic="caf\udce9")
    assert store.head("inbox/s") == 0
    for key in ("k\ud800", "", 5, None, "x" * 201):
        with pytest.raises(InvalidArgumentError, match="an event key"):
            engine.get_event("s", key, timeout=0)  # type: ignore[arg-type]


def test_an_execution_id_too_long_for_its_runs_other_streams_is_refused() -> None:
    """Its inbox, events and snapshot streams are named by it too: `events/<id>`,
    the longest, must be a valid stream id."""
    from loom_kernel import InvalidIdError

    store = MemoryStore()
    engine = _engine(store)
    longest = "i" * 193
    engine.start("inbox.two", None, key=longest)
    assert engine.send(longest, "hello") == 1
    with pytest.raises(InvalidIdError, match="at most 193 characters"):
        engine.start("inbox.two", None, key="i" * 194)
    assert store.head("ex/" + "i" * 194) == 0
    copies = [NewRecord(r.kind, r.payload, r.timestamp) for r in store.read("ex/" + longest)]
    for older in ("o" * 195, "p" * 197):  # started before the check: still read, cancelled
        store.append("ex/" + older, 0, copies)
        assert _engine(store).get(older).status is Status.SUSPENDED
        assert _engine(store).cancel(older).status is Status.CANCELLED
    assert len(list(_engine(store).executions())) == 3, "the listing reads them all"


def test_a_send_from_a_step_to_a_run_held_by_something_else_is_delivered_at_its_release() -> None:
    """The target is parked at its receive, its lock held by something that will not
    read its inbox (a migration's replay, say): the send does not wait, and the
    message is delivered by whoever releases the lock, with no worker running."""
    released, holding = threading.Event(), threading.Event()

    @flow(name="inbox.notifies")
    def notifies(ctx: Context, target: str) -> Any:
        return ctx.step("send", lambda: ctx.engine.send(target, "hello", topic="t"))

    @flow(name="inbox.listens_once")
    def listens_once(ctx: Context, _input: Any) -> Any:
        return ctx.receive("t")

    engine = Engine(MemoryStore(), [notifies, listens_once], listeners=[])
    engine.start("inbox.listens_once", key="t")

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
