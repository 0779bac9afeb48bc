"""Replay refuses every divergence: nothing goes on silently, nothing is journaled."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loom_kernel import (
    AsyncContext,
    Context,
    Engine,
    InvalidArgumentError,
    MemoryStore,
    NonDeterminismError,
    Status,
    flow,
)
from loom_kernel.spi import JournalStore
from loom_kernel.testing import sandbox

#: Each test runs with a loop per drive and on one loop of another thread.
pytestmark = pytest.mark.usefixtures("flow_loop")


def _kinds(store: JournalStore, execution_id: str) -> list[str]:
    return [record.kind for record in store.read("ex/" + execution_id)]


def test_a_gate_raced_against_a_timer_is_refused_not_completed() -> None:
    @flow
    async def escalate(ctx: AsyncContext, _input: Any) -> str:
        approval = asyncio.ensure_future(ctx.suspend("approve"))
        deadline = asyncio.ensure_future(ctx.sleep(60))
        done, _pending = await asyncio.wait(
            [approval, deadline], return_when=asyncio.FIRST_COMPLETED
        )
        return "approved" if approval in done else "escalated"

    box = sandbox(escalate)
    with pytest.raises(InvalidArgumentError, match="another task than the flow's own"):
        box.engine.start("escalate", key="e")
    assert _kinds(box.store, "e") == ["EXECUTION_STARTED"]
    assert box.store.streams("timers/") == []
    assert box.engine.get("e").status is Status.RUNNING


def test_gathered_gates_are_refused_never_stuck() -> None:
    @flow
    async def both(ctx: AsyncContext, _input: Any) -> Any:
        return await asyncio.gather(ctx.suspend("a"), ctx.suspend("b"))

    box = sandbox(both)
    with pytest.raises(InvalidArgumentError, match="gates cannot race"):
        box.engine.start("both", key="b")
    assert _kinds(box.store, "b") == ["EXECUTION_STARTED"]


def test_a_stop_swallowed_by_the_flow_still_stops_the_run() -> None:
    @flow
    def stubborn(ctx: Context, _input: Any) -> str:
        with contextlib.suppress(BaseException):  # the misuse docs/determinism.md warns about
            ctx.suspend("wait")
        return "went on"

    box = sandbox(stubborn)
    run = box.engine.start("stubborn")
    assert run.status is Status.SUSPENDED, "parked, not completed past its gate"
    assert box.engine.resume(run.id, "now").result == "went on"


def test_an_unawaited_call_is_refused_when_the_flow_returns() -> None:
    @flow
    async def forgetful(ctx: AsyncContext, _input: Any) -> str:
        ctx.suspend("approve")  # type: ignore[unused-coroutine]
        return "done"

    box = sandbox(forgetful)
    with pytest.raises(
        InvalidArgumentError, match=r"ctx.suspend\('approve'\) was called but never"
    ):
        box.engine.start("forgetful", key="f")
    assert _kinds(box.store, "f") == ["EXECUTION_STARTED"]


def test_an_unawaited_step_is_refused_before_the_flow_parks() -> None:
    @flow
    async def forgetful(ctx: AsyncContext, _input: Any) -> Any:
        ctx.step("charge", lambda: 1)  # type: ignore[unused-coroutine]
        return await ctx.suspend("ship")

    box = sandbox(forgetful)
    with pytest.raises(InvalidArgumentError, match=r"ctx.step\('charge'\) was called but never"):
        box.engine.start("forgetful", key="f")
    assert _kinds(box.store, "f") == ["EXECUTION_STARTED"]


def test_recorded_values_are_plain_calls_in_async_flows() -> None:
    @flow
    async def values(ctx: AsyncContext, _input: Any) -> Any:
        return [ctx.now(), ctx.random() < 1, len(ctx.uuid()), await ctx.suspend("look")]

    box = sandbox(values)
    run = box.engine.start("values")
    done = box.new_engine().resume(run.id, "seen")
    assert done.result[1:] == [True, 36, "seen"]


# -- a call inserted anywhere before history that was already recorded -------------

Op = tuple[str, str]  # (kind, name)
INSERTS: dict[str, Callable[[Context], Any]] = {
    "step": lambda ctx: ctx.step("inserted", lambda: 0),
    "gate": lambda ctx: ctx.suspend("inserted"),
    "sleep": lambda ctx: ctx.sleep(5),
    "now": lambda ctx: ctx.now(),
    "random": lambda ctx: ctx.random(),
    "uuid": lambda ctx: ctx.uuid(),
    "child start": lambda ctx: ctx.step("loom.child.start", lambda: {"id": "x"}),
}


def _program(ops: list[Op], insert: tuple[int, str] | None) -> Any:
    @flow(name="program", version="1")
    def program(ctx: Context, _input: Any) -> Any:
        seen = []
        for position, (kind, name) in enumerate(ops):
            if insert is not None and insert[0] == position:
                INSERTS[insert[1]](ctx)
            if kind == "step":
                seen.append(ctx.step(name, lambda name=name: name))
            else:
                seen.append(ctx.suspend(name))
        return seen

    return program


def _parked_at_last(ops: list[Op]) -> MemoryStore:
    """A store holding run "p" of `ops`, every gate passed but the last."""
    store = MemoryStore()
    engine = Engine(store, [_program(ops, None)], listeners=[])
    run = engine.start("program", key="p")
    while run.waiting_on is not None and run.waiting_on != "last":
        run = engine.resume("p", run.waiting_on)
    assert run.waiting_on == "last"
    return store


ops_strategy = st.lists(
    st.tuples(st.sampled_from(["step", "gate"]), st.sampled_from(["a", "b", "c"])),
    min_size=1,
    max_size=8,
).map(lambda ops: [*ops, ("gate", "last")])


@settings(max_examples=150, deadline=None)
@given(ops=ops_strategy, data=st.data())
def test_a_call_inserted_before_recorded_history_is_refused_and_journals_nothing(
    ops: list[Op], data: st.DataObject
) -> None:
    store = _parked_at_last(ops)
    journal = store.read("ex/p")
    position = data.draw(st.integers(0, len(ops) - 1), label="insert before op")
    kind = data.draw(st.sampled_from(sorted(INSERTS)), label="inserted call")
    changed = Engine(store, [_program(ops, (position, kind))], listeners=[])
    with pytest.raises(NonDeterminismError):
        changed.resume("p", "done")
    assert store.read("ex/p") == journal, "nothing journaled, the payload not spent"
    assert store.streams("timers/") == []
    done = Engine(store, [_program(ops, None)], listeners=[]).resume("p", "done")
    assert done.status is Status.COMPLETED


def test_the_issue_example_a_fraud_check_inserted_before_a_passed_gate() -> None:
    @flow(name="order", version="1")
    def recorded(ctx: Context, _input: Any) -> Any:
        quote = ctx.step("quote", lambda: 10)
        manager = ctx.suspend("manager")
        return [quote, manager, ctx.suspend("ship")]

    @flow(name="order", version="1")
    def changed(ctx: Context, _input: Any) -> Any:
        quote = ctx.step("quote", lambda: 10)
        ctx.step("fraud_check", lambda: "ok")
        manager = ctx.suspend("manager")
        return [quote, manager, ctx.suspend("ship")]

    box = sandbox(recorded)
    box.engine.start("order", key="o")
    box.engine.resume("o", "yes")  # the manager's gate is passed
    journal = box.store.read("ex/o")
    deployed = Engine(box.store, [changed], clock=box.clock, listeners=[])
    with pytest.raises(NonDeterminismError, match="gate #0 'manager'") as caught:
        deployed.resume("o", "shipped")
    assert (caught.value.index, caught.value.found) == (1, "fraud_check")
    assert box.store.read("ex/o") == journal


def test_a_gate_added_before_a_recorded_step_names_the_step_it_found_instead() -> None:
    @flow(name="order", version="1")
    def recorded(ctx: Context, _input: Any) -> Any:
        approved = ctx.suspend("approve")
        return [approved, ctx.step("ship", lambda: "shipped")]

    @flow(name="order", version="2")
    def changed(ctx: Context, _input: Any) -> Any:
        approved = ctx.suspend("approve")
        manager = ctx.suspend("manager")  # new, where the journal has the step next
        return [approved, manager, ctx.step("ship", lambda: "shipped")]

    box = sandbox(recorded)
    box.engine.start(recorded, key="o")
    assert box.engine.resume("o", "yes").result == ["yes", "shipped"]
    journal = box.store.read("ex/o")
    both = Engine(box.store, [recorded, changed], clock=box.clock, listeners=[])
    with pytest.raises(NonDeterminismError, match=r"step #0 'ship'") as caught:
        both.replay_check("o", "2")
    assert (caught.value.index, caught.value.found) == (1, "manager")
    assert box.store.read("ex/o") == journal


def _cut_short(ops: list[Op], after: int, ending: str) -> Any:
    @flow(name="program", version="1")
    def program(ctx: Context, _input: Any) -> Any:
        for kind, name in ops[:after]:
            if kind == "step":
                ctx.step(name, lambda name=name: name)
            else:
                ctx.suspend(name)
        if ending == "fails":
            raise RuntimeError("gave up early")
        return "returned early"

    return program


@settings(max_examples=100, deadline=None)
@given(ops=ops_strategy, data=st.data())
def test_a_flow_that_ends_before_its_recorded_history_is_refused(
    ops: list[Op], data: st.DataObject
) -> None:
    store = _parked_at_last(ops)
    journal = store.read("ex/p")
    after = data.draw(st.integers(0, len(ops) - 1), label="ops the new code reaches")
    ending = data.draw(st.sampled_from(["returns", "fails"]), label="how it ends")
    changed = Engine(store, [_cut_short(ops, after, ending)], listeners=[])
    with pytest.raises(NonDeterminismError, match="first") as caught:
        changed.resume("p", "done")
    assert caught.value.found == "(nothing: the code returned first)" or ending == "fails"
    assert store.read("ex/p") == journal, "no completion journaled, the payload not spent"
    assert changed.get("p").status is Status.SUSPENDED
    done = Engine(store, [_program(ops, None)], listeners=[]).resume("p", "done")
    assert done.status is Status.COMPLETED


def test_a_flow_that_parks_before_its_recorded_steps_is_refused_as_stopped_first() -> None:
    @flow(name="parks", version="1")
    def recorded(ctx: Context, _input: Any) -> Any:
        ctx.step("a", lambda: "a")
        return ctx.suspend("g")

    @flow(name="parks", version="2")
    def parks_first(ctx: Context, _input: Any) -> Any:
        answer = ctx.suspend("g")  # the recorded gate, not resumed: the code stops here
        ctx.step("a", lambda: "a")
        return answer

    box = sandbox(recorded)
    box.engine.start(recorded, key="p")
    both = Engine(box.store, [recorded, parks_first], clock=box.clock, listeners=[])
    with pytest.raises(NonDeterminismError) as caught:
        both.replay_check("p", "2")
    assert caught.value.found == "(nothing: the code stopped first)"
