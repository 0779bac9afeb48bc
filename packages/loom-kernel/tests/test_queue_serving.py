"""A worker's admissions from its queues (`_hosting/_queue_serving.py`): a slot that
frees admits the next run, and a worker holds no more admissions than its slots; one
busy queue or partition starves no other; an admission whose taker stopped, died, or
no longer drives the run (or that cannot be read) is given back; a stopping worker gives
its runs back and admits nothing more."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from loom_kernel import (
    Context,
    Engine,
    MemoryStore,
    Queue,
    SchemaError,
    Status,
    StoreUnavailableError,
    Worker,
    flow,
)
from loom_kernel._coordination import QueueBook
from loom_kernel._engine import parts_of
from loom_kernel.spi import NewRecord
from loom_kernel.testing import FakeClock
from queue_helpers import _engine, _order, _serving, _wait, parks

pytestmark = pytest.mark.usefixtures("fresh_counts")


def test_a_queue_pass_counts_the_runs_it_hands_to_slots_and_none_when_idle() -> None:
    engine = _engine(MemoryStore(), Queue("q", concurrency=2))
    serving, slots = _serving(engine, concurrency=2)  # one pass at a time, by hand
    with ThreadPoolExecutor(max_workers=2) as pool:
        slots.open(pool, None)
        assert serving.serve(sweep=False) == 0, "idle: the poll may back off"
        handle = engine.enqueue("busy", {"tag": "only", "s": 0.0}, queue="q")
        assert serving.serve(sweep=False) == 1
        assert handle.result(timeout=30) == "only"


def test_a_freed_slot_admits_the_next_queued_run_without_waiting_for_a_poll() -> None:
    engine = _engine(MemoryStore(), Queue("q", concurrency=1))
    handles = [engine.enqueue("busy", {"tag": tag, "s": 0.05}, queue="q") for tag in "ab"]
    worker = Worker(engine, concurrency=1, idle_poll=0.05)
    serve = worker._serving.serve
    handed: list[int] = []

    def polls_admit_once(*, sweep: bool) -> int:
        if sum(handed):
            return 0  # after the first admission only a freed slot can admit
        handed.append(serve(sweep=sweep))
        return handed[-1]

    worker._serving.serve = polls_admit_once  # type: ignore[method-assign]
    with worker:
        assert [handle.result(timeout=20) for handle in handles] == ["a", "b"]
    assert sum(handed) == 1


def test_a_worker_holds_no_more_admissions_than_its_slots() -> None:
    """A slot that ends a run admits one more for itself, not more: runs it could not
    drive yet would hold the queue's places from the other workers."""
    seen: list[int] = []
    engines: list[Engine] = []

    @flow(name="counts", version="1")
    def counts(ctx: Context, _input: Any) -> Any:
        return ctx.step("look", lambda: seen.append(len(engines[0].queue("q").active)))

    engines.append(Engine(MemoryStore(), [counts], listeners=[], queues=[Queue("q")]))
    handles = [engines[0].enqueue("counts", None, queue="q") for _ in range(6)]
    with Worker(engines[0], concurrency=1):
        for handle in handles:
            handle.result(timeout=10)
    assert seen == [1] * 6


def test_a_queued_run_a_worker_drives_counts_once_as_visited_and_driven() -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q", concurrency=2))
    with Worker(engine, idle_poll=60.0) as worker:
        _wait(lambda: len(worker._visits._heads) == 16)  # its first sweep is over: the next is far
        handles = [engine.enqueue("busy", {"tag": f"t{n}", "s": 0.0}, queue="q") for n in range(3)]
        assert [handle.result(timeout=10) for handle in handles] == ["t0", "t1", "t2"]
        _wait(lambda: worker.stats.driven == 3 and worker.stats.visited >= 3)
        assert worker.stats.visited == 3, "one visit each"


class _CountedEvent(threading.Event):
    """An event that counts its sets."""

    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


