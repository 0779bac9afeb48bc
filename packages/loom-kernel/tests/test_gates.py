"""Gates and timers (ADR 0057): every gate gets its own payload, in order, and runs complete."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel import Context, Engine, MemoryStore, NotSuspendedError, RetryPolicy, Status, flow
from loom_kernel.testing import FakeClock

EngineFactory = Callable[..., Engine]


@flow
def two_gates(ctx: Context, _input: Any) -> Any:
    first = ctx.suspend("manager")
    second = ctx.suspend("finance")
    return {"first": first, "second": second}


@flow
def three_gates(ctx: Context, _input: Any) -> Any:
    return [ctx.suspend("a"), ctx.suspend("b"), ctx.suspend("c")]


def test_two_gate_payload_ordering(make_engine: EngineFactory) -> None:
    """ADR 0057 regression 1: gate 1 gets payload 1 on every re-run, gate 2 gets payload 2."""
    engine = make_engine([two_gates])
    ex = engine.start("two_gates")
    assert engine.get(ex.id).waiting_on == "manager"
    assert engine.resume(ex.id, "P1").waiting_on == "finance"
    done = engine.resume(ex.id, "P2")
    assert done.status is Status.COMPLETED
    assert done.result == {"first": "P1", "second": "P2"}
    state = engine.state(ex.id)
    assert state.variables["_resumePayloads"] == ["P1", "P2"]
    assert state.variables["_resumePayload"] == "P2"  # the latest, kept for compatibility


def test_three_gate_completion(make_engine: EngineFactory) -> None:
    """ADR 0057 regression 2: the run never re-parks at a gate it has passed."""
    engine = make_engine([three_gates])
    ex = engine.start("three_gates")
    for payload, next_gate in (("x", "b"), ("y", "c")):
        assert engine.resume(ex.id, payload).waiting_on == next_gate
    done = engine.resume(ex.id, "z")
    assert (done.status, done.result) == (Status.COMPLETED, ["x", "y", "z"])
    suspends = [h for h in engine.history(ex.id) if type(h.event).__name__ == "ExecutionSuspended"]
    assert len(suspends) == 3


def test_a_chain_of_sleeps_completes(make_engine: EngineFactory, clock: FakeClock) -> None:
    @flow
    def naps(ctx: Context, count: int) -> int:
        for _ in range(count):
            ctx.sleep(60)
        return count

    engine = make_engine([naps])
    ex = engine.start("naps", 4)
    for wake in range(4):
        assert engine.get(ex.id).waiting_on == "loom.timer"
        assert engine.fire_due_timers() == [], "nothing is due before the clock moves"
        clock.advance(60)
        assert engine.fire_due_timers() == [ex.id], f"wake {wake}"
    assert engine.get(ex.id).result == 4
    assert engine.fire_due_timers() == []


def test_a_sleeping_run_is_not_a_gate_a_resume_can_wake(
    make_engine: EngineFactory, clock: FakeClock
) -> None:
    """Mutation run gap (`wait_of` of the timer gate is None): a sleep is woken by its
    timer only, never by a resume, named or not."""

    @flow
    def nap(ctx: Context, _input: Any) -> str:
        ctx.sleep(60)
        return "woke"

    engine = make_engine([nap])
    ex = engine.start("nap")
    for on in (None, "loom.timer"):
        with pytest.raises(NotSuspendedError):
            engine.resume(ex.id, "too early", on=on)
    assert engine.get(ex.id).status is Status.SUSPENDED, "still asleep"
    assert engine.get(ex.id).gates == (), "waits for no gate"
    clock.advance(60)
    assert engine.fire_due_timers() == [ex.id]
    assert engine.get(ex.id).result == "woke"


def test_a_resume_from_an_engine_without_the_code_is_journaled_for_a_worker() -> None:
    store = MemoryStore()
    worker = Engine(store, [two_gates], listeners=[])
    worker.start("two_gates", key="g")
    web = Engine(store, [], listeners=[])  # a web tier, or `loom resume`: no flow code
    with pytest.raises(NotSuspendedError):
        web.resume("g", "P1", on="finance")  # refused: parked at another gate
    woken = web.resume("g", "P1", key="first", on="manager")
    assert (woken.status, woken.owner) == (Status.RUNNING, None), "journaled, not driven"
    assert web.resume("g", "P1 again", key="first").status is Status.RUNNING, "a resend"
    assert worker.recover() == ["g"]
    assert worker.get("g").waiting_on == "finance"
    assert web.resume("g", "P2", on="finance").status is Status.RUNNING
    worker.recover()
    assert worker.get("g").result == {"first": "P1", "second": "P2"}


def test_zero_sleep_passes_at_once(make_engine: EngineFactory) -> None:
    @flow
    def blink(ctx: Context, _input: Any) -> str:
        ctx.sleep(0)
        return "done"

    assert make_engine([blink]).start("blink").result == "done"


def test_timer_fires_once_whoever_fires_it(make_engine: EngineFactory, clock: FakeClock) -> None:
    @flow
    def nap(ctx: Context, _input: Any) -> str:
        ctx.sleep(10)
        return "up"

    first, second = make_engine([nap]), make_engine([nap])
    ex = first.start("nap")
    clock.advance(11)
    assert first.fire_due_timers() + second.fire_due_timers() == [ex.id]
    resumes = [h for h in first.history(ex.id) if type(h.event).__name__ == "ExecutionResumed"]
    assert len(resumes) == 1


Op = tuple[str, Any]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("gate"), st.integers() | st.text(max_size=5) | st.none()),
        st.tuples(st.just("sleep"), st.integers(1, 7200)),
        st.tuples(st.just("step"), st.integers()),
    ),
    max_size=12,
)


@flow
def scripted(ctx: Context, script: list[list[Any]]) -> list[Any]:
    seen = []
    for number, (kind, value) in enumerate(script):
        if kind == "gate":
            seen.append(ctx.suspend(f"g{number}"))
        elif kind == "sleep":
            ctx.sleep(value)
            seen.append("slept")
        else:
            seen.append(ctx.step(f"s{number}", lambda v=value: v))
    return seen


@settings(
    max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None
)
@given(script=ops, payload_seed=st.integers())
def test_any_mix_of_gates_sleeps_and_steps(
    script: list[Op], payload_seed: int, clock: FakeClock
) -> None:
    engine = Engine(MemoryStore(), [scripted], clock=clock, retry=RetryPolicy(attempts=1))
    ex = engine.start("scripted", [list(op) for op in script])
    expected: list[Any] = []
    wakes = 0
    for number, (kind, value) in enumerate(script):
        current = engine.get(ex.id)
        if kind == "gate":
            assert current.waiting_on == f"g{number}"
            payload = {"gate": number, "seed": payload_seed, "value": value}
            engine.resume(ex.id, payload)
            expected.append(payload)
            wakes += 1
        elif kind == "sleep":
            assert current.waiting_on == "loom.timer"
            clock.advance(value)
            assert engine.fire_due_timers() == [ex.id]
            expected.append("slept")
            wakes += 1
        else:
            expected.append(value)
    done = engine.get(ex.id)
    assert done.status is Status.COMPLETED
    assert done.result == expected
    assert len(engine.state(ex.id).resume_payloads) == wakes
    # The state the engine built while driving is the fold of what it journaled.
    fresh = Engine(engine.store, [scripted], clock=clock).state(ex.id)
    assert repr(engine.state(ex.id)) == repr(fresh)


@flow(name="gates.first")
def first_of(ctx: Context, _input: Any) -> Any:
    return ctx.wait_first(gates=["a", "b"], topics=["t"], timeout=60).name


@pytest.mark.parametrize(
    "spec",
    ["{not json", '{"gates": "a", "topics": []}', '{"gates": [""], "topics": []}', '{"gates": []}'],
)
def test_a_damaged_wait_first_gate_name_is_reported_not_guessed(spec: str) -> None:
    store = MemoryStore()
    engine = Engine(store, [first_of], clock=FakeClock(), listeners=[])
    assert engine.start("gates.first", key="w").gates == ("a", "b")
    entry = store._state.streams["ex/w"]
    suspended = entry.records[-1]
    envelope = json.loads(suspended.payload)
    assert envelope["d"]["on"].startswith("loom.first:")
    envelope["d"]["on"] = "loom.first:" + spec
    entry.records[-1] = suspended._replace(payload=json.dumps(envelope).encode())
    view = Engine(store, [first_of], clock=FakeClock(), listeners=[]).get("w")
    assert (view.status, view.gates, view.topics) == (Status.SUSPENDED, (), ())
    with pytest.raises(NotSuspendedError, match="a damaged gate name"):
        Engine(store, [first_of], clock=FakeClock(), listeners=[]).resume("w", "go", on="a")


def test_a_run_a_timer_wakes_is_told_to_the_listeners() -> None:
    seen: list[tuple[str, str]] = []

    def listener(_engine: Engine, execution: Any) -> None:
        seen.append((execution.id, execution.status.value))

    @flow(name="naps_then_ends", version="1")
    def naps_then_ends(ctx: Context, _input: Any) -> Any:
        ctx.sleep(10)
        return "woke"

    clock = FakeClock()
    engine = Engine(MemoryStore(), [naps_then_ends], clock=clock, listeners=[listener])
    engine.start("naps_then_ends", key="n")
    seen.clear()
    clock.advance(11)
    assert engine.fire_due_timers() == ["n"]
    assert seen == [("n", "completed")]
