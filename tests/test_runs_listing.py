"""`Engine.runs`: a listing read from the run index for ended runs (no journal read),
from journals only for open ones, newest first, filtered, and in agreement with the
journals (`executions`) on every store."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel import (
    NO_RETRY,
    Context,
    Engine,
    InvalidArgumentError,
    MemoryStore,
    Retention,
    Status,
    flow,
)
from loom_kernel.spi import JournalStore, NewRecord, Record
from loom_kernel.testing import FakeClock
from store_kinds import StoreFactory


@flow(name="list.done")
def done(ctx: Context, value: int) -> Any:
    return ctx.step("work", lambda: value)


@flow(name="list.fails")
def fails(ctx: Context, _value: int) -> Any:
    def boom() -> None:
        raise ValueError("boom")

    return ctx.step("boom", boom, retry=NO_RETRY)


@flow(name="list.parks")
def parks(ctx: Context, _value: int) -> Any:
    return ctx.suspend("approve")


@flow(name="list.parent")
def parent(ctx: Context, value: int) -> Any:
    ctx.step(
        "child",
        lambda: (
            ctx.engine.start("list.done", value, key=f"kid-{value}", parent=ctx.execution_id).id
        ),
    )
    return value


FLOWS = [done, fails, parks, parent]


def _engine(store: JournalStore, clock: FakeClock) -> Engine:
    return Engine(store, FLOWS, clock=clock, listeners=[])


def _started(engine: Engine, clock: FakeClock, flow_name: str, value: int, key: str) -> None:
    clock.advance(10)
    engine.start(flow_name, value, key=key)


def test_runs_are_listed_newest_first_with_their_times_gate_and_parent(
    new_store: StoreFactory,
) -> None:
    clock = FakeClock(start=1_000.0)
    engine = _engine(new_store(), clock)
    _started(engine, clock, "list.done", 1, "a-done")
    _started(engine, clock, "list.fails", 2, "b-failed")
    _started(engine, clock, "list.parks", 3, "c-parked")
    _started(engine, clock, "list.parent", 4, "d-parent")
    clock.advance(5)
    engine.cancel("c-parked", reason="no")
    _started(engine, clock, "list.parks", 5, "e-parked")
    listed = engine.runs()
    assert [run.id for run in listed] == [
        "e-parked",
        "d-parent",
        "kid-4",
        "c-parked",
        "b-failed",
        "a-done",
    ]
    by_id = {run.id: run for run in listed}
    assert by_id["a-done"].status is Status.COMPLETED
    assert by_id["b-failed"].status is Status.FAILED
    assert by_id["c-parked"].status is Status.CANCELLED
    assert by_id["e-parked"].status is Status.SUSPENDED
    assert by_id["e-parked"].waiting_on == "approve"
    assert by_id["e-parked"].ended_at is None
    assert by_id["kid-4"].parent == "d-parent"
    assert by_id["a-done"].flow == "list.done"
    for run in listed:
        assert run.started_at is not None
        assert run.started_at >= 1_000.0
        if run.status.finished:
            assert run.ended_at is not None
            assert run.ended_at >= run.started_at
    cancelled_at, parent_started = by_id["c-parked"].ended_at, by_id["d-parent"].started_at
    assert cancelled_at is not None
    assert parent_started is not None
    assert cancelled_at > parent_started  # cancelled after it


def test_runs_filter_by_status_flow_prefix_time_and_limit(new_store: StoreFactory) -> None:
    clock = FakeClock(start=1_000.0)
    engine = _engine(new_store(), clock)
    for number in range(6):
        _started(engine, clock, "list.done" if number % 2 else "list.parks", number, f"r{number}")
    assert [run.id for run in engine.runs(status="completed")] == ["r5", "r3", "r1"]
    assert [run.id for run in engine.runs(status=["suspended"], flow="list.parks")] == [
        "r4",
        "r2",
        "r0",
    ]
    assert [run.id for run in engine.runs(limit=2)] == ["r5", "r4"]
    assert [run.id for run in engine.runs(since=1_035.0)] == ["r5", "r4", "r3"]
    moment = datetime.fromtimestamp(1_045.0, UTC)
    assert [run.id for run in engine.runs(since=moment)] == ["r5", "r4"]
    assert [run.id for run in engine.runs("r1")] == ["r1"]
    for bad in ({"limit": -1}, {"since": float("nan")}, {"since": datetime(2026, 1, 1)}):
        with pytest.raises(InvalidArgumentError):
            engine.runs(**bad)


class _CountingStore(MemoryStore):
    """Counts the reads of each run's journal."""

    def __init__(self) -> None:
        super().__init__()
        self.journal_reads: list[str] = []

    def read(self, stream: str, after: int = 0, limit: int | None = None) -> list[Record]:
        if stream.startswith("ex/"):
            self.journal_reads.append(stream)
        return super().read(stream, after, limit)

    def raw_read(self, stream: str, after: int = 0, limit: int | None = None) -> list[Record]:
        if stream.startswith("ex/"):
            self.journal_reads.append(stream)
        return super().raw_read(stream, after, limit)