def test_the_wake_of_a_parked_queued_run_wakes_the_engines_own_workers() -> None:
    """A resume that puts a parked queued run back on its queue wakes this engine's
    workers, so they admit it at once rather than at their next poll (up to
    `idle_poll` later)."""
    store = MemoryStore()
    engine = _engine(store, Queue("q"))
    worker = Worker(engine, idle_poll=60.0)
    wake = worker._wake = worker._slots._wake = _CountedEvent()
    with worker:
        parked = engine.enqueue("parks", "p", queue="q")
        _wait(lambda: parked.get().status is Status.SUSPENDED)
        time.sleep(0.1)  # the slot's end has woken it already
        before = wake.sets
        engine.resume(parked.id, "yes", on="go")
        assert wake.sets > before, "woken by the resume itself"
        assert parked.result(timeout=10) == "p:after:yes"


def test_a_busy_partition_does_not_starve_another() -> None:
    store = MemoryStore()
    queue = Queue("q", concurrency=8, partitions=2)

    def key_in(partition: int) -> str:
        return next(
            f"k{i}" for i in range(1000) if queue.place("x", 0, f"k{i}").partition == partition
        )

    engine = _engine(store, queue)
    urgent = engine.enqueue(
        "busy", {"tag": "urgent", "s": 0.02}, queue="q", queue_key=key_in(1), priority=-100
    )
    rest = [
        engine.enqueue("busy", {"tag": f"p0-{i}", "s": 0.02}, queue="q", queue_key=key_in(0))
        for i in range(30)
    ]
    with Worker(engine, concurrency=4):
        urgent.result(timeout=30)
        for handle in rest:
            handle.result(timeout=30)
    assert _order.index("urgent") < 8, f"served in turn: {_order.index('urgent')}"


def test_a_busy_queue_leaves_a_workers_other_queue_and_its_timers_their_turn() -> None:
    """A slot that ends a run takes the next from the worker's queues in turn, and a
    due timer waits for the next free slot: neither waits for a busy queue to drain."""
    store = MemoryStore()
    engine = _engine(store, Queue("a"), Queue("b"))
    flood = [engine.enqueue("busy", {"tag": f"a{i}", "s": 0.002}, queue="a") for i in range(300)]
    with Worker(engine, concurrency=2, idle_poll=0.05):
        _wait(lambda: len(_order) >= 4)
        other = engine.enqueue("busy", {"tag": "b", "s": 0.0}, queue="b")
        sleeper = engine.enqueue("naps", 0.05)
        other.result(timeout=30)
        sleeper.result(timeout=30)
        served = len(_order)
        for handle in flood:
            handle.result(timeout=30)
    assert _order.index("b") < 20, f"b waited for {_order.index('b')} runs of a"
    assert served < 250, f"the timer's run waited for {served} runs of a"


def test_a_slot_that_cannot_admit_its_next_run_says_so_and_leaves_it_to_the_polls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q"))
    with Worker(engine, concurrency=1, idle_poll=0.02) as worker:

        def damaged(after: Queue) -> list[Any]:
            raise SchemaError("a damaged queue partition")

        worker._serving._admit_next = damaged  # type: ignore[method-assign]
        with caplog.at_level(logging.DEBUG, logger="loom"):
            first = engine.enqueue("busy", {"tag": "a"}, key="a", queue="q")
            assert first.result(timeout=10) == "a"
            second = engine.enqueue("busy", {"tag": "b"}, key="b", queue="q")
            assert second.result(timeout=10) == "b", "admitted by a poll"
    assert "admitting after a: a damaged queue partition" in caplog.text


def test_a_passing_fault_on_the_claim_keeps_the_run_on_its_queue() -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q"))
    real = parts_of(engine).driver.take_over
    faults = [StoreUnavailableError("the store blinked")]

    def flaky(state: Any) -> bool:
        if faults:
            raise faults.pop()
        return real(state)

    parts_of(engine).driver.take_over = flaky  # type: ignore[method-assign]
    handle = engine.enqueue("busy", {"tag": "x", "s": 0.0}, queue="q")
    with Worker(engine):
        assert handle.result(timeout=5) == "x", "waited again at once, not a sweep later"
    assert faults == []


