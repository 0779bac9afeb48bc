"""A drive's journal writer and the head (`_replay/_writer.py`): steps in a tight loop do
not look at the head between them, a step long after the last append does, a move by
another process in the instant after an append is found at the next one; on a store
whose head is costly no step looks first, and a cancel still holds."""

from __future__ import annotations

from typing import Any

import pytest
from loom_kernel import Context, Engine, MemoryStore, Status, flow
from loom_kernel._core import encode_event
from loom_kernel._replay import _writer
from loom_kernel.events import ExecutionClaimed
from loom_kernel.testing import FakeClock


class _CountedHeads(MemoryStore):
    """Counts head() calls; can write a claim by another worker, as another process
    would, right after the run's first step is journaled (past the process's count)."""

    def __init__(self, *, foreign_claim: bool = False) -> None:
        super().__init__()
        self.heads = 0
        self.foreign_claim = foreign_claim

    def _head(self, stream: str) -> int:
        self.heads += 1
        return super()._head(stream)

    def _append(self, stream: str, expected: int, records: Any) -> int:
        head = super()._append(stream, expected, records)
        if self.foreign_claim and stream == "ex/r" and records[0].kind == "STEP_COMPLETED":
            self.foreign_claim = False
            claim = encode_event(ExecutionClaimed("thief", "x"), 0.0)
            head = super()._append(stream, head, (claim,))
        return head


def test_steps_in_a_tight_loop_do_not_look_at_the_head_between_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_writer, "_FRESH_HEAD", 60.0)  # a loaded machine's pauses

    @flow(name="loop", version="1")
    def loop(ctx: Context, steps: int) -> Any:
        return [ctx.step(f"s{index}", lambda index=index: index) for index in range(steps)]

    looks = []
    for steps in (1, 20):
        store = _CountedHeads()
        Engine(store, [loop], listeners=[]).start("loop", steps, key="r")
        looks.append(store.heads)
    assert looks[0] == looks[1]  # the first step's look; none after the drive's own appends


def test_a_step_long_after_the_last_append_looks_at_the_head_first() -> None:
    import time

    store = _CountedHeads(foreign_claim=True)
    effects: list[str] = []

    @flow(name="slow", version="1")
    def slow(ctx: Context, _input: Any) -> Any:
        ctx.step("first", lambda: "first")
        time.sleep(0.01)  # flow code between steps, far longer than an instant
        return ctx.step("second", lambda: effects.append("second"))

    Engine(store, [slow], listeners=[]).start("slow", key="r")
    assert effects == [], "it saw the other worker's claim before starting the step"


def test_a_move_by_another_process_in_the_instant_after_an_append_is_found_at_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_writer, "_FRESH_HEAD", 60.0)  # the instant, however slow
    store = _CountedHeads(foreign_claim=True)
    effects: list[str] = []

    @flow(name="quick", version="1")
    def quick(ctx: Context, _input: Any) -> Any:
        ctx.step("first", lambda: "first")
        return ctx.step("second", lambda: effects.append("second"))

    engine = Engine(store, [quick], listeners=[])
    engine.start("quick", key="r")
    # The step ran (no look at the head in that instant), its append was refused.
    assert effects == ["second"]
    assert engine.get("r").owner == "thief"
    assert [record.kind for record in store.read("ex/r")].count("STEP_COMPLETED") == 1


class _CostlyHeadStore(MemoryStore):
    """A store that says its head is a round trip, as S3's is."""

    head_is_cheap = False

    def __init__(self) -> None:
        super().__init__()
        self.heads = 0

    def _head(self, stream: str) -> int:
        if stream.startswith("ex/"):  # a run's journal (the run index has its own heads)
            self.heads += 1
        return super()._head(stream)


def test_a_store_with_a_costly_head_is_not_asked_before_each_step_yet_a_cancel_holds(
    clock: FakeClock,
) -> None:
    store = _CostlyHeadStore()
    ran: list[str] = []
    other = Engine(store, [], clock=clock)

    @flow
    def racing(ctx: Context, _input: Any) -> Any:
        ctx.step("one", lambda: ran.append("one"))
        other.cancel(ctx.execution_id, "meanwhile")
        ctx.step("two", lambda: ran.append("two"))  # runs: nobody looked at the head
        return "done"

    @flow
    def ten(ctx: Context, _input: Any) -> Any:
        return [ctx.step(f"s{index}", lambda index=index: index) for index in range(10)]

    engine = Engine(store, [racing, ten], clock=clock)
    store.heads = 0
    engine.start("ten")
    assert store.heads == 0, "no head lookups between steps"
    ex = engine.start("racing", key="r")
    assert ran == ["one", "two"]  # at least once, as documented ...
    view = engine.get(ex.id)
    assert view.status is Status.CANCELLED  # ... but its result was never journaled
    assert [frame.name for frame in engine.frames(ex.id).values()] == ["one"]


@pytest.mark.usefixtures("flow_loop")
def test_a_cancel_landing_between_two_steps_stops_the_next_one_on_a_store_with_costly_heads() -> (
    None
):
    effects: list[str] = []
    engines: list[Engine] = []

    class CancelledBetweenSteps(MemoryStore):
        head_is_cheap = False

        def _append(self, stream: str, expected: int, records: Any) -> int:
            head = super()._append(stream, expected, records)
            if stream == "ex/c" and b'"name":"a"' in records[0].payload:
                engines[0].cancel("c", "between the steps")
            return head

    @flow(name="pair", version="1")
    def pair(ctx: Context, _input: Any) -> Any:
        ctx.step("a", lambda: effects.append("a"))
        ctx.step("b", lambda: effects.append("b"))
        return "done"

    engine = Engine(CancelledBetweenSteps(), [pair], listeners=[])
    engines.append(engine)
    assert engine.start("pair", key="c").status is Status.CANCELLED
    assert effects == ["a"], "the cancel stopped the run before step b ran"
