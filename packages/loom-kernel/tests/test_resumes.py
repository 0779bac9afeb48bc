"""Resumes: a payload feeds exactly the gate it was meant for, once, whichever of racing
engines or threads wins; a resume may name its gate; a dedupe key makes a redelivery a
no-op; a resume of a run not at a gate, or by an engine without its flow, is refused
and journals nothing."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from engine_helpers import EngineFactory, _journal
from loom_kernel import (
    Context,
    Engine,
    MemoryStore,
    NotSuspendedError,
    Status,
    flow,
)
from loom_kernel.spi import ConflictError, JournalStore, NewRecord
from loom_kernel.testing import FakeClock


class RendezvousStore(MemoryStore):
    """Holds every resume append until all racers have loaded the run and reached it."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(parties)

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        if records[0].kind == "EXECUTION_RESUMED":
            self.barrier.wait(timeout=10)
        return super()._append(stream, expected, records)


def test_two_engines_resuming_one_gate_at_once_one_wins(clock: FakeClock) -> None:
    @flow
    def two(ctx: Context, _input: Any) -> Any:
        return [ctx.suspend("a"), ctx.suspend("b")]

    store = RendezvousStore(parties=2)
    first, second = Engine(store, [two], clock=clock), Engine(store, [two], clock=clock)
    ex = first.start("two")
    outcomes: dict[str, str] = {}

    def resume(name: str, engine: Engine) -> None:
        try:
            engine.resume(ex.id, f"from-{name}")
            outcomes[name] = "won"
        except ConflictError:
            outcomes[name] = "conflict"

    threads = [
        threading.Thread(target=resume, args=("first", first)),
        threading.Thread(target=resume, args=("second", second)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes.values()) == ["conflict", "won"]
    winner = next(name for name, outcome in outcomes.items() if outcome == "won")
    state = first.state(ex.id)
    assert state.resume_payloads == [f"from-{winner}"], "the loser fed no gate"
    assert first.get(ex.id).waiting_on == "b"
    kinds = [r.kind for r in store.read("ex/" + ex.id)]
    assert kinds.count("EXECUTION_RESUMED") == 1


def test_racing_resumes_in_threads_deliver_exactly_once(
    store: JournalStore, clock: FakeClock
) -> None:
    @flow
    def two(ctx: Context, _input: Any) -> Any:
        return [ctx.suspend("a"), ctx.suspend("b")]

    ex = Engine(store, [two], clock=clock).start("two")
    engines = [Engine(store, [two], clock=clock) for _ in range(6)]
    for engine in engines:
        engine.get(ex.id)
    barrier = threading.Barrier(len(engines))
    outcomes: list[str] = []

    def race(number: int, engine: Engine) -> None:
        barrier.wait()
        try:
            engine.resume(ex.id, f"p{number}")
            outcomes.append("won")
        except (ConflictError, NotSuspendedError):
            outcomes.append("refused")

    threads = [threading.Thread(target=race, args=(n, e)) for n, e in enumerate(engines)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    state = engines[0].state(ex.id)
    # Each winner fed exactly the gate it saw; nothing was buffered for a later gate.
    assert len(state.resume_payloads) == outcomes.count("won") <= 2
    positions = [r.position for r in store.read("ex/" + ex.id)]
    assert positions == list(range(1, len(positions) + 1))


def test_resume_can_name_the_gate_it_means(make_engine: EngineFactory) -> None:
    engine = make_engine([flow(lambda ctx, _i: [ctx.suspend("a"), ctx.suspend("b")], name="ab")])
    ex = engine.start("ab")
    engine.resume(ex.id, "for-a", on="a")
    with pytest.raises(NotSuspendedError, match="it waits on 'b', not 'a'"):
        engine.resume(ex.id, "also-for-a", on="a")
    assert engine.resume(ex.id, "for-b", on="b").result == ["for-a", "for-b"]


def test_resume_dedupe_key_makes_redelivery_a_no_op(
    make_engine: EngineFactory, store: JournalStore
) -> None:
    engine = make_engine([flow(lambda ctx, _i: [ctx.suspend("a"), ctx.suspend("b")], name="gates")])
    ex = engine.start("gates")
    engine.resume(ex.id, "first", key="notice-1")
    before = _journal(store, ex.id)
    again = engine.resume(ex.id, "first", key="notice-1")
    assert again.waiting_on == "b", "the re-delivered notice did not feed gate b"
    assert _journal(store, ex.id) == before
    engine.resume(ex.id, "second", key="notice-2")
    assert engine.get(ex.id).result == ["first", "second"]
    assert engine.resume(ex.id, "late", key="notice-2").status is Status.COMPLETED


def test_resume_of_a_run_not_at_a_gate_is_refused(
    make_engine: EngineFactory, store: JournalStore
) -> None:
    @flow
    def nap(ctx: Context, _input: Any) -> str:
        ctx.sleep(100)
        return "up"

    engine = make_engine([nap, flow(lambda ctx, i: i, name="echo")])
    sleeping = engine.start("nap")
    with pytest.raises(NotSuspendedError, match="fire_due_timers"):
        engine.resume(sleeping.id, "early")
    done = engine.start("echo", 5)
    before = _journal(store, done.id)
    with pytest.raises(NotSuspendedError, match="completed, not parked"):
        engine.resume(done.id, "late")
    assert _journal(store, done.id) == before


def test_resuming_a_run_whose_flow_this_engine_lacks_leaves_the_drive_to_one_that_has_it(
    make_engine: EngineFactory, store: JournalStore
) -> None:
    gate = flow(lambda ctx, _i: ctx.suspend("g"), name="gate")
    make_engine([gate]).start("gate", key="r")
    other = make_engine([flow(lambda ctx, _i: 1, name="other")])
    resumed = other.resume("r", 1)
    assert (resumed.status, resumed.owner) == (Status.RUNNING, None), "journaled, not driven"
    assert [entry.event.KIND for entry in other.history("r")][-1] == "EXECUTION_RESUMED"
    worker = make_engine([gate])
    assert worker.recover() == ["r"]
    assert worker.get("r").result == 1