def test_a_poll_whose_every_take_meets_another_writer_admits_nothing_and_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every attempt to take a run meets another process's write: the poll admits
    nothing this time (the next one tries again) and does not fail."""
    from loom_kernel import ConflictError

    engine = _engine(MemoryStore(), Queue("q"))
    engine.enqueue("parks", "p", queue="q")
    serving, slots = _serving(engine)
    tries: list[int] = []

    def always_beaten(*_args: Any) -> int:
        tries.append(1)
        raise ConflictError("queues/q/0", 1, 2)

    monkeypatch.setattr(parts_of(engine).enqueueing.book, "take", always_beaten)
    queue = parts_of(engine).enqueueing.book.queues["q"]
    with ThreadPoolExecutor(1) as pool:
        slots.open(pool, None)
        assert serving._serve_partition(queue, 0, sweep=False) == 0
    assert len(tries) > 1, "folded again and retried before giving up"
    assert engine.queue("q").active == []


def test_a_run_admitted_as_a_visit_of_it_takes_its_slot_goes_back_to_its_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race a poll can lose: the run is picked as not busy here, and a visit of it
    is in flight by the time its drive is submitted. The admission is given back, the
    run waiting on its queue again for the next poll."""
    store = MemoryStore()
    engine = _engine(store, Queue("q", concurrency=2))
    handle = engine.enqueue("parks", "p", queue="q")
    serving, slots = _serving(engine, concurrency=2)
    monkeypatch.setattr(slots, "busy_with", lambda _id: False)  # as it looked at the pick
    slots._in_flight.add(handle.id)  # a visit of it began since
    queue = parts_of(engine).enqueueing.book.queue("q")
    with ThreadPoolExecutor(1) as pool:
        slots.open(pool, None)
        admitted = [
            serving._serve_partition(queue, partition, sweep=False)
            for partition in range(queue.partitions)
        ]
    assert sum(admitted) == 1
    view = engine.queue("q")
    assert (view.waiting, view.active) == ([handle.id], [])


# -- admissions given back -------------------------------------------------------------


def test_an_admission_never_driven_is_given_back_after_half_a_lease() -> None:
    store = MemoryStore()
    queue = Queue("q", concurrency=1)
    engine = _engine(store, queue, lease=0.4)
    handle = engine.enqueue("busy", {"tag": "x", "s": 0.0}, queue="q")
    book = QueueBook(store, time.time, [queue])
    fold = book.read("q", 0)
    book.take("q", 0, fold, [handle.id], "gone-worker")  # a taker that died at once
    assert engine.queue("q").active == [handle.id]
    with Worker(engine):
        assert handle.result(timeout=10) == "x"
    assert engine.queue("q").active == []


class _Crash(BaseException):
    """Stands in for a process dying mid-run: the run stays running, owned."""


