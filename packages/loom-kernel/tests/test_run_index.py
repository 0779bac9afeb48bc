"""The run index: store-wide calls cost the runs still open (and the runs that match),
never every run the store holds, and the index stays right through crashes between
any two of its writes."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel import (
    Context,
    Engine,
    ExecutionNotFoundError,
    MemoryStore,
    NotSuspendedError,
    SchemaError,
    Status,
    flow,
)
from loom_kernel._coordination import RunIndex, partition_of
from loom_kernel._engine import parts_of
from loom_kernel.spi import NewRecord
from loom_kernel.testing import FakeClock

REMOTE = "other-host.1:4242:abcdef"  # a worker of another machine: only its lease tells


class CountingStore(MemoryStore):
    """Counts the reads and heads of execution journals."""

    def __init__(self) -> None:
        super().__init__()
        self.journal_reads: Counter[str] = Counter()

    def _read(self, stream: str, after: int, limit: int | None) -> Any:
        if stream.startswith("ex/"):
            self.journal_reads[stream] += 1
        return super()._read(stream, after, limit)

    def _head(self, stream: str) -> int:
        if stream.startswith("ex/"):
            self.journal_reads[stream] += 1
        return super()._head(stream)


@flow(name="work", version="1")
def work(ctx: Context, what: str) -> Any:
    ctx.step("first", lambda: what)
    if what == "fail":
        raise ValueError("asked to fail")
    if what == "park":
        return ctx.suspend("approval")
    return what


@flow(name="other", version="1")
def other(ctx: Context, what: str) -> Any:
    return ctx.step("only", lambda: what)


def _engine(store: MemoryStore, clock: FakeClock | None = None, **options: Any) -> Engine:
    return Engine(store, [work, other], clock=clock or FakeClock(), listeners=[], **options)


@pytest.mark.parametrize("finished", [10, 400])
def test_recover_with_nothing_to_do_reads_no_finished_journal(finished: int) -> None:
    store = CountingStore()
    engine = _engine(store)
    for number in range(finished):
        engine.start("work", "fail" if number % 7 == 0 else "done")
    parked = engine.start("work", "park", key="parked")
    store.journal_reads.clear()
    assert _engine(store).recover() == []
    assert set(store.journal_reads) == {"ex/parked"}, "only the open run is looked at"
    assert engine.get(parked.id).status is Status.SUSPENDED


def test_executions_by_status_and_flow_read_only_the_runs_that_match() -> None:
    store = CountingStore()
    engine = _engine(store)
    expected: dict[str, set[str]] = {status.value: set() for status in Status}
    for number in range(120):
        what = ["done", "fail", "park", "done"][number % 4]
        run = engine.start("work" if number % 3 else "other", what, key=f"r{number:03d}")
        expected[engine.get(run.id).status.value].add(run.id)
    engine.cancel("r010", "not needed")
    expected["suspended"].discard("r010")
    expected["cancelled"].add("r010")
    fresh = _engine(store)
    for status, ids in expected.items():
        store.journal_reads.clear()
        found = [execution.id for execution in fresh.executions(status=status)]
        assert found == sorted(ids), status
        assert all(execution.status == status for execution in fresh.executions(status=status))
    failed_other = [e.id for e in fresh.executions(status=Status.FAILED, flow="other")]
    assert failed_other == sorted(i for i in expected["failed"] if not int(i[1:]) % 3)
    store.journal_reads.clear()
    cold = _engine(store)  # nothing cached
    assert [e.id for e in cold.executions(status="failed")] == sorted(expected["failed"])
    parked = len(expected["suspended"])
    assert len(store.journal_reads) == len(expected["failed"]) + parked, "matches and open runs"
    both = {e.id for e in fresh.executions(status=["completed", "cancelled"])}
    assert both == expected["completed"] | expected["cancelled"]
    assert {e.id for e in fresh.executions(flow="other")} == {
        f"r{number:03d}" for number in range(0, 120, 3)
    }


def test_executions_by_flow_include_the_runs_moved_to_their_status_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Closed runs compacted out of the open partitions (into `runs/<status>/<p>`) are
    listed by flow as the still-open partitions' closed ones are."""
    from loom_kernel._coordination import _run_index

    monkeypatch.setattr(_run_index, "_COMPACT_AT", 2)
    store = CountingStore()
    engine = _engine(store)
    for number in range(64):
        engine.start("work" if number % 2 else "other", "done", key=f"r{number:03d}")
    assert engine.recover() == []  # reads the open partitions: compacts them
    fresh = _engine(store)
    assert len(list(parts_of(fresh).driver.runs.ended(Status.COMPLETED))) > 32, "most were moved"
    others = {f"r{number:03d}" for number in range(0, 64, 2)}
    assert {e.id for e in fresh.executions(flow="other")} == others
    assert {e.id for e in fresh.executions(flow="other", status="completed")} == others


def test_an_unknown_status_is_refused() -> None:
    from loom_kernel import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="a status is one of"):
        list(_engine(MemoryStore()).executions(status="done"))


