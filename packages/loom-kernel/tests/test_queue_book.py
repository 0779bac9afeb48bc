"""A queue partition's stream (`_coordination/_queue_book.py`): adds, takes and dones
folded alike by every reader, whatever their clocks; checkpoints, an older Loom's too;
damage reported with the stream and position, and mended by a worker's rewrite; a
partition deleted by hand, or compacted under every read."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
from loom_kernel import (
    MemoryStore,
    Queue,
    Rate,
    SchemaError,
    StoreUnavailableError,
    TrimmedError,
    Worker,
)
from loom_kernel._coordination import QueueBook, QueueFold, pick
from loom_kernel._engine import parts_of
from loom_kernel.spi import NewRecord
from loom_kernel.testing import FakeClock
from queue_helpers import _engine

pytestmark = pytest.mark.usefixtures("fresh_counts")


def test_an_add_from_a_clock_ahead_does_not_empty_the_rate_window() -> None:
    queue = Queue("q", rate=Rate(1, per=60.0))
    store = MemoryStore()
    clock = FakeClock()
    book = QueueBook(store, clock, [queue])
    ahead = QueueBook(store, lambda: clock.now + 120, [queue])
    for run in ("a", "b"):
        book.add(queue.place(run, 0, None), run, "f", "")
    fold = book.read("q", 0)
    first = pick(fold, cap=None, per_key=None, rate=queue.rate, now=clock.now, free=4)
    assert first == ["a"]
    book.take("q", 0, fold, first, "w")
    ahead.add(queue.place("c", 0, None), "c", "f", "")  # stamped two minutes ahead
    clock.advance(1)
    later = book.read("q", 0)
    assert later.admitted, "the admission is still in the window"
    assert pick(later, cap=None, per_key=None, rate=queue.rate, now=clock.now, free=4) == []
    clock.advance(60)
    assert pick(book.read("q", 0), cap=None, per_key=None, rate=queue.rate, now=clock.now, free=4)


def test_a_done_that_meets_another_writer_is_recorded_at_once_not_left_to_the_reaper(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another process adds to the partition between the slot's fold and its done: the
    done is appended at the new head at once, so the slot is free again at once (the
    reaper would give it back only half a lease later); the meeting is logged, for
    debugging."""
    store = MemoryStore()
    queue = Queue("q", concurrency=1)
    engine = _engine(store, queue, lease=600.0)
    other = _engine(store, queue, lease=600.0)  # another process's engine: adds only
    book = parts_of(engine).enqueueing.book
    append_at = book.append_at
    raced: list[Any] = []

    def another_add_first(name: str, partition: int, fold: QueueFold, records: Any) -> int:
        if not raced and any(record.kind == "loom.queue.done" for record in records):
            raced.append(other.enqueue("busy", {"tag": "raced", "s": 0.0}, queue="q"))
        return append_at(name, partition, fold, records)

    book.append_at = another_add_first  # type: ignore[method-assign]
    handles = [engine.enqueue("busy", {"tag": str(i), "s": 0.0}, queue="q") for i in range(2)]
    with caplog.at_level(logging.DEBUG, logger="loom"), Worker(engine):
        assert [handle.result(timeout=10) for handle in handles] == ["0", "1"]
        assert raced[0].result(timeout=10) == "raced"
    assert engine.queue("q").active == []
    assert any(
        record.getMessage().startswith("loom: queue q/0: ")
        for record in caplog.records
        if record.levelno == logging.DEBUG
    ), "the done that met another writer is logged"


def test_a_checkpoint_from_before_wakes_kept_their_place_still_folds() -> None:
    """A checkpoint written by an older Loom notes a wake while driven as `true`: once
    done, that run waits again at its old place."""
    store = MemoryStore()
    waiting = ["r1", "busy", 0, 5, None, ""]
    checkpoint = {"waiting": [], "active": [[waiting, 6, "w", 1.0, True]], "admitted": []}
    store.append(
        "queues/q/0", 0, [NewRecord("loom.queue.checkpoint", json.dumps(checkpoint).encode(), 1.0)]
    )
    book = QueueBook(store, time.time, [Queue("q")])
    assert book.read("q", 0).active["r1"].again is not None
    book.done("q", 0, "r1", 6, requeue=False)
    line = book.read("q", 0).line()
    assert [(item.execution_id, item.seq) for item in line] == [("r1", 5)]


def test_a_queue_partition_deleted_by_hand_reads_as_empty_not_as_its_last_fold() -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q"))
    handle = engine.enqueue("busy", {"tag": "gone"}, queue="q")
    assert engine.queue("q").waiting == [handle.id]  # folded, and kept by the book
    store.delete("queues/q/0")
    assert engine.queue("q").waiting == [], "the deleted partition holds nothing"