def test_an_admission_is_stale_once_its_taker_no_longer_drives_the_run() -> None:
    import subprocess

    from loom_kernel._coordination._leases import _THIS_MACHINE

    @flow(name="stale.crash")
    def crash(ctx: Context, _input: Any) -> Any:
        ctx.step("one", lambda: 1)
        raise _Crash

    @flow(name="stale.done")
    def done(ctx: Context, _input: Any) -> Any:
        return "done"

    store, clock = MemoryStore(), FakeClock()

    def engine(worker_id: str) -> Engine:
        return Engine(store, [crash, done], clock=clock, listeners=[], worker_id=worker_id)

    me = engine("me")
    assert parts_of(me).enqueueing.queued_stale("nobody", "me") is False, (
        "gone: nothing to give back"
    )
    me.start("stale.done", key="d")
    assert parts_of(me).enqueueing.queued_stale("d", "me") is False, (
        "finished: nothing to give back"
    )
    with pytest.raises(_Crash):
        me.start("stale.crash", key="c")
    assert parts_of(me).enqueueing.queued_stale("c", "taker") is True, "the taker never claimed it"
    assert parts_of(me).enqueueing.queued_stale("c", "me") is True, (
        "ours, and no drive of ours holds it"
    )
    with parts_of(me).driver.heartbeat.holding("c"):
        assert parts_of(me).enqueueing.queued_stale("c", "me") is None, "a drive of ours holds it"

    with pytest.raises(_Crash):
        engine("elsewhere").start("stale.crash", key="o")
    assert parts_of(me).enqueueing.queued_stale("o", "elsewhere") is None, (
        "its taker was seen within a lease"
    )
    clock.advance(me.lease + 1)
    assert parts_of(me).enqueueing.queued_stale("o", "elsewhere") is True, (
        "its taker's lease ran out"
    )

    gone = subprocess.Popen(["true"])
    gone.wait()  # a process of this machine that has exited
    dead = f"{_THIS_MACHINE}:{gone.pid}:abc123"
    with pytest.raises(_Crash):
        engine(dead).start("stale.crash", key="x")
    assert parts_of(me).enqueueing.queued_stale("x", dead) is True, (
        "its taker's process is gone, lease or not"
    )


def test_a_dead_takers_admission_is_given_back_however_far_behind_the_reapers_clock_is() -> None:
    """A taker known to have exited (a process of this machine) holds its admission
    no longer than a sweep, even when the reaper's clock is far behind the taker's."""
    import subprocess
    import sys

    from loom_kernel._coordination import default_worker_id

    store = MemoryStore()
    queue = Queue("q", concurrency=1)
    clock = FakeClock(time.time() - 600)  # ten minutes behind the taker's
    engine = _engine(store, queue, lease=0.4, clock=clock)
    run = engine.enqueue("busy", {"tag": "r", "s": 0.0}, queue="q")
    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    machine, _, _rest = default_worker_id().partition(":")
    dead = f"{machine}:{exited.stdout.strip()}:dead00"
    book = QueueBook(store, time.time, [queue])
    book.take("q", 0, book.read("q", 0), [run.id], dead)
    with Worker(engine, idle_poll=0.05):
        assert run.result(timeout=10) == "r"


def test_an_unreadable_admitted_run_does_not_keep_a_dead_takers_places() -> None:
    store = MemoryStore()
    queue = Queue("q", concurrency=2)
    engine = _engine(store, queue, lease=0.4)
    bad = engine.enqueue("busy", {"tag": "bad", "s": 0.0}, queue="q")
    good = engine.enqueue("busy", {"tag": "good", "s": 0.0}, queue="q")
    book = QueueBook(store, time.time, [queue])
    book.take("q", 0, book.read("q", 0), [bad.id, good.id], "dead-worker")
    stream = engine.stream_of(bad.id)
    store.append(stream, store.head(stream), [NewRecord("STEP_COMPLETED", b"{damaged", 1.0)])
    third = engine.enqueue("busy", {"tag": "third", "s": 0.0}, queue="q")
    with Worker(engine):
        assert third.result(timeout=10) == "third"
        assert good.result(timeout=10) == "good"
    assert engine.queue("q").active == []


def test_an_admitted_run_that_cannot_be_read_holds_no_place_and_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    queue = Queue("q", concurrency=1)
    engine = _engine(store, queue, lease=0.4)
    run = engine.enqueue("busy", {"tag": "r", "s": 0.0}, queue="q")
    book = QueueBook(store, lambda: time.time() - 60, [queue])  # taken a minute ago
    book.take("q", 0, book.read("q", 0), [run.id], "elsewhere")

    def unreadable(execution_id: str, _by: str | None) -> bool | None:
        raise SchemaError(f"the journal of {execution_id} is damaged")

    parts_of(engine).enqueueing.queued_stale = unreadable  # type: ignore[method-assign,assignment]
    serving, _slots = _serving(engine)
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert serving._reap(queue, 0, parts_of(engine).enqueueing.book.read("q", 0)) is True
    assert f"{run.id}: admitted, and cannot be read" in caplog.text
    fold = parts_of(engine).enqueueing.book.read("q", 0)
    assert run.id not in fold.active, "its place given back"
    assert run.id not in {item.execution_id for item in fold.line()}, "and not queued again"