def test_a_hint_whose_run_never_started_is_dropped_once_its_writer_is_gone() -> None:
    store, clock = MemoryStore(), FakeClock(1_000.0)
    engine = _engine(store, clock, lease=30.0)
    engine.start("work", "done")  # the store is indexed from its first start
    RunIndex(store, clock).opened("ghost", "work", REMOTE)  # its writer died right after
    assert engine.recover() == []
    assert [hint.execution_id for hint in parts_of(engine).driver.runs.open_runs()] == ["ghost"], (
        "may still land"
    )
    clock.advance(31.0)
    assert engine.recover() == []
    assert list(parts_of(engine).driver.runs.open_runs()) == []


def test_a_partition_deleted_under_the_index_reads_as_empty() -> None:
    store, clock = MemoryStore(), FakeClock(1_000.0)
    index = RunIndex(store, clock)
    index.opened("gone", "work", REMOTE)
    partition = partition_of("gone")
    assert [hint.execution_id for hint in index.open_in(partition)[1]] == ["gone"]
    store.delete(f"runs/open/{partition}")
    assert index.open_in(partition) == (0, [])
    assert list(RunIndex(store, clock).open_runs([partition])) == []


def test_a_hint_of_a_dead_process_of_this_machine_is_dropped_at_once() -> None:
    from loom_kernel._coordination._leases import _THIS_MACHINE

    store, clock = MemoryStore(), FakeClock(1_000.0)
    engine = _engine(store, clock)
    engine.start("work", "done")
    RunIndex(store, clock).opened("ghost", "work", f"{_THIS_MACHINE}:3999999:abcdef")
    engine.recover()
    assert list(parts_of(engine).driver.runs.open_runs()) == []


def test_a_start_that_lands_after_its_hint_was_judged_is_still_found() -> None:
    store, clock = MemoryStore(), FakeClock(1_000.0)
    engine = _engine(store, clock)
    engine.start("work", "done")
    RunIndex(store, clock).opened("late", "work", REMOTE)
    clock.advance(10.0)
    _engine(store, clock).recover()  # its writer was seen 10 s ago: kept
    late = _engine(store, clock, worker_id=REMOTE)
    late.start("work", "park", key="late")
    assert [e.id for e in engine.executions(status="suspended")] == ["late"]


def test_a_crash_after_a_run_ended_and_before_it_was_closed_is_closed_by_recover() -> None:
    store = MemoryStore()
    delivered: list[str] = []

    def closing_crashes(_execution: Any) -> None:
        raise KeyboardInterrupt  # the process dies between the end and the close

    engine = _engine(store)
    parts_of(engine).driver.close = closing_crashes  # type: ignore[method-assign,assignment]
    with pytest.raises(KeyboardInterrupt):
        engine.start("work", "done", key="r")
    assert [hint.execution_id for hint in parts_of(engine).driver.runs.open_runs()] == ["r"]
    fresh = _engine(store)
    fresh.add_listener(lambda _engine, execution: delivered.append(execution.id))
    assert fresh.recover() == []
    assert delivered == ["r"], "its listeners are called again"
    assert list(parts_of(fresh).driver.runs.open_runs()) == []
    assert [e.id for e in fresh.executions(status="completed")] == ["r"]