class _AlwaysTrimmed(MemoryStore):
    """A store where every read of a queue partition meets a trim (another taker
    compacting it each time), counting the reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def read(self, stream: str, after: int = 0, limit: int | None = None) -> Any:
        if stream.startswith("queues/"):
            self.reads += 1
            raise TrimmedError(stream, after, after + 1)
        return super().read(stream, after, limit)


def test_a_partition_compacted_under_every_read_gives_up_after_eight_reads() -> None:
    store = _AlwaysTrimmed()
    book = QueueBook(store, time.time, [Queue("q")])
    with pytest.raises(StoreUnavailableError, match="kept compacting it"):
        book.refresh("q", 0)
    assert store.reads == 8, "a bounded number of reads, then a clear error"


# -- damage ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "data"),
    [
        ("loom.queue.other", {"id": "x"}),
        ("loom.queue.add", {"id": "x", "flow": "busy", "priority": "1", "key": None}),
        ("loom.queue.add", {"id": "x", "flow": "busy", "priority": 0, "key": 7}),
        ("loom.queue.add", {"id": "x", "flow": 7, "priority": 0, "key": None}),
        ("loom.queue.take", {"ids": ["x"]}),
        ("loom.queue.done", {"take": 1}),
        ("loom.queue.checkpoint", {"waiting": [["x", "busy", 0, 1, None]], "active": []}),
        ("loom.queue.checkpoint", {"waiting": [["x", "busy", 0, 1.5, None, ""]], "active": []}),
        ("loom.queue.checkpoint", {"waiting": [], "active": [[["x"], 1, "w", 0.0]]}),
    ],
)
def test_each_kind_of_damaged_queue_record_is_a_schema_error_naming_where(
    kind: str, data: dict[str, Any]
) -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q"))
    engine.enqueue("busy", {"tag": "a", "s": 0.0}, queue="q")
    head = store.head("queues/q/0")
    store.append("queues/q/0", head, [NewRecord(kind, json.dumps(data).encode(), 0.0)])
    with pytest.raises(SchemaError, match="damaged queue record") as caught:
        _engine(store, Queue("q")).queue("q")
    assert (caught.value.stream, caught.value.position) == ("queues/q/0", head + 1)


def test_a_damaged_queue_record_is_mended_by_a_worker(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q"))
    first = engine.enqueue("busy", {"tag": "a", "s": 0.0}, queue="q")
    head = store.head("queues/q/0")
    store.append("queues/q/0", head, [NewRecord("loom.queue.add", b"{not json", 0.0)])
    second = engine.enqueue("busy", {"tag": "b", "s": 0.0}, queue="q")
    with caplog.at_level("WARNING", logger="loom"), Worker(engine) as worker:
        assert first.result(timeout=10) == "a"
        assert second.result(timeout=10) == "b"
    said = [m for m in caplog.messages if m.startswith("loom: queue q/0: damaged queue record")]
    visits = [m for m in caplog.messages if ": SchemaError: damaged queue record" in m]
    assert worker.stats.failures >= len(said) + len(visits), "each meeting counts as a failure"
    assert any(
        message.startswith("loom: queue q/0: damaged queue record") for message in caplog.messages
    ), "the damage is said, with the partition"
    with pytest.raises(TrimmedError) as trimmed:
        store.read("queues/q/0")
    kinds = [record.kind for record in store.read("queues/q/0", trimmed.value.floor)]
    assert kinds[0] == "loom.queue.checkpoint", "the damage was trimmed off"


class _TrimsRefused(MemoryStore):
    """A store whose trims of one queue partition fail: a rewrite cannot finish."""

    def trim(self, stream: str, before: int) -> None:
        if stream == "queues/q/0":
            raise StoreUnavailableError("trims are refused here")
        super().trim(stream, before)


def test_a_damaged_partition_that_cannot_be_mended_is_said_and_each_meeting_counted_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _TrimsRefused()
    engine = _engine(store, Queue("q"))
    head = store.head("queues/q/0")
    store.append("queues/q/0", head, [NewRecord("loom.queue.add", b"{not json", 0.0)])
    with caplog.at_level("WARNING", logger="loom"), Worker(engine, idle_poll=0.01) as worker:
        deadline = time.monotonic() + 10
        while worker.stats.failures < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert any(m.startswith("loom: queue q/0 not mended: ") for m in caplog.messages)
    said = [m for m in caplog.messages if m.startswith("loom: queue q/0: ")]
    assert worker.stats.failures == len(said), "one failure for each time the damage is met"


class _PartitionAway(MemoryStore):
    """A store whose reads of one queue partition fail (a store fault, not damage)."""

    def _read(self, stream: str, after: int, limit: int | None) -> list[Any]:
        if stream == "queues/q/0":
            raise StoreUnavailableError("this partition is away")
        return super()._read(stream, after, limit)


def test_a_partition_the_store_cannot_read_is_said_and_each_meeting_counted_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _PartitionAway()
    engine = _engine(store, Queue("q"))
    with caplog.at_level("WARNING", logger="loom"), Worker(engine, idle_poll=0.01) as worker:
        deadline = time.monotonic() + 10
        while worker.stats.failures < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    said = [m for m in caplog.messages if m.startswith("loom: queue q/0: this partition")]
    assert said, "the fault is said, with the partition"
    assert worker.stats.failures == len(said), "one failure for each time the fault is met"