def test_a_sweep_leaves_an_admission_this_worker_holds_for_its_next_free_slot() -> None:
    """A run this worker admitted and holds for a slot (not claimed yet, so by the
    journal no one drives it) keeps its admission through a sweep, however old: given
    back, it would wait on the queue again while the slot drives it, and be admitted
    twice. Once it no longer waits here, the same sweep gives it back."""
    store = MemoryStore()
    clock = FakeClock()
    engine = _engine(store, Queue("q"), clock=clock)
    handle = engine.enqueue("parks", "p", queue="q")
    serving, slots = _serving(engine)
    book = parts_of(engine).enqueueing.book
    book.take("q", 0, book.read("q", 0), [handle.id], engine.worker_id)
    slots._queued.add(handle.id)  # admitted for the slot a run in flight holds
    clock.advance(engine.lease)
    queue = parts_of(engine).enqueueing.book.queues["q"]
    assert serving._reap(queue, 0, book.read("q", 0)) is False
    assert (engine.queue("q").waiting, engine.queue("q").active) == ([], [handle.id])
    slots._queued.discard(handle.id)
    assert serving._reap(queue, 0, book.read("q", 0)) is True
    assert (engine.queue("q").waiting, engine.queue("q").active) == ([handle.id], [])


def test_a_restart_gives_back_what_the_earlier_process_admitted_never_its_own() -> None:
    """Once the process that last beat under this worker's id has exited, its fresh
    admissions are given back at once; those this process made itself are kept."""
    store = MemoryStore()
    clock = FakeClock()
    engine = _engine(store, Queue("q", concurrency=4), clock=clock)
    earlier = engine.enqueue("parks", "earlier", queue="q")
    book = parts_of(engine).enqueueing.book
    book.take("q", 0, book.read("q", 0), [earlier.id], engine.worker_id)  # not by this one
    own = engine.enqueue("parks", "own", queue="q")
    serving, _slots = _serving(engine, concurrency=2)
    queue = book.queues["q"]
    tasks = serving._admit(queue, 0, 1)
    assert [task.execution_id for task in tasks] == [own.id]
    assert serving._reap(queue, 0, book.read("q", 0), earlier_exited=True) is True
    assert (engine.queue("q").waiting, engine.queue("q").active) == ([earlier.id], [own.id])


# -- takers that stop ------------------------------------------------------------------


def test_a_stopping_worker_gives_its_runs_back_to_the_queue() -> None:
    store = MemoryStore()
    queue = Queue("q", concurrency=1)
    release = threading.Event()

    @flow(name="held", version="1")
    def held(ctx: Context, _input: Any) -> Any:
        ctx.step("one", lambda: release.wait(10) and "one")
        return ctx.step("two", lambda: "two")

    first = Engine(store, [held], listeners=[], queues=[queue])
    handle = first.enqueue("held", None, queue="q")
    worker = Worker(first, grace=0.0).start()
    _wait(lambda: first.queue("q").active == [handle.id])
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    time.sleep(0.05)
    release.set()
    stopper.join()
    assert handle.get().status is Status.RUNNING, "released before its next step"
    assert first.queue("q").waiting == [handle.id], "back on the queue, at its place"
    second = Engine(store, [held], listeners=[], queues=[queue])
    with Worker(second):
        assert handle.result(timeout=10) == "two"