@pytest.mark.parametrize("failure", ["loom error", "bug"])
def test_a_run_whose_listener_failed_stays_open_until_a_recover_delivers_it(
    failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    from loom_kernel import StoreUnavailableError

    store = MemoryStore()
    attempts: list[str] = []

    def flaky(_engine: Engine, execution: Any) -> None:
        attempts.append(execution.id)
        if len(attempts) == 1 and failure == "bug":
            raise ValueError("a listener bug")
        if len(attempts) == 1:
            raise StoreUnavailableError("the parent could not be woken")

    engine = _engine(store)
    engine.add_listener(flaky)
    if failure == "bug":
        with pytest.raises(ValueError, match="a listener bug"):  # raised, and still open
            engine.start("work", "done", key="r")
    else:
        with caplog.at_level("WARNING", logger="loom"):
            engine.start("work", "done", key="r")
        assert "on 'r': StoreUnavailableError: the parent could not be woken" in caplog.text
    assert [hint.execution_id for hint in parts_of(engine).driver.runs.open_runs()] == ["r"]
    engine.recover()
    assert attempts == ["r", "r"]
    assert list(parts_of(engine).driver.runs.open_runs()) == []


def test_a_store_first_used_by_an_indexing_engine_is_marked_built_for_every_engine() -> None:
    store = MemoryStore()
    first = _engine(store)
    assert parts_of(first).driver.runs.built(), "an empty store is indexed from its first run"
    first.start("work", "done", key="r1")
    assert parts_of(_engine(store)).driver.runs.built(), (
        "the mark is in the store, not in one engine"
    )


def test_a_store_written_before_the_index_is_indexed_by_its_first_recover() -> None:
    written = MemoryStore()
    engine = _engine(written)
    for number in range(40):
        engine.start("work", ["done", "fail", "park"][number % 3], key=f"r{number:02d}")
    store = CountingStore()  # the journals alone, as Loom wrote them before the index
    for stream in written.streams("ex/"):
        store.append(stream, 0, [_copy(r) for r in written.read(stream)])
    old = _engine(store)
    assert not parts_of(old).driver.runs.built()
    failed = sorted(f"r{number:02d}" for number in range(1, 40, 3))
    assert [e.id for e in old.executions(status="failed")] == failed, "by listing every run"
    assert old.recover() == []
    assert parts_of(old).driver.runs.built()
    store.journal_reads.clear()
    fresh = _engine(store)
    assert [e.id for e in fresh.executions(status="failed")] == failed
    assert fresh.recover() == []
    parked = {f"r{number:02d}" for number in range(2, 40, 3)}
    assert {stream.removeprefix("ex/") for stream in store.journal_reads} == parked | set(failed)


def test_a_damaged_index_record_falls_back_to_the_journals_and_is_rewritten(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    engine = _engine(store)
    parked = engine.start("work", "park", key="p")
    engine.start("work", "fail", key="f")
    stream = "runs/open/" + partition_of("p")
    store.append(stream, store.head(stream), [NewRecord("loom.run.open", b"{not json", 0.0)])
    with pytest.raises(SchemaError):
        list(parts_of(engine).driver.runs.open_runs())
    with caplog.at_level("WARNING", logger="loom"):
        assert [e.id for e in engine.executions(status="failed")] == ["f"]
    assert "listing every journal instead" in caplog.text, "the fallback is said"
    caplog.clear()
    with caplog.at_level("WARNING", logger="loom"):
        assert {run.id for run in engine.runs()} == {"p", "f"}
    assert "listing every journal instead" in caplog.text, "so is the listing's"
    assert engine.recover() == []
    assert [hint.execution_id for hint in parts_of(engine).driver.runs.open_runs()] == [
        parked.id
    ], "repaired"
    assert [e.id for e in engine.executions(status="failed")] == ["f"]


def test_many_closed_runs_are_compacted_out_of_their_partition() -> None:
    store = MemoryStore()
    engine = _engine(store)
    for number in range(600):
        engine.start("work", "done", key=f"r{number:03d}")
    list(parts_of(engine).driver.runs.open_runs())  # a reader compacts what it reads
    for partition in parts_of(engine).driver.runs.partitions():
        assert (
            len(store.read(f"runs/open/{partition}", store.head(f"runs/open/{partition}") - 1)) == 1
        )
    assert len(list(engine.executions(status="completed"))) == 600


def _copy(record: Any) -> NewRecord:
    return NewRecord(record.kind, record.payload, record.timestamp)


# -- a model: any order of starts, ends, crashes and compactions --------------------

_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["done", "fail", "park", "resume", "cancel", "ghost", "crash-close", "delete", "read"]
        ),
        st.integers(0, 11),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_OPS)
def test_the_index_answers_as_a_full_listing_would_whatever_crashed(ops: list[Any]) -> None:
    store, clock = MemoryStore(), FakeClock(1_000.0)
    engine = _engine(store, clock)

    def crashing_close(_execution: Any) -> None:
        raise KeyboardInterrupt

    for op, number in ops:
        key = f"r{number}"
        clock.advance(1.0)
        try:
            if op in ("done", "fail", "park"):
                engine.start("work", op, key=key)
            elif op == "resume":
                engine.resume(key, "yes")
            elif op == "cancel":
                engine.cancel(key)
            elif op == "ghost":
                RunIndex(store, clock).opened(key, "work", REMOTE)
            elif op == "crash-close":
                crashing = _engine(store, clock)
                parts_of(crashing).driver.close = crashing_close  # type: ignore[method-assign,assignment]
                crashing.start("work", "done", key=key)
            elif op == "delete":
                store.delete("ex/" + key)
            else:
                list(parts_of(engine).driver.runs.open_runs())
        except (KeyboardInterrupt, NotSuspendedError, ExecutionNotFoundError):
            pass  # a crash, or a refusal the model expects
    clock.advance(60.0)
    fresh = _engine(store, clock)
    fresh.recover()
    truth = {e.id: e.status for e in _engine(store, clock).executions()}
    for status in Status:
        indexed = [e.id for e in fresh.executions(status=status)]
        assert indexed == sorted(i for i, s in truth.items() if s is status), status
    still_open = {hint.execution_id for hint in parts_of(fresh).driver.runs.open_runs()}
    assert still_open == {i for i, s in truth.items() if not s.finished}


def test_a_bad_prefix_is_refused_with_a_status_filter_too() -> None:
    from loom_kernel import InvalidIdError

    engine = _engine(MemoryStore())
    for bad in ("../x", 5):
        with pytest.raises(InvalidIdError):
            list(engine.executions(bad, status="failed"))  # type: ignore[arg-type]


