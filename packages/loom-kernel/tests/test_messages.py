"""A run's inbox: a message sent wakes a parked receive or waits in the inbox; messages
are received in send order per topic, each once, through resends, races between senders
and crashes, and replay the same; bad sends, ids and reasons are refused."""

from __future__ import annotations

import threading
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
from loom_kernel._engine import parts_of
from loom_kernel.events import ExecutionSuspended
from loom_kernel.spi import NewRecord
from loom_kernel.testing import FakeClock
from message_helpers import _engine

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


def test_a_runs_inbox_lists_each_message_once_and_whether_it_was_read() -> None:
    engine = _engine(MemoryStore())
    engine.start("inbox.two", "t", key="i")
    engine.send("i", "later", topic="other", key="o")
    engine.send("i", "first", topic="t", key="f")
    engine.send("i", "again", topic="t", key="f")  # a resend: left out
    shown = engine.inbox("i")
    assert [(m.position, m.topic, m.key, m.message, m.received) for m in shown] == [
        (1, "other", "o", "later", False),
        (2, "t", "f", "first", True),
    ]
    with pytest.raises(ExecutionNotFoundError):
        engine.inbox("nobody")


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


def test_a_resume_cannot_feed_a_receive() -> None:
    engine = _engine(MemoryStore())
    engine.start("inbox.two", None, key="n")
    with pytest.raises(NotSuspendedError, match=r"engine\.send delivers it"):
        engine.resume("n", "sneaky")


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


# -- races and crashes -----------------------------------------------------------------


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


def test_a_keyed_send_racing_its_own_resend_is_not_reported_unread() -> None:
    store = MemoryStore()
    first, second = _engine(store), _engine(store)
    first.start("inbox.gated", None, key="k")
    first.resume("k", None)  # at its receive
    appended = parts_of(second).driver.inbox.append

    def resent_meanwhile(
        execution_id: str, topic: Any, key: Any, message: Any, generation: int = 1
    ) -> int:
        first.send("k", message, key=key)  # lands (and is read) before this copy
        return appended(execution_id, topic, key, message, generation)

    parts_of(second).driver.inbox.append = resent_meanwhile  # type: ignore[method-assign]
    assert second.send("k", "hello", key="k1") == 1, "the first copy's position"
    assert second.get("k").result == ["hello", None]


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


# -- refused at the call ---------------------------------------------------------------


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
    head = len(engine.history("b"))
    for keyed in ({1: "x"}, {"order": {2: "y"}}, [{None: 1}]):
        with pytest.raises(InvalidArgumentError, match="JSON's keys are str"):
            engine.send("b", keyed)  # it would have arrived as {"1": "x"}
        with pytest.raises(InvalidArgumentError, match="JSON's keys are str"):
            engine.resume("b", keyed)
    assert len(engine.history("b")) == head, "nothing journaled"
    assert engine.get("b").status is Status.SUSPENDED


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
