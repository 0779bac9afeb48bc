"""Deadlines: a receive or a gate with a timeout, and wait_first (the first of some
gates, topics and a timeout), each recorded so that it replays; a timer whose gate was
passed meanwhile wakes nothing, not even the next gate, and a message already in the
inbox beats a deadline whose timer fires late."""

from __future__ import annotations

from typing import Any

import pytest
from loom_kernel import (
    Context,
    Engine,
    GateTimeoutError,
    InvalidArgumentError,
    MemoryStore,
    NotSuspendedError,
    Status,
    flow,
)
from loom_kernel._engine import parts_of
from loom_kernel._replay import drive_here
from loom_kernel.testing import FakeClock
from message_helpers import FLOWS, _engine


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


def test_a_message_in_the_inbox_beats_a_deadline_whose_timer_fires_late() -> None:
    clock = FakeClock()
    engine = _engine(MemoryStore(), clock)
    engine.start("inbox.patient", 10, key="p")
    clock.advance(5)
    engine.send("p", "in time", topic="t", drive=False)  # no worker woke it
    clock.advance(6)
    engine.fire_due_timers()
    assert engine.state("p").resume_payloads[0]["message"] == "in time"


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


def test_resume_keys_of_the_kernels_own_are_refused() -> None:
    engine = _engine(MemoryStore())
    engine.start("inbox.deadline", 60, key="r")
    for key in ("timer:0", "loom.inbox:1", "loom.anything"):
        with pytest.raises(InvalidArgumentError, match="kernel's own"):
            engine.resume("r", "x", key=key)
    assert engine.resume("r", "yes", key="mine").result == "yes"


# -- the first of several things -------------------------------------------------------


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


# -- a deadline of a gate passed meanwhile ---------------------------------------------


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


def test_a_deadline_hint_of_a_gate_passed_in_time_is_dropped_when_it_falls_due() -> None:
    clock = FakeClock()
    engine = Engine(MemoryStore(), [two_deadlines], clock=clock, listeners=[])
    engine.start("inbox.two_deadlines", None, key="d")
    engine.resume("d", "in time", on="a")  # parked at gate b now, its deadline 100 s off
    clock.advance(11)
    offered: list[tuple[str, bool | None]] = []

    def wake(entry: Any) -> Any:
        due = parts_of(engine).delivery.timer_state(entry, clock())
        offered.append((entry.execution_id, due))
        return due

    parts_of(engine).driver.timers.fire_due(clock(), wake)
    parts_of(engine).driver.timers.fire_due(clock(), wake)
    # False, not True: a worker hands a due hint to a slot and keeps it until the
    # journal shows the wake, so a woken gate's hint said due would be fired again
    # at every poll.
    assert offered == [("d", False)], "obsolete: dropped the first time it was offered"