def test_runs_read_no_ended_runs_journal() -> None:
    store = _CountingStore()
    clock = FakeClock(start=1_000.0)
    engine = _engine(store, clock)
    for number in range(50):
        _started(engine, clock, "list.done", number, f"ended-{number:02d}")
    _started(engine, clock, "list.parks", 0, "open-one")
    fresh = _engine(store, clock)  # no state cached: what a listing process would be
    store.journal_reads.clear()
    listed = fresh.runs()
    assert len(listed) == 51
    assert set(store.journal_reads) == {"ex/open-one"}, "only the open run's journal"


def test_an_index_rebuilt_by_recover_knows_times_and_parents(new_store: StoreFactory) -> None:
    store = new_store()
    clock = FakeClock(start=1_000.0)
    engine = _engine(store, clock)
    _started(engine, clock, "list.parent", 7, "p")
    before = {run.id: run for run in engine.runs()}
    copy = new_store()  # the journals alone, as a store from before the index holds them
    for stream in store.streams("ex/"):
        records = [NewRecord(r.kind, r.payload, r.timestamp) for r in store.read(stream)]
        copy.append(stream, 0, records)
    fresh = _engine(copy, clock)
    fresh.recover()
    after = {run.id: run for run in fresh.runs()}
    assert after.keys() == before.keys() == {"p", "kid-7"}
    assert after["kid-7"].parent == "p"
    for execution_id, run in after.items():
        assert run.status is before[execution_id].status
        assert run.started_at == before[execution_id].started_at
        assert run.ended_at is not None


def test_an_id_used_again_after_retention_is_listed_as_its_new_run() -> None:
    store = MemoryStore()
    clock = FakeClock(start=1_000.0)
    engine = _engine(store, clock)
    _started(engine, clock, "list.done", 1, "again")
    clock.advance(100)
    assert list(engine.gc(Retention(keep_for=10)).deleted) == ["again"]
    assert engine.runs() == []
    _started(engine, clock, "list.parks", 2, "again")
    [run] = engine.runs()
    assert (run.id, run.status, run.generation) == ("again", Status.SUSPENDED, 2)


_STEPS = st.lists(
    st.tuples(
        st.sampled_from(["list.done", "list.fails", "list.parks", "list.parent"]), st.booleans()
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=_STEPS)
def test_runs_agree_with_the_journals(steps: Sequence[tuple[str, bool]]) -> None:
    """Whatever ran, the listing from the index says what `executions` reads from every
    journal: the same runs, statuses, flows and parents."""
    store = MemoryStore()
    clock = FakeClock(start=1_000.0)
    engine = _engine(store, clock)
    for number, (flow_name, settle) in enumerate(steps):
        _started(engine, clock, flow_name, number, f"run-{number:02d}")
        if flow_name == "list.parks" and settle:
            engine.resume(f"run-{number:02d}", "yes", on="approve")
    for reader in (engine, _engine(store, clock)):
        runs = reader.runs()
        listed = {run.id: (run.status, run.flow, run.parent) for run in runs}
        truth = {e.id: (e.status, e.flow, e.parent) for e in reader.executions()}
        assert listed == truth
        newest_first = sorted(
            runs, key=lambda run: (run.started_at is None, -(run.started_at or 0.0), run.id)
        )
        assert runs == newest_first, "newest start first, ties by id, unknown starts last"