def test_a_run_a_stopping_worker_lets_go_is_claimed_by_the_next_taker_at_once() -> None:
    """The stopping worker still drives another run (its last beat comes later), so
    only its beat at the let-go tells the next taker the run is free."""
    store = MemoryStore()
    queue = Queue("q")
    step_one, long_done = threading.Event(), threading.Event()

    @flow(name="two", version="1")
    def two(ctx: Context, _input: Any) -> Any:
        ctx.step("one", lambda: step_one.wait(10) and "one")
        return ctx.step("two", lambda: "two")

    @flow(name="long", version="1")
    def long(ctx: Context, _input: Any) -> Any:
        return ctx.step("s", lambda: long_done.wait(20) and "long")

    first = Engine(store, [two, long], listeners=[], queues=[queue], lease=30.0)
    second = Engine(store, [two, long], listeners=[], queues=[queue], lease=30.0)
    released, busy = first.enqueue("two", None, queue="q"), first.enqueue("long", None, queue="q")
    worker = Worker(first, grace=0.0).start()
    _wait(lambda: sorted(first.queue("q").active) == sorted([released.id, busy.id]))
    with Worker(second):
        stopper = threading.Thread(target=worker.stop)
        stopper.start()
        time.sleep(0.1)
        step_one.set()
        try:
            assert released.result(timeout=10) == "two", "taken over while the other ran on"
        finally:
            long_done.set()
            stopper.join()
        busy.result(timeout=10)


def test_a_slot_that_frees_as_the_worker_stops_admits_nothing_more_from_its_queue() -> None:
    """A queued run that ends during a stop's grace does not admit the next run for
    its slot: a stopping worker takes no work; the run waits for another worker."""
    store = MemoryStore()
    queue = Queue("q", concurrency=1)
    release = threading.Event()

    @flow(name="held", version="1")
    def held(ctx: Context, tag: str) -> Any:
        return ctx.step("one", lambda: release.wait(10) and tag)

    first = Engine(store, [held], listeners=[], queues=[queue])
    handles = [first.enqueue("held", tag, queue="q") for tag in "ab"]
    worker = Worker(first, concurrency=1, grace=10.0, idle_poll=0.02).start()
    _wait(lambda: first.queue("q").active == [handles[0].id])
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    _wait(worker._stopping.is_set)
    release.set()
    stopper.join(20)
    assert not stopper.is_alive()
    assert handles[0].result(timeout=1) == "a", "ended within the grace"
    assert handles[1].get().status is Status.RUNNING
    assert first.queue("q").waiting == [handles[1].id], "not admitted by the stopping worker"
    takes = [r for r in store.read("queues/q/0") if r.kind == "loom.queue.take"]
    assert len(takes) == 1, "one take, of the first run: none after the stop began"
    second = Engine(store, [held], listeners=[], queues=[queue])
    with Worker(second, idle_poll=0.02):
        assert handles[1].result(timeout=10) == "b"


def _held_by_another_process(store: MemoryStore, clock: FakeClock, pid: int) -> tuple[Any, str]:
    """A queue place and a run held under worker id pod-1 by the process `pid` of this
    machine (its beats say so), as that process left them."""
    import json

    from loom_kernel._coordination import default_worker_id

    queue = Queue("q", concurrency=1)
    killed = _engine(store, queue, worker_id="pod-1", clock=clock)
    handle = killed.enqueue("busy", {"tag": "held", "s": 0.0}, queue="q")
    book = parts_of(killed).enqueueing.book
    with book.holding("q", 0):
        book.take("q", 0, book.refresh("q", 0), [handle.id], "pod-1")
    state = parts_of(killed).driver.checkout(handle.id)
    assert parts_of(killed).driver.take_over(state), "claimed: then the process was killed"
    assert (killed.queue("q").active, killed.get(handle.id).owner) == ([handle.id], "pod-1")
    proc = f"{default_worker_id().split(':')[0]}:{pid}:cafe"
    beat = json.dumps({"runs": [handle.id], "proc": proc}).encode()
    store.append(
        "workers/pod-1", store.head("workers/pod-1"), [NewRecord("loom.beat", beat, clock())]
    )
    return queue, handle.id


