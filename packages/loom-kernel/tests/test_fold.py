"""The fold is pure and total: any prefix folds, and snapshot + tail equals the whole;
compaction keeps the run going, and only its latest snapshot."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loom_kernel import Context, Engine, MemoryStore, SchemaError, TrimmedError, flow
from loom_kernel.events import Event, ExecutionState, Status, decode_event, fold
from loom_kernel.testing import FakeClock, sandbox

payloads = st.none() | st.integers() | st.text(max_size=4) | st.lists(st.integers(), max_size=2)


@flow
def scripted(ctx: Context, script: list[list[Any]]) -> Any:
    out = []
    for number, (kind, value) in enumerate(script):
        if kind == "step":
            out.append(ctx.step(f"s{number}", lambda v=value: v))
        elif kind == "gate":
            out.append(ctx.suspend(f"g{number}"))
        elif kind == "sleep":
            ctx.sleep(value)
        elif kind == "now":
            out.append(ctx.now())
    return out


scripts = st.lists(
    st.one_of(
        st.tuples(st.just("step"), payloads),
        st.tuples(st.just("gate"), payloads),
        st.tuples(st.just("sleep"), st.integers(1, 100)),
        st.tuples(st.just("now"), st.none()),
    ),
    max_size=10,
)


def _run(script: list[tuple[str, Any]]) -> list[Event]:
    """Drive a scripted run to its end and return its decoded journal."""
    clock = FakeClock()
    store = MemoryStore()
    engine = Engine(store, [scripted], clock=clock)
    ex = engine.start("scripted", [list(op) for op in script], key="run")
    for number, (kind, value) in enumerate(script):
        if kind == "gate":
            engine.resume(ex.id, {"gate": number, "value": value})
        elif kind == "sleep":
            clock.advance(value)
            engine.fire_due_timers()
    assert engine.get(ex.id).status is Status.COMPLETED
    return [decode_event(record, "ex/run") for record in store.read("ex/run")]


@settings(max_examples=50, deadline=None)
@given(scripts)
def test_every_prefix_folds(script: list[tuple[str, Any]]) -> None:
    events = _run(script)
    for cut in range(len(events) + 1):
        state = fold(events[:cut], "run")
        assert state.position == cut


@settings(max_examples=50, deadline=None)
@given(scripts, st.data())
def test_snapshot_plus_tail_equals_the_whole(
    script: list[tuple[str, Any]], data: st.DataObject
) -> None:
    events = _run(script)
    cut = data.draw(st.integers(0, len(events)), label="cut")
    whole = fold(events, "run")
    snapshot = fold(events[:cut], "run").to_snapshot()
    restored = ExecutionState.from_snapshot(json.loads(json.dumps(snapshot)))
    assert fold(events[cut:], restored) == whole


def test_fold_does_not_change_its_start_state() -> None:
    events = _run([("gate", 1), ("step", 2)])
    start = fold(events[:2], "run")
    before = start.to_snapshot()
    fold(events[2:], start)
    assert start.to_snapshot() == before


def test_snapshot_from_a_newer_major_is_refused() -> None:
    with pytest.raises(SchemaError, match="newer major"):
        ExecutionState.from_snapshot({"schema": "2.0.0", "state": {"id": "x"}})
    with pytest.raises(SchemaError, match="malformed snapshot"):
        ExecutionState.from_snapshot({"schema": "1.16.0", "state": {"steps": 5}})


def test_compaction_keeps_the_run_going() -> None:
    @flow
    def long(ctx: Context, count: int) -> Any:
        total = sum(ctx.step(f"s{i}", lambda i=i: i) for i in range(count))
        first = ctx.suspend("a")
        second = ctx.suspend("b")
        return [total, first, second]

    store = MemoryStore()
    engine = Engine(store, [long])
    ex = engine.start("long", 50, key="long")
    engine.resume(ex.id, "one")
    covered = engine.compact(ex.id)
    assert covered == engine.get(ex.id).position
    with pytest.raises(TrimmedError) as trimmed:
        store.read("ex/long")
    assert (trimmed.value.stream, trimmed.value.after, trimmed.value.floor) == (
        "ex/long",
        0,
        covered - 1,
    ), "where reads may start"
    assert f"is trimmed up to position {covered - 1}" in str(trimmed.value)
    fresh = Engine(store, [long])  # no cache: it must start from the snapshot
    assert fresh.resume(ex.id, "two").result == [sum(range(50)), "one", "two"]
    assert fresh.history(ex.id)[0].position == covered, "the last covered record stays"


@pytest.mark.usefixtures("flow_loop")
def test_a_second_compaction_drops_the_older_snapshot() -> None:
    from loom_kernel import TrimmedError

    @flow(name="parked", version="1")
    def parked(ctx: Context, _input: Any) -> Any:
        ctx.step("one", lambda: 1)
        first = ctx.suspend("a")
        return [first, ctx.suspend("b")]

    box = sandbox(parked)
    box.engine.start("parked", key="p")
    box.engine.compact("p")
    box.engine.resume("p", "x")
    box.engine.compact("p")
    with pytest.raises(TrimmedError):
        box.store.read("snap/p", 0)
    assert len(box.store.read("snap/p", box.store.head("snap/p") - 1)) == 1
