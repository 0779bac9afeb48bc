"""A worker's polls of the run index: a run whose hint was seen before its start landed,
or while a drive of it was ending or its slot reserved, is looked at again at the next
poll, not left to a sweep; each run is counted once as visited; a damaged or missing
index is repaired, at most once a sweep."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from loom_kernel import MemoryStore, RunHandle, SchemaError, StoreUnavailableError, Worker
from loom_kernel._coordination import driving_here
from loom_kernel._engine import parts_of
from worker_helpers import _driven, _engine, _visited

pytestmark = pytest.mark.usefixtures("fresh_effects")


def test_each_run_a_worker_drives_is_counted_once_as_visited_and_driven() -> None:
    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, concurrency=2, idle_poll=60.0) as worker:
        deadline = time.monotonic() + 10
        while len(worker._visits._heads) < 16 and time.monotonic() < deadline:
            time.sleep(0.005)  # its first sweep is over: the next is far
        handles = [engine.enqueue("three", f"h{n}", key=f"h{n}") for n in range(3)]
        for handle in handles:
            handle.result(timeout=10)
        assert _driven(worker, 3) == 3
        assert _visited(worker, 3) == 3, "a run handed to a free slot is one visit"


def test_a_hint_visited_before_its_start_landed_is_looked_at_again_not_left_to_a_sweep() -> None:
    class SlowStart(MemoryStore):
        release = threading.Event()

        def _append(self, stream: str, expected: int, records: Any) -> int:
            if stream == "ex/slow" and expected == 0:
                assert self.release.wait(10)  # another process, between its two writes
            return super()._append(stream, expected, records)

    store = SlowStart()
    writer = _engine(store)
    enqueued: list[RunHandle] = []
    thread = threading.Thread(
        target=lambda: enqueued.append(writer.enqueue("three", "w", key="slow"))
    )
    worker_engine = _engine(store, lease=600.0)
    with Worker(worker_engine, idle_poll=0.05) as worker:  # its next sweep: in 300 s
        thread.start()
        deadline = time.monotonic() + 10
        while worker.stats.visited == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.stats.visited >= 1, "the hint was visited, its start not there"
        store.release.set()
        thread.join(10)
        assert enqueued[0].result(timeout=10) == ["w:0", "w:1", "w:2"]
        assert _driven(worker, 1) == 1


def test_a_look_again_is_not_used_up_by_a_poll_while_its_visit_is_still_in_flight() -> None:
    class SlowStart(MemoryStore):
        release = threading.Event()

        def _append(self, stream: str, expected: int, records: Any) -> int:
            if stream == "ex/late" and expected == 0:
                assert self.release.wait(10)
            return super()._append(stream, expected, records)

    store = SlowStart()
    writer = _engine(store)
    enqueued: list[RunHandle] = []
    thread = threading.Thread(
        target=lambda: enqueued.append(writer.enqueue("three", "l", key="late"))
    )
    worker = Worker(_engine(store, lease=600.0), idle_poll=0.05)
    look_again = worker._visits._look_again

    def preempted(execution_id: str) -> None:
        look_again(execution_id)
        time.sleep(0.3)  # the visiting thread descheduled before its slot is freed

    worker._visits._look_again = preempted  # type: ignore[method-assign]
    with worker:
        thread.start()
        deadline = time.monotonic() + 10
        while worker.stats.visited == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.6)  # polls meanwhile, while the visit was in flight
        store.release.set()
        thread.join(10)
        assert enqueued[0].result(timeout=5) == ["l:0", "l:1", "l:2"]


def test_a_poll_that_sees_a_run_while_its_failed_drive_ends_looks_at_it_again() -> None:
    # The poll reads the run's hint after the handed drive let it go but before its
    # task is over: the run is still in flight there, so that poll cannot visit it.
    # It must be looked at again once the task ends, not only at the next sweep.
    store = MemoryStore()
    engine = _engine(store, lease=600)  # the next sweep is minutes away
    original_hold = parts_of(engine).driver.locks.hold
    original_open_in = parts_of(engine).driver.runs.open_in
    holds: list[str] = []
    read_let_go = threading.Event()

    @contextlib.contextmanager
    def hold(key: str, *, wait: float | None = None) -> Iterator[None]:
        holds.append(key)
        if holds.count("x") == 2:  # the handed drive's
            raise RuntimeError("the drive could not take the run's lock")
        with original_hold(key, wait=wait):
            yield

    def open_in(partition: str) -> Any:
        found = original_open_in(partition)
        if holds.count("x") >= 2 and not driving_here(engine.worker_id, "x"):
            read_let_go.set()
        return found

    class WhileTheTaskEnds(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "working on x failed" in record.getMessage():
                read_let_go.wait(timeout=10)  # a poll reads the hint, the run in flight

    parts_of(engine).driver.locks.hold = hold  # type: ignore[method-assign]
    parts_of(engine).driver.runs.open_in = open_in  # type: ignore[method-assign]
    handler = WhileTheTaskEnds()
    logging.getLogger("loom").addHandler(handler)
    try:
        with Worker(engine, concurrency=1, idle_poll=0.02):
            handle = engine.enqueue("three", "x", key="x")
            assert handle.result(timeout=10) == ["x:0", "x:1", "x:2"], "looked at again"
    finally:
        logging.getLogger("loom").removeHandler(handler)
    assert read_let_go.is_set()


def test_a_run_a_poll_saw_while_it_was_reserved_is_looked_at_once_given_back() -> None:
    store = MemoryStore()
    engine = _engine(store, lease=600.0)  # the next sweep is minutes away
    worker = Worker(engine, concurrency=2, idle_poll=0.02).start()
    try:
        deadline = time.monotonic() + 10
        assert worker._slots.reserve("x", queue=False)  # as enqueue does before the start
        _engine(store).enqueue("three", "x", key="x")  # another engine's start lands
        while "x" not in worker._slots._look_again_after and time.monotonic() < deadline:
            time.sleep(0.01)  # a poll saw it open, reserved here
        worker._slots.unreserve("x")  # the reservation is given back (the key existed)
        assert engine.handle("x").result(timeout=10) == ["x:0", "x:1", "x:2"]
    finally:
        worker.stop()


# -- the index repaired ----------------------------------------------------------------


def test_a_damaged_index_partition_stops_no_other_and_the_worker_repairs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from loom_kernel._coordination import partition_of
    from loom_kernel.spi import NewRecord

    store = MemoryStore()
    engine = _engine(store)
    engine.start("three", "first")
    stream = "runs/open/" + partition_of("x")
    store.append(stream, store.head(stream), [NewRecord("loom.run.open", b"{not json", 0.0)])
    handles = [engine.enqueue("three", f"e{n}") for n in range(6)]
    with caplog.at_level("INFO", logger="loom"), Worker(_engine(store), idle_poll=0.02) as worker:
        for handle in handles:
            handle.wait(timeout=10)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert list(parts_of(_engine(store)).driver.runs.open_runs()) == []
                break
            except SchemaError:
                assert time.monotonic() < deadline, "the worker never repaired the index"
                time.sleep(0.02)
    assert worker.stats.failures <= 2, "repaired at once, not met at every poll"
    assert "loom: indexing runs from the journals (recover)" in caplog.messages, "said"


def test_a_worker_on_a_store_from_before_the_index_indexes_it_and_takes_its_runs() -> None:
    from loom_kernel.spi import NewRecord

    written = MemoryStore()
    _engine(written).enqueue("three", "old", key="old")  # left running with no owner
    store = MemoryStore()
    for stream in written.streams("ex/"):
        copies = [NewRecord(r.kind, r.payload, r.timestamp) for r in written.read(stream)]
        store.append(stream, 0, copies)
    engine = _engine(store)
    assert not parts_of(engine).driver.runs.built()
    with Worker(engine, idle_poll=0.02):
        assert engine.handle("old").result(timeout=10) == ["old:0", "old:1", "old:2"]
    assert parts_of(engine).driver.runs.built()


def test_a_worker_whose_index_repair_fails_looks_at_the_index_once_a_sweep_not_a_poll(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whether the store is indexed costs store reads (two requests on S3) while it is
    not: a worker whose repair keeps failing asks again at its sweeps only."""
    from loom_kernel.spi import NewRecord

    written = MemoryStore()
    _engine(written).enqueue("three", "old", key="old")
    store = MemoryStore()
    for stream in written.streams("ex/"):
        copies = [NewRecord(r.kind, r.payload, r.timestamp) for r in written.read(stream)]
        store.append(stream, 0, copies)
    engine = _engine(store, lease=60.0)  # a sweep every 30 s: one in this test
    looks = []
    built = parts_of(engine).driver.runs.built

    def counted() -> bool:
        looks.append(1)
        return built()

    def failing() -> list[str]:
        raise StoreUnavailableError("down")

    monkeypatch.setattr(parts_of(engine).driver.runs, "built", counted)
    monkeypatch.setattr(parts_of(engine).recovery, "recover", failing)
    with Worker(engine, idle_poll=0.01) as worker:
        deadline = time.monotonic() + 10
        while worker.stats.failures < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # many polls
    assert worker.stats.failures == 1, "repaired at most once a sweep"
    assert len(looks) == 1, f"looked {len(looks)} times"
    assert "loom: recover: StoreUnavailableError: down" in caplog.messages, "said"


def test_a_run_index_marker_that_cannot_be_read_is_not_taken_for_a_store_to_index(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from loom_kernel import StoreUnavailableError

    class MarkerUnreadable(MemoryStore):
        def _head(self, stream: str) -> int:
            if stream == "runs/built":
                raise StoreUnavailableError("the marker cannot be read (injected)")
            return super()._head(stream)

    engine = _engine(MarkerUnreadable())
    recovered: list[int] = []

    def counting_recover() -> list[str]:
        recovered.append(1)
        return []

    parts_of(engine).recovery.recover = counting_recover  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="loom"), Worker(engine, idle_poll=0.02):
        time.sleep(0.2)
    assert recovered == [], "looked at again at the next sweep, not recovered at once"
    assert "the run index marker: StoreUnavailableError: the marker cannot be read" in (
        caplog.text
    ), "and said"