def test_a_start_paused_between_its_hint_and_its_record_writes_the_hint_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The process froze longer than a lease right after its hint; another worker
    dropped the hint meanwhile. The start, once it lands, hints again."""
    import time

    store, clock = MemoryStore(), FakeClock(1_000.0)
    engine = _engine(store, clock, lease=30.0)
    engine.start("work", "done")
    real = time.monotonic
    frozen = {"at": 0.0}

    original_append = store._append

    def append_after_a_freeze(stream: str, expected: int, records: Any) -> int:
        if stream == "ex/late" and expected == 0:
            clock.advance(31.0)  # frozen for 31 s: another worker looks meanwhile
            assert _engine(store, clock).recover() == []  # drops the hint: not seen for a lease
            assert "late" not in {h.execution_id for h in parts_of(engine).driver.runs.open_runs()}
            frozen["at"] = 31.0  # thawed: this process's monotonic clock moved on too
            parts_of(
                engine
            ).driver.heartbeat.beat()  # and its overdue heartbeat beats before the start lands
        return original_append(stream, expected, records)

    monkeypatch.setattr(store, "_append", append_after_a_freeze)
    monkeypatch.setattr(time, "monotonic", lambda: real() + frozen["at"])
    engine.start("work", "park", key="late")
    assert [e.id for e in _engine(store, clock).executions(status="suspended")] == ["late"]


def test_a_full_listing_never_drops_a_hint_whose_start_is_on_its_way() -> None:
    """A recover() that lists every journal (here: a store from before the index)
    runs while a start has written its hint and not yet its record."""
    written = MemoryStore()
    _engine(written).start("work", "park", key="old")
    store = MemoryStore()
    for stream in written.streams("ex/"):
        store.append(stream, 0, [_copy(r) for r in written.read(stream)])
    clock = FakeClock(1_000.0)
    RunIndex(store, clock).opened("coming", "work", REMOTE)  # its start is on its way
    assert _engine(store, clock).recover() == []
    _engine(store, clock, worker_id=REMOTE).start("work", "park", key="coming")
    assert {e.id for e in _engine(store, clock).executions(status="suspended")} == {
        "old",
        "coming",
    }


def test_a_store_is_not_marked_indexed_when_a_run_could_not_be_looked_at() -> None:
    from loom_kernel import CodeVersionError

    @flow(name="work", version="2")
    def work_v2(ctx: Context, what: str) -> Any:
        return what

    written = MemoryStore()
    _engine(written).start("work", "park", key="parked")
    store = MemoryStore()
    for stream in written.streams("ex/"):
        records = [_copy(r) for r in written.read(stream)]
        store.append(stream, 0, records[:1])  # left running on version 1
    newer = Engine(store, [work_v2], clock=FakeClock(10_000.0), listeners=[])
    with pytest.raises(CodeVersionError):
        newer.recover()
    assert not parts_of(newer).driver.runs.built(), "a run it could not look at may be anything"
    assert [h.execution_id for h in parts_of(newer).driver.runs.open_runs()] == ["parked"]


def test_a_hint_of_a_run_that_has_only_its_start_is_not_abandoned() -> None:
    from loom_kernel._coordination import OpenHint

    store = MemoryStore()
    engine = Engine(store, [], listeners=[])
    store.append("ex/started", 0, [NewRecord("EXECUTION_STARTED", b"{}", 0.0)])
    ancient = OpenHint("started", "f", None, 0.0)  # no writer, a lease ago and more
    assert not parts_of(engine).recovery.hint_abandoned(ancient), "it started: its hint stays"
    assert parts_of(engine).recovery.hint_abandoned(OpenHint("never", "f", None, 0.0))


def test_a_rebuild_of_a_healthy_index_that_agrees_with_the_listing_writes_nothing() -> None:
    store = MemoryStore()
    engine = Engine(store, [work], listeners=[])
    for number in range(20):
        engine.start("work", "park" if number % 2 else "done", key=f"r{number}")
    heads = {p: store.head(f"runs/open/{p}") for p in RunIndex.partitions()}
    parts_of(engine).driver.runs.rebuild(parts_of(engine).driver.runs.open_runs(), {})
    assert {p: store.head(f"runs/open/{p}") for p in RunIndex.partitions()} == heads


def test_a_damaged_partition_keeps_open_what_was_opened_before_a_checkpoint() -> None:
    from loom_kernel._coordination._run_index import _fold_readable

    store, clock = MemoryStore(), FakeClock()
    index = RunIndex(store, clock)
    index.opened("early", "work", None)
    stream = f"runs/open/{partition_of('early')}"
    head = store.head(stream)
    checkpoint = NewRecord("loom.run.checkpoint", b'{"open": []}', clock())
    damaged = NewRecord("loom.run.opened", b"{not json", clock())
    store.append(stream, head, [checkpoint, damaged])
    opened, closed, was_damaged = _fold_readable(stream, store.read(stream))
    assert was_damaged
    assert "early" in opened, "a superset of the truth: nothing opened is dropped"
    assert closed == {}


def test_a_poll_reads_no_partition_whose_head_did_not_move() -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from loom_kernel._hosting._slots import Slots, WorkerStats
    from loom_kernel._hosting._visits import OpenRunVisits

    class PartitionReads(MemoryStore):
        reads = 0

        def _read(self, stream: str, after: int, limit: int | None) -> Any:
            if stream.startswith("runs/open/"):
                self.reads += 1
            return super()._read(stream, after, limit)

    store = PartitionReads()
    engine = Engine(store, [work], listeners=[])
    engine.start("work", "park", key="p")  # open: a poll visits it once
    parts, stats = parts_of(engine), WorkerStats()
    slots = Slots(parts, 1, stats, threading.Event(), threading.Event())
    visits = OpenRunVisits(parts, slots, stats)
    with ThreadPoolExecutor(1) as pool:
        slots.open(pool, None)
        assert visits.visit_open(sweep=False) == 1
        store.reads = 0
        assert visits.visit_open(sweep=False) == 0
    assert store.reads == 0


def test_a_nudge_refreshes_an_open_hint_and_never_reopens_a_closed_run() -> None:
    clock = FakeClock()
    index = RunIndex(MemoryStore(), clock)
    index.opened("open-run", "f", "w1")
    index.opened("closed-run", "f", "w1")
    index.closed("closed-run", Status.COMPLETED, "f")
    clock.advance(5)
    index.nudged("open-run", "f")
    index.nudged("closed-run", "f")
    index.nudged("never-opened", "f")
    hints = {hint.execution_id: hint for hint in index.open_runs()}
    assert set(hints) == {"open-run"}
    assert (hints["open-run"].by, hints["open-run"].at) == (None, clock())
    assert partition_of("open-run") in index.partitions()


def test_a_run_the_index_cannot_close_is_logged_and_left_open_for_recover(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class NoClosing(MemoryStore):
        refuse = True

        def _append(self, stream: str, expected: int, records: Any) -> int:
            if (
                self.refuse
                and stream.startswith("runs/open/")
                and b'"status"' in records[0].payload
            ):
                from loom_kernel import StoreUnavailableError

                raise StoreUnavailableError("the index is down")
            return super()._append(stream, expected, records)

    store = NoClosing()
    engine = _engine(store)
    with caplog.at_level("WARNING", logger="loom"):
        assert engine.start("work", "done", key="d").status is Status.COMPLETED
    assert "d not closed in the run index" in caplog.text
    assert [hint.execution_id for hint in parts_of(engine).driver.runs.open_runs()] == ["d"], (
        "still open"
    )
    store.refuse = False
    engine.recover()
    assert list(parts_of(engine).driver.runs.open_runs()) == [], "closed by the next recover()"


def test_runs_closed_in_a_damaged_partition_are_filed_under_their_status_when_it_is_rewritten() -> (
    None
):
    store = MemoryStore()
    engine = _engine(store)
    parked = engine.start("work", "park", key="p")
    partition = partition_of("p")
    failed = next(f"f{i}" for i in range(1000) if partition_of(f"f{i}") == partition)
    engine.start("work", "fail", key=failed)  # closed in the partition that will be damaged
    stream = "runs/open/" + partition
    store.append(stream, store.head(stream), [NewRecord("loom.run.open", b"{not json", 0.0)])
    assert engine.recover() == []
    assert [hint.execution_id for hint in parts_of(engine).driver.runs.open_runs()] == [
        parked.id
    ], "repaired"
    assert (failed, "work") in set(parts_of(engine).driver.runs.ended(Status.FAILED)), (
        "filed, not dropped"
    )
    assert [e.id for e in engine.executions(status="failed")] == [failed]


def test_a_compaction_that_fails_is_logged_and_leaves_the_partition_readable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from loom_kernel import StoreUnavailableError

    class NoTrim(MemoryStore):
        def _trim(self, stream: str, before: int) -> None:
            raise StoreUnavailableError("trims are failing")

    store = NoTrim()
    engine = _engine(store)
    keys = [f"t{n}" for n in range(2000) if partition_of(f"t{n}") == partition_of("t0")][:40]
    for key in keys:  # 40 closed in one partition: a reader compacts it
        engine.start("work", "done", key=key)
    with caplog.at_level("WARNING", logger="loom"):
        open_runs = list(parts_of(engine).driver.runs.open_runs())
    assert open_runs == []
    assert "not compacted" in caplog.text
    assert len(list(engine.executions(status="completed"))) == 40


def test_a_writers_compaction_that_cannot_read_its_partition_is_logged_and_starts_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from loom_kernel import StoreUnavailableError

    class UnreadablePartitions(MemoryStore):
        def _read(self, stream: str, after: int, limit: int | None) -> Any:
            if stream.startswith("runs/open/"):
                raise StoreUnavailableError("partition reads are failing")
            return super()._read(stream, after, limit)

    engine = _engine(UnreadablePartitions())
    keys = [f"w{n}" for n in range(5000) if partition_of(f"w{n}") == partition_of("w0")][:64]
    with caplog.at_level("WARNING", logger="loom"):
        for key in keys:  # the 64th close in one partition has the writer compact it
            assert engine.start("work", "done", key=key).result == "done"
    partition = partition_of("w0")
    assert f"run index {partition} not compacted: " in caplog.text
    assert "partition reads are failing" in caplog.text


@pytest.mark.parametrize(
    ("kind", "data"),
    [
        ("loom.run.other", {"id": "p", "flow": "work", "by": None}),
        ("loom.run.open", {"id": "p", "flow": "work", "by": None, "queue": 7}),
        ("loom.run.open", {"id": "p", "by": None}),
        ("loom.run.closed", {"id": "p", "status": "exploded", "flow": "work"}),
        ("loom.run.closed", {"status": "completed", "flow": "work"}),
    ],
)
def test_each_kind_of_damaged_partition_record_is_a_schema_error_naming_where(
    kind: str, data: dict[str, Any]
) -> None:
    store = MemoryStore()
    engine = _engine(store)
    engine.start("work", "park", key="p")
    stream = "runs/open/" + partition_of("p")
    head = store.head(stream)
    store.append(stream, head, [NewRecord(kind, json.dumps(data).encode(), 0.0)])
    with pytest.raises(SchemaError) as caught:
        list(parts_of(engine).driver.runs.open_runs())
    assert (caught.value.stream, caught.value.position) == (stream, head + 1)


@pytest.mark.parametrize(
    "payload", [b"{not json", b'{"runs": 7}', b'{"runs": [["only-an-id"]]}', b'{"no": 1}']
)
def test_a_damaged_ended_record_is_a_schema_error_naming_where(payload: bytes) -> None:
    store = MemoryStore()
    engine = _engine(store)
    stream = "runs/completed/" + partition_of("d")
    store.append(stream, 0, [NewRecord("loom.run.ended", payload, 0.0)])
    with pytest.raises(SchemaError) as caught:
        list(parts_of(engine).driver.runs.ended(Status.COMPLETED))
    assert (caught.value.stream, caught.value.position) == (stream, 1)


def test_a_checkpoint_replaces_what_the_partition_held_before_it() -> None:
    from loom_kernel._coordination._run_index import _fold_readable

    store, clock = MemoryStore(), FakeClock()
    index = RunIndex(store, clock)
    gone, kept, ended = [f"r{n}" for n in range(400) if partition_of(f"r{n}") == "0"][:3]
    index.opened(gone, "work", None)
    index.opened(kept, "work", None)
    index.opened(ended, "work", None)
    index.closed(ended, Status.COMPLETED, "work")
    stream = "runs/open/0"
    hint = {"id": kept, "flow": "work", "by": None, "at": 0.0}
    checkpoint = NewRecord("loom.run.checkpoint", json.dumps({"open": [hint]}).encode(), 0.0)
    store.append(stream, store.head(stream), [checkpoint])
    opened, closed, damaged = _fold_readable(stream, store.read(stream))
    assert not damaged
    assert list(opened) == [kept], "what was open before it and is not in it is not open"
    assert closed == {}, "what was closed before it was moved out by it"


def test_each_hint_record_is_a_hint_of_its_own_and_a_compaction_keeps_them() -> None:
    """Hints are told apart by the record that wrote them, not by their clock: a nudge
    stamped like the hint before it is news, while a compaction, which rewrites the
    open hints into a checkpoint, leaves them the hints a worker already saw."""
    store, clock = MemoryStore(), FakeClock()  # a clock that never moves
    index = RunIndex(store, clock)
    ids = [f"r{n}" for n in range(20_000) if partition_of(f"r{n}") == "0"][:40]
    assert len(ids) == 40
    index.opened(ids[0], "work", None)
    index.nudged(ids[0], "work")
    _, [first] = index.open_in("0")
    index.nudged(ids[0], "work")
    _, [second] = index.open_in("0")
    assert (first.by, first.at) == (second.by, second.at)
    assert first != second, "a second nudge at the same instant is not news"
    for closing in ids[1:]:
        index.opened(closing, "work", None)
        index.closed(closing, Status.COMPLETED, "work")
    stream = "runs/open/0"
    before = store.head(stream)
    _, hints = index.open_in("0")  # a read with this many closed runs compacts
    assert store.read(stream, store.head(stream) - 1)[0].kind == "loom.run.checkpoint"
    assert store.head(stream) > before
    assert hints == [second]
    _, [after] = index.open_in("0")
    assert after == second, "a compaction made an open run news again"


def test_a_checkpoint_hint_without_a_position_reads_as_position_zero() -> None:
    from loom_kernel._coordination._run_index import _fold_readable

    stream = "runs/open/0"
    store = MemoryStore()
    old = {"id": "r", "flow": "work", "by": None, "at": 5.0}  # as Loom wrote it before
    bad = {**old, "id": "s", "position": -1}
    for hint, damaged in ((old, False), (bad, True)):
        record = NewRecord("loom.run.checkpoint", json.dumps({"open": [hint]}).encode(), 0.0)
        store.append(stream, store.head(stream), [record])
        opened, _closed, was_damaged = _fold_readable(stream, store.read(stream))
        assert was_damaged is damaged
        assert opened["r"].position == 0


def test_a_full_listing_closes_a_finished_run_a_readable_partition_still_holds_open() -> None:
    """A damaged partition has recover list every journal; a run whose close was lost
    in another, readable, partition is closed there too."""
    store = MemoryStore()
    crashing = _engine(store)

    def closing_crashes(_execution: Any) -> None:
        raise KeyboardInterrupt

    parts_of(crashing).driver.close = closing_crashes  # type: ignore[method-assign,assignment]
    with pytest.raises(KeyboardInterrupt):
        crashing.start("work", "done", key="r")
    parked = _engine(store).start("work", "park", key="p")
    assert partition_of("r") != partition_of("p")
    damaged = "runs/open/" + partition_of("p")
    store.append(damaged, store.head(damaged), [NewRecord("loom.run.open", b"{not json", 0.0)])
    fresh = _engine(store)
    assert fresh.recover() == []
    assert [hint.execution_id for hint in parts_of(fresh).driver.runs.open_runs()] == [parked.id]
    assert [e.id for e in fresh.executions(status="completed")] == ["r"]


def test_a_full_listing_only_adds_to_a_readable_partition() -> None:
    store = MemoryStore()
    engine = _engine(store)
    parked = engine.start("work", "park", key="p")
    stream = "runs/open/" + partition_of("p")
    before = store.read(stream)
    hint = next(iter(parts_of(engine).driver.runs.open_runs()))
    parts_of(engine).driver.runs.rebuild([hint], {})
    assert store.read(stream)[: len(before)] == before, "nothing rewritten or trimmed"
    assert [h.execution_id for h in parts_of(engine).driver.runs.open_runs()] == [parked.id]


def test_a_damaged_checkpoint_has_its_partition_rewritten_by_recover() -> None:
    store = MemoryStore()
    engine = _engine(store)
    parked = engine.start("work", "park", key="p")
    stream = "runs/open/" + partition_of("p")
    store.append(stream, store.head(stream), [NewRecord("loom.run.checkpoint", b"{not", 0.0)])
    with pytest.raises(SchemaError):
        list(parts_of(engine).driver.runs.open_runs())
    assert engine.recover() == []
    assert [hint.execution_id for hint in parts_of(engine).driver.runs.open_runs()] == [
        parked.id
    ], "repaired"


def test_a_listing_with_no_filter_reads_the_journals_and_one_by_status_the_index() -> None:
    """`executions()` with no filter lists every journal, one the index does not know
    of included (written by a Loom before the index, or by a start that crashed before
    its hint); with a status it answers from the index, as documented."""
    store = MemoryStore()
    engine = _engine(store)
    engine.start("work", "done", key="a")
    assert parts_of(engine).driver.runs.built()
    store.append("ex/b", 0, [NewRecord(r.kind, r.payload, r.timestamp) for r in store.read("ex/a")])
    assert [e.id for e in engine.executions()] == ["a", "b"]
    assert [e.id for e in engine.executions(status="completed")] == ["a"]


def test_an_ended_partition_deleted_by_hand_lists_no_run_and_fails_nothing() -> None:
    """A partition of the ended runs deleted (an operator's cleanup) reads as empty:
    the listing of ended runs goes on, with none from it."""
    from loom_kernel._coordination._run_index import _ended_stream

    store = MemoryStore()
    clock = FakeClock()
    index = RunIndex(store, clock)
    for partition in index.partitions():
        store.delete(_ended_stream(Status.COMPLETED, partition))
    assert list(index.ended(Status.COMPLETED)) == []


def test_the_first_start_on_an_empty_store_marks_it_indexed() -> None:
    """The first hint on a store with no run yet marks the store built, so every run
    from then on is indexed, and a later engine's recover reads the index instead of
    listing every journal."""
    store = MemoryStore()
    _engine(store).start("other", "x")
    assert store.head("runs/built") == 1
    later = _engine(store)
    assert parts_of(later).driver.runs.built()
    assert later.recover() == []


def test_an_engine_that_only_starts_runs_keeps_the_index_compact() -> None:
    """A writer compacts the partitions it closes runs in as it goes, so a store nobody
    read since (a web tier that only starts runs) leaves the next reader a few
    records a partition to fold, not every hint and close it ever wrote."""
    from loom_kernel.spi import TrimmedError

    store = MemoryStore()
    engine = _engine(store)
    for number in range(3_000):
        engine.start("work", "fail" if number % 7 == 0 else "done")
    retained = 0
    for partition in RunIndex.partitions():
        stream = f"runs/open/{partition}"
        try:
            retained += len(store.read(stream))
        except TrimmedError as exc:
            retained += len(store.read(stream, exc.floor))
    assert retained <= 16 * (2 * 64 + 1), "each partition: a checkpoint and what came since"
    fresh = _engine(store)
    assert fresh.recover() == []
    assert len(fresh.runs(status="failed")) == len(range(0, 3_000, 7))


def test_runs_deleted_by_retention_leave_every_listing_of_the_index() -> None:
    """The sweep rewrites each status stream without the runs it deleted and trims what
    was there before: a listing from the index never shows a deleted run again."""
    from loom_kernel import Retention

    store, clock = MemoryStore(), FakeClock(1_000.0)
    engine = _engine(store, clock)
    for number in range(6):
        engine.start("work", "fail" if number % 3 == 0 else "done", key=f"old-{number}")
    engine.start("work", "park", key="parked")
    clock.advance(600)
    engine.start("work", "done", key="new")
    deleted = engine.gc(Retention(keep_for=300)).deleted
    assert sorted(deleted) == [f"old-{number}" for number in range(6)]
    for reader in (engine, _engine(store, clock)):
        assert sorted(run.id for run in reader.runs()) == ["new", "parked"]
        assert [run.id for run in reader.runs(status="failed")] == []


def test_forgotten_runs_leave_their_status_streams_for_good() -> None:
    """`forget` rewrites a status stream without the runs and trims the batches before
    it: no listing finds them again, and a later run of one of the ids is kept."""
    store, clock = MemoryStore(), FakeClock(1_000.0)
    index = RunIndex(store, clock)
    ids = [f"r{n}" for n in range(400) if partition_of(f"r{n}") == "0"][:4]
    index.index_ended([(run, Status.COMPLETED, "work") for run in ids[:2]])
    index.index_ended([(run, Status.COMPLETED, "work") for run in ids[2:]])
    index.index_ended([(ids[0], Status.COMPLETED, "work")], {ids[0]: (2_000.0, 2, None, None)})
    index.forget("0", {ids[0]: 1, ids[1]: 1})
    listed = sorted((entry.execution_id, entry.generation) for entry in index.ended_entries())
    assert listed == [(ids[0], 2), (ids[2], 1), (ids[3], 1)]
    assert sorted(index.ended(Status.COMPLETED)) == [
        (ids[0], "work"),
        (ids[2], "work"),
        (ids[3], "work"),
    ]
    assert [r.position for r in store.read("runs/completed/0", 3)] == [4], "the rest trimmed"


class NotesUnsynced(MemoryStore):
    """Notes the kind of each record appended unsynced."""

    def __init__(self) -> None:
        super().__init__()
        self.unsynced: list[str] = []

    def _append_unsynced(self, stream: str, expected: int, records: Any) -> int:
        self.unsynced.extend(record.kind for record in records)
        return super()._append_unsynced(stream, expected, records)


def test_only_a_start_hint_and_a_close_go_unsynced() -> None:
    """A start's hint (its start record, synced, follows at once) and a close (recover()
    closes a run again) may wait for the next sync; a nudge, a drop, a batch of ended
    runs filed outside a compaction and the built marker are synced as they are
    written."""
    store, clock = NotesUnsynced(), FakeClock(1_000.0)
    index = RunIndex(store, clock)
    index.opened("a", "work", None, sync=False)
    index.opened("b", "work", None)
    index.nudged("b", "work")
    index.closed("a", Status.COMPLETED, "work")
    index.dropped("b")
    index.index_ended([("c", Status.FAILED, "work")])
    index.mark_built()
    assert store.unsynced == ["loom.run.open", "loom.run.closed"]


def test_a_compaction_files_its_batches_unsynced_before_its_synced_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compaction's batches of ended runs wait for its checkpoint's sync (one sync
    fewer a status, 9 compactions in a first recover() after 100,000 starts): the
    checkpoint is synced and appended after them, so no power loss keeps it, and the
    trim below it, without them."""
    from loom_kernel._coordination import _run_index

    class NotesAppends(MemoryStore):
        def __init__(self) -> None:
            super().__init__()
            self.appends: list[tuple[str, bool]] = []
            self.trimmed: list[str] = []

        def _append(self, stream: str, expected: int, records: Any) -> int:
            self.appends.extend((record.kind, True) for record in records)
            return super()._append(stream, expected, records)

        def _append_unsynced(self, stream: str, expected: int, records: Any) -> int:
            self.appends.extend((record.kind, False) for record in records)
            return super()._append(stream, expected, records)  # not noted twice

        def _trim(self, stream: str, before: int) -> None:
            self.trimmed.append(stream)
            super()._trim(stream, before)

    monkeypatch.setattr(_run_index, "_COMPACT_AT", 2)
    store, clock = NotesAppends(), FakeClock(1_000.0)
    index = RunIndex(store, clock)
    ids = [i for i in (f"run-{n}" for n in range(200)) if partition_of(i) == "0"][:3]
    for execution_id in ids:
        index.opened(execution_id, "work", None)
    index.closed(ids[0], Status.COMPLETED, "work")
    index.closed(ids[1], Status.FAILED, "work")
    store.appends.clear()
    assert [hint.execution_id for hint in index.open_in("0")[1]] == [ids[2]]
    assert store.appends == [
        ("loom.run.ended", False),  # completed
        ("loom.run.ended", False),  # failed
        ("loom.run.checkpoint", True),
    ]
    assert store.trimmed == ["runs/open/0"]
    assert sorted(e.execution_id for e in RunIndex(store, clock).ended_entries()) == sorted(ids[:2])


def test_a_sweep_of_a_store_not_indexed_yet_deletes_nothing_and_is_done() -> None:
    """Journals written before the store had a run index: a sweep cannot tell which
    runs ended (recover() builds the index), so it deletes nothing and says it is done
    (`loom gc` loops while a sweep says there is more)."""
    from loom_kernel import Retention

    store = MemoryStore()
    store.append("ex/old", 0, [NewRecord("k", b"{}", 0.0)])
    swept = _engine(store).gc(Retention(keep_for=0))
    assert (swept.deleted, swept.more) == ((), False)


def test_an_engine_caching_one_run_reads_only_what_follows_its_fold() -> None:
    class CountsRecords(MemoryStore):
        read_back = 0

        def _read(self, stream: str, after: int, limit: int | None) -> Any:
            records = super()._read(stream, after, limit)
            if stream.startswith("ex/"):
                self.read_back += len(records)
            return records

    store = CountsRecords()
    engine = _engine(store, cache_size=1)
    engine.start("work", "done", key="only")
    store.read_back = 0
    assert engine.get("only").status is Status.COMPLETED
    assert store.read_back == 0, "its fold, from the cache: no record read again"