def test_a_worker_restarted_under_its_id_takes_back_at_once_what_its_last_process_held() -> None:
    """A worker restarted with the same `--worker-id` (a pod) finds the queue place
    and the run its killed process held under that id: its beats name a process of
    this machine that has exited, so it takes both back at once, not once half a lease
    has passed by the clocks (the clock here never moves)."""
    import subprocess
    import sys

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    store, clock = MemoryStore(), FakeClock()
    queue, execution_id = _held_by_another_process(store, clock, int(gone.stdout))
    restarted = _engine(store, queue, worker_id="pod-1", clock=clock)
    with Worker(restarted, idle_poll=0.02):
        assert restarted.handle(execution_id).result(timeout=10) == "held"
    assert restarted.queue("q").active == []


def test_a_place_held_under_this_id_by_a_process_that_may_be_alive_waits_half_a_lease(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two live processes under one worker id (a misconfiguration): the second took
    the first's place at once and the step ran twice. Without word that the other
    process exited, its place is given back only after half a lease, and it says so."""
    import os

    store, clock = MemoryStore(), FakeClock()
    queue, execution_id = _held_by_another_process(store, clock, os.getppid())  # alive
    second = _engine(store, queue, worker_id="pod-1", clock=clock)
    with Worker(second, idle_poll=0.02):
        time.sleep(0.5)
        assert second.queue("q").active == [execution_id], "still the other process's"
        assert second.get(execution_id).status is Status.RUNNING
        assert "may be alive" in caplog.text
    clock.advance(second.lease)  # past half a lease, by the clocks: given back
    serving, slots = _serving(second)
    with ThreadPoolExecutor(max_workers=1) as pool:
        slots.open(pool, None)
        serving.serve(sweep=True)
        slots.close()
    assert second.queue("q").active == []
    assert second.handle(execution_id).result(timeout=10) == "held", "admitted again, driven"


def test_a_worker_keeps_the_places_it_holds_itself_under_its_own_id() -> None:
    """The same rule never takes from a worker what this very process admitted: a run
    it admitted, not yet in a slot, keeps its place through a sweep."""
    store, clock = MemoryStore(), FakeClock()
    engine = _engine(store, Queue("q"), worker_id="pod-1", clock=clock)
    serving, _slots = _serving(engine)
    handle = engine.enqueue("parks", "p", queue="q")
    book = parts_of(engine).enqueueing.book
    queue = book.queues["q"]
    admitted = serving._admit(queue, 0, 1)  # taken by this process; no slot drives it yet
    assert [task.execution_id for task in admitted] == [handle.id]
    assert serving._reap(queue, 0, book.read("q", 0)) is False, "its own place is kept"
    assert engine.queue("q").active == [handle.id]
    assert admitted[0].let_go is not None
    admitted[0].let_go()
    assert engine.queue("q").waiting == [handle.id], "given back when let go"


def test_another_workers_admission_is_not_taken_for_one_held_under_this_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A partition holding only another worker's admission holds nothing an earlier
    process under this worker's id left: no warning of a shared id, and the partition
    is not looked at for such places again."""
    store, clock = MemoryStore(), FakeClock()
    first = _engine(store, Queue("q"), worker_id="pod-1", clock=clock)
    second = _engine(store, Queue("q"), worker_id="pod-2", clock=clock)
    serving_first, _ = _serving(first)
    serving_second, _ = _serving(second)
    first.enqueue("parks", "p", queue="q")
    admitted = serving_first._admit(parts_of(first).enqueueing.book.queues["q"], 0, 1)
    assert len(admitted) == 1
    with caplog.at_level("WARNING", logger="loom"):
        queue = parts_of(second).enqueueing.book.queues["q"]
        assert serving_second._serve_partition(queue, 0, sweep=False) == 0
    assert "held under worker id" not in caplog.text
    assert ("q", 0) in serving_second._no_earlier
    assert admitted[0].let_go is not None
    admitted[0].let_go()


def test_two_workers_on_a_capped_queue_both_drive_its_runs_not_one_standing_by() -> None:
    """The first worker took every place of the cap and, as each run ended, the next
    at once: the second worker drove nothing until the first was killed. A worker
    left without runs says it is there (a take of no run), and the runs are shared."""
    store = MemoryStore()
    queue = Queue("q", concurrency=2)
    web = _engine(store, queue)
    handles = [web.enqueue("busy", {"tag": f"t{n}", "s": 0.05}, queue="q") for n in range(16)]
    engines = [_engine(store, queue, worker_id=name) for name in ("first", "second")]
    workers = [Worker(engine, concurrency=2, idle_poll=0.02) for engine in engines]
    with workers[0]:
        _wait(lambda: len(web.queue("q").active) == 2)  # the first holds the whole cap
        with workers[1]:
            for handle in handles:
                handle.result(timeout=30)
    driven = [worker.stats.driven for worker in workers]
    assert sum(driven) == 16
    assert min(driven) >= 4, f"runs driven by each worker: {driven}"


def test_a_worker_without_the_code_of_any_waiting_run_does_not_say_it_is_there() -> None:
    """Workers that could drive none of a queue's runs said they were present, so the
    one worker with the code held a third of the cap: peak 1 of 4, four times as slow."""
    store = MemoryStore()
    queue = Queue("q", concurrency=4)
    web = _engine(store, queue)
    for number in range(6):
        web.enqueue("busy", {"tag": f"t{number}", "s": 0.0}, queue="q")
    other = Engine(store, [parks], listeners=[], queues=[queue], worker_id="other")
    serving, slots = _serving(other, concurrency=4)
    with ThreadPoolExecutor(max_workers=4) as pool:
        slots.open(pool, None)
        assert serving.serve(sweep=False) == 0
        slots.close()
    assert parts_of(web).enqueueing.book.read("q", 0).pollers == {}, "no take of no run"
    hosting = _engine(store, queue, worker_id="hosting")
    serving, slots = _serving(hosting, concurrency=4)
    with ThreadPoolExecutor(max_workers=4) as pool:
        slots.open(pool, None)
        assert serving.serve(sweep=False) == 4, "the whole cap: nobody else is there"
        slots.close()


def test_a_beat_that_fails_after_a_queued_run_was_let_go_running_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A queued run whose drive let it go running is beaten for at once (the beat
    says this worker no longer drives it); a beat that fails then is a warning, and
    the worker goes on (the run waits again, and a later admission drives it)."""
    from loom_kernel._engine._enqueueing import QueuedDrive

    engine = _engine(MemoryStore(), Queue("q", concurrency=1))
    enqueueing = parts_of(engine).enqueueing
    drive_queued = enqueueing.drive_queued
    let_go = threading.Event()

    def let_go_running_once(execution_id: str) -> Any:
        if not let_go.is_set():
            let_go.set()
            return QueuedDrive.LEFT_RUNNING
            yield  # a drive: a generator
        return (yield from drive_queued(execution_id))

    heartbeat = parts_of(engine).driver.heartbeat
    beat = heartbeat.beat
    failed = threading.Event()

    def failing_for_the_let_go() -> None:
        if let_go.is_set() and not failed.is_set():
            failed.set()
            raise StoreUnavailableError("the beats cannot be written")
        beat()

    monkeypatch.setattr(enqueueing, "drive_queued", let_go_running_once)
    monkeypatch.setattr(heartbeat, "beat", failing_for_the_let_go)
    handle = engine.enqueue("busy", {"tag": "q", "s": 0.0}, queue="q")
    with caplog.at_level(logging.WARNING, logger="loom"), Worker(engine, idle_poll=0.05):
        assert handle.result(timeout=30) == "q"
    assert failed.is_set()
    said = "a beat letting a run go: StoreUnavailableError: the beats cannot be written"
    assert said in caplog.text
