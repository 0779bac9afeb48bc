"""A worker's visits to the open runs of the run index, made by hand (no worker, no
poll loop): a run whose start had not landed when its hint was read is looked at
again by the next polls."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from loom_kernel import Context, Engine, MemoryStore, flow
from loom_kernel._engine import parts_of
from loom_kernel._hosting._slots import Slots, WorkerStats
from loom_kernel._hosting._visits import OpenRunVisits


@flow(name="three", version="1")
def three(ctx: Context, tag: str) -> Any:
    return [ctx.step(f"s{i}", lambda i=i: f"{tag}:{i}") for i in range(3)]


def _engine(store: MemoryStore) -> Engine:
    return Engine(store, [three], listeners=[])


def _visits(engine: Engine, concurrency: int = 8) -> tuple[OpenRunVisits, Slots]:
    """The visits of a worker of `engine` (a Worker's default concurrency), and the
    slots they hand their runs to (not open)."""
    parts, stats = parts_of(engine), WorkerStats()
    slots = Slots(parts, concurrency, stats, threading.Event(), threading.Event())
    return OpenRunVisits(parts, slots, stats), slots


def test_a_run_whose_hint_a_poll_saw_while_its_enqueue_was_writing_is_visited_next_poll() -> None:
    class PollDuringTheStart(MemoryStore):
        during: Any = None

        def _append(self, stream: str, expected: int, records: Any) -> int:
            if stream == "ex/k" and expected == 0 and self.during is not None:
                self.during()  # the hint is there, the start not yet
            return super()._append(stream, expected, records)

    store = PollDuringTheStart()
    engine = _engine(store)
    visits, slots = _visits(engine)
    with ThreadPoolExecutor(2) as pool:
        slots.open(pool, None)
        handed: list[int] = []
        store.during = lambda: handed.append(visits.visit_open(sweep=False))
        handle = engine.enqueue("three", "k", key="k")
        store.during = None
        assert handed == [0], "the enqueue is still writing it: left alone"
        assert visits.visit_open(sweep=False) == 1, "not taken for seen"
        assert handle.result(timeout=10) == ["k:0", "k:1", "k:2"]


def test_a_run_not_started_yet_is_looked_at_again_by_a_few_polls_then_left_to_sweeps() -> None:
    """A hint read before its run's start landed has the next few polls look again;
    past `_NOT_STARTED_LOOKS` looks (its writer may be gone), only the sweeps do."""
    from loom_kernel._hosting._visits import _NOT_STARTED_LOOKS

    visits, slots = _visits(_engine(MemoryStore()))
    for _ in range(_NOT_STARTED_LOOKS):
        visits._look_again("r")
        assert "r" in slots._look_again_after
        slots._look_again_after.discard("r")
    visits._look_again("r")
    assert "r" not in slots._look_again_after
    assert "r" not in visits._not_started


def test_a_partition_the_store_cannot_read_is_counted_and_the_others_are_visited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from loom_kernel._coordination import partition_of
    from loom_kernel.spi import StoreUnavailableError

    first = "runs/open/0"

    class FailsOnePartition(MemoryStore):
        failing = False

        def _read(self, stream: str, after: int, limit: int | None) -> Any:
            if self.failing and stream == first:
                raise StoreUnavailableError("the store is away for this one")
            return super()._read(stream, after, limit)

    store = FailsOnePartition()
    engine = _engine(store)
    keys = [k for k in (f"k{n}" for n in range(100)) if partition_of(k) != "0"][:2]
    blocked = next(k for k in (f"b{n}" for n in range(100)) if partition_of(k) == "0")
    handles = [engine.enqueue("three", key, key=key) for key in [blocked, *keys]]
    visits, slots = _visits(engine)
    stats = slots.stats  # the WorkerStats the visits count into
    with ThreadPoolExecutor(2) as pool:
        slots.open(pool, None)
        store.failing = True
        assert visits.visit_open(sweep=True) == 2, "the others, past the one it cannot read"
        assert stats.failures == 1
        assert "run index partition 0: the store is away for this one" in caplog.text
        assert [h.result(timeout=10) for h in handles[1:]] == [
            [f"{k}:{i}" for i in range(3)] for k in keys
        ]


def test_a_damaged_partition_is_counted_said_and_marks_the_index_for_repair(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from loom_kernel.spi import NewRecord

    store = MemoryStore()
    engine = _engine(store)
    store.append("runs/open/0", store.head("runs/open/0"), [NewRecord("loom.run.open", b"{", 1.0)])
    visits, slots = _visits(engine)
    with ThreadPoolExecutor(2) as pool:
        slots.open(pool, None)
        visits.visit_open(sweep=True)
    assert slots.stats.failures == 1
    assert visits.repair, "the next poll rebuilds the index"
    assert "run index partition 0: " in caplog.text


def test_a_queued_runs_hint_seen_between_sweeps_is_no_news_to_the_next_sweep() -> None:
    """A run waiting in a queue is found by its queue's add, so the polls between
    sweeps leave its hint alone but note it seen; the next sweep then visits it as a
    run it knew (no second look asked for after the visit)."""
    from loom_kernel import Queue

    store = MemoryStore()
    engine = Engine(store, [three], listeners=[], queues=[Queue("q")])
    engine.enqueue("three", "q", key="waits", queue="q")
    visits, slots = _visits(engine)
    asked: list[tuple[str, bool]] = []

    def submit(task: Any, *, queue: bool = False, look_again: bool = False) -> bool:
        asked.append((task.execution_id, look_again))
        return True

    slots.submit = submit  # type: ignore[method-assign]
    assert visits.visit_open(sweep=False) == 0, "left to its queue"
    assert visits.visit_open(sweep=True) == 1
    assert asked == [("waits", False)]
