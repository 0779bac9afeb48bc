"""Queues with limits: a concurrency cap that counts runs being driven (not parked
ones), a per-key limit, a rate limit and priorities, kept by any number of workers;
wakes of a queued run go back through its queue; a taker that stops gives back what
it admitted."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from loom_kernel import (
    Context,
    Engine,
    InvalidArgumentError,
    MemoryStore,
    Queue,
    Rate,
    SchemaError,
    Status,
    StoreUnavailableError,
    TrimmedError,
    Worker,
    flow,
)
from loom_kernel._coordination import QueueBook, QueueFold, RunIndex, partition_of, pick
from loom_kernel._engine import parts_of
from loom_kernel._hosting._queue_serving import QueueServing
from loom_kernel._hosting._slots import Slots, WorkerStats
from loom_kernel.events import QueuePlace
from loom_kernel.spi import NewRecord
from loom_kernel.testing import FakeClock

_lock = threading.Lock()
_running: Counter[str] = Counter()  # key ("" for none) -> runs in their step now
_peaks: Counter[str] = Counter()  # key -> the most at once; "*" for all keys
_order: list[str] = []


def _busy(tag: str, key: str, seconds: float) -> str:
    with _lock:
        _order.append(tag)
        _running[key] += 1
        _running["*"] += 1
        _peaks[key] = max(_peaks[key], _running[key])
        _peaks["*"] = max(_peaks["*"], _running["*"])
    time.sleep(seconds)
    with _lock:
        _running[key] -= 1
        _running["*"] -= 1
    return tag


@flow(name="busy", version="1")
def busy(ctx: Context, job: dict[str, Any]) -> Any:
    return ctx.step("work", lambda: _busy(job["tag"], job.get("key", ""), job.get("s", 0.03)))


@flow(name="parks", version="1")
def parks(ctx: Context, tag: str) -> Any:
    ctx.step("before", lambda: _busy(f"{tag}:before", "", 0.0))
    value = ctx.suspend("go")
    return ctx.step("after", lambda: _busy(f"{tag}:after:{value}", "", 0.0))


@flow(name="listens", version="1")
def listens(ctx: Context, _input: Any) -> Any:
    return ctx.receive(topic="t")


@flow(name="naps", version="1")
def naps(ctx: Context, seconds: float) -> Any:
    ctx.sleep(seconds)
    return ctx.step("woke", lambda: "woke")


@flow(name="job", version="1")
def job_v1(ctx: Context, _input: Any) -> Any:
    return ctx.step("s", lambda: "v1")


@flow(name="job", version="2")
def job_v2(ctx: Context, _input: Any) -> Any:
    return ctx.step("s", lambda: "v2")


FLOWS = [busy, parks, listens, naps]


@pytest.fixture(autouse=True)
def _clean() -> None:
    _running.clear()
    _peaks.clear()
    _order.clear()


def _engine(store: MemoryStore, *queues: Queue, **options: Any) -> Engine:
    return Engine(store, FLOWS, listeners=[], queues=queues, **options)


def _serving(engine: Engine, concurrency: int = 1) -> tuple[QueueServing, Slots]:
    """A worker's queue serving and slots, driven by hand (no poll loop)."""
    parts, stats = parts_of(engine), WorkerStats()
    slots = Slots(parts, concurrency, stats, threading.Event(), threading.Event())
    names = list(parts.enqueueing.book.queues)
    serving = QueueServing(
        parts, names, slots=slots, stats=stats, stopping=threading.Event(), beat=lambda: None
    )
    return serving, slots


def _wait(condition: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# -- the limits -------------------------------------------------------------------


def test_a_cap_holds_across_workers_and_every_run_ends() -> None:
    store = MemoryStore()
    first = _engine(store, Queue("q", concurrency=3))
    second = _engine(store, Queue("q", concurrency=3))
    handles = [first.enqueue("busy", {"tag": str(i)}, queue="q") for i in range(24)]
    with Worker(first, concurrency=8), Worker(second, concurrency=8):
        assert sorted(h.result(timeout=30) for h in handles) == sorted(str(i) for i in range(24))
    assert _peaks["*"] == 3, "the cap was kept and reached"
    view = first.queue("q")
    assert view.waiting == []
    assert view.active == []


def test_a_run_parked_holds_no_place_and_its_wake_waits_its_turn() -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q", concurrency=1))
    parked = engine.enqueue("parks", "p", queue="q")
    with Worker(engine):
        _wait(lambda: parked.get().status is Status.SUSPENDED)
        others = [engine.enqueue("busy", {"tag": str(i)}, queue="q") for i in range(3)]
        done = [h.result(timeout=10) for h in others]
        assert done == ["0", "1", "2"], "the parked run held no place"
        woken = engine.resume(parked.id, "yes", on="go")
        assert woken.status is Status.RUNNING, "the wake is journaled, not driven inline"
        assert woken.owner is None
        assert parked.result(timeout=10) == "p:after:yes"
    assert _peaks["*"] == 1


def test_a_per_key_limit_keeps_one_run_a_key_while_keys_run_side_by_side() -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q", per_key=1))
    handles = [
        engine.enqueue("busy", {"tag": f"{key}{i}", "key": key}, queue="q", queue_key=key)
        for i in range(4)
        for key in "ab"
    ]
    with Worker(engine, concurrency=8):
        for handle in handles:
            handle.result(timeout=10)
    assert _peaks["a"] == 1
    assert _peaks["b"] == 1
    assert _peaks["*"] == 2, "a run held back by its key holds back no other key"


def test_priorities_run_lower_first_then_in_arrival_order() -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q", concurrency=1))
    plan = [("late", 5), ("first", -3), ("mid1", 0), ("mid2", 0), ("last", 9), ("early", -1)]
    handles = [
        engine.enqueue("busy", {"tag": tag, "s": 0.0}, queue="q", priority=priority)
        for tag, priority in plan
    ]
    assert [engine.get(h.id).id for h in handles] == [h.id for h in handles]
    assert engine.queue("q").waiting == [handles[i].id for i in (1, 5, 2, 3, 0, 4)]
    with Worker(engine, concurrency=4):
        for handle in handles:
            handle.result(timeout=10)
    assert _order == ["first", "early", "mid1", "mid2", "late", "last"]


def test_a_rate_limit_admits_no_more_than_its_window_holds() -> None:
    store = MemoryStore()
    clock = FakeClock()
    engine = _engine(store, Queue("q", rate=Rate(2, per=60.0)), clock=clock)
    handles = [engine.enqueue("busy", {"tag": str(i), "s": 0.0}, queue="q") for i in range(5)]
    with Worker(engine, concurrency=8):
        _wait(lambda: sum(h.get().status is Status.COMPLETED for h in handles) == 2)
        time.sleep(0.3)  # a few polls: nothing more is admitted within the window
        assert sum(h.get().status is Status.COMPLETED for h in handles) == 2
        clock.advance(30)
        time.sleep(0.3)
        assert sum(h.get().status is Status.COMPLETED for h in handles) == 2
        clock.advance(31)
        _wait(lambda: sum(h.get().status is Status.COMPLETED for h in handles) == 4)
        time.sleep(0.3)
        assert sum(h.get().status is Status.COMPLETED for h in handles) == 4
        clock.advance(61)
        handles[4].result(timeout=10)
    assert [set(_order[:2]), set(_order[2:4]), _order[4:]] == [{"0", "1"}, {"2", "3"}, ["4"]]


def test_partitions_split_the_cap_and_keep_a_keys_runs_together() -> None:
    queue = Queue("q", concurrency=10, rate=Rate(7, per=1.0), partitions=4)
    shares = [queue.share(p) for p in range(4)]
    assert sum(cap or 0 for cap, _rate in shares) == 10
    assert sum(rate.limit for _cap, rate in shares if rate) == 7
    assert {queue.place(f"run{i}", 0, "customer-7").partition for i in range(50)} == {
        queue.place("x", 0, "customer-7").partition
    }
    assert len({queue.place(f"run{i}", 0, None).partition for i in range(200)}) == 4
    store = MemoryStore()
    engine = _engine(store, queue)
    handles = [engine.enqueue("busy", {"tag": str(i)}, queue="q") for i in range(40)]
    with Worker(engine, concurrency=16), Worker(_engine(store, queue), concurrency=16):
        for handle in handles:
            handle.result(timeout=20)
    assert _peaks["*"] <= 10


# -- wakes go back through the queue --------------------------------------------


def test_a_message_and_a_timer_wake_a_queued_run_through_its_queue() -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q", concurrency=2))
    listener = engine.enqueue("listens", None, queue="q")
    napper = engine.enqueue("naps", 0.2, queue="q")
    with Worker(engine):
        _wait(lambda: listener.get().status is Status.SUSPENDED)
        engine.send(listener.id, "hello", topic="t")
        assert listener.result(timeout=10) == "hello"
        assert napper.result(timeout=10) == "woke"
    kinds = [record.kind for record in store.read(engine.stream_of(napper.id))]
    assert kinds.count("EXECUTION_CLAIMED") == 2, "the timer's wake was claimed from the queue"


def test_recover_leaves_queued_runs_to_their_workers() -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q", concurrency=1))
    handle = engine.enqueue("busy", {"tag": "x", "s": 0.0}, queue="q")
    assert engine.recover() == []
    assert handle.get().status is Status.RUNNING
    assert _order == []
    assert engine.queue("q").waiting == [handle.id]


def test_a_run_whose_add_was_lost_is_put_back_on_its_queue(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    clock = FakeClock()
    engine = _engine(store, Queue("q"), clock=clock)

    def lost(*_args: Any) -> None:
        raise StoreUnavailableError("the store went away between the start and the add")

    real, parts_of(engine).enqueueing.book.add = parts_of(engine).enqueueing.book.add, lost  # type: ignore[method-assign,assignment]
    with caplog.at_level(logging.WARNING, logger="loom"):
        run = engine.enqueue("busy", {"tag": "x", "s": 0.0}, queue="q").id  # logged, not raised
    assert f"loom: {run} not put on queue 'q' yet: " in caplog.text
    parts_of(engine).enqueueing.book.add = real  # type: ignore[method-assign]
    engine.recover()
    assert engine.queue("q").waiting == [], "its writer may still be adding it"
    clock.advance(engine.lease)
    engine.recover()
    assert engine.queue("q").waiting == [run]
    with Worker(engine):
        assert engine.handle(run).result(timeout=10) == "x"


# -- takers that stop -------------------------------------------------------------


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


# -- refused at the call ----------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: Queue(""),
        lambda: Queue("a/b"),
        lambda: Queue("sp ace"),
        lambda: Queue("q", concurrency=0),
        lambda: Queue("q", concurrency=True),
        lambda: Queue("q", per_key=-1),
        lambda: Queue("q", partitions=0),
        lambda: Queue("q", concurrency=2, partitions=3),
        lambda: Queue("q", rate=Rate(2, per=1.0), partitions=3),
        lambda: Queue("q", rate=(2, 1.0)),  # type: ignore[arg-type]
        lambda: Rate(0, per=1.0),
        lambda: Rate(None, per=1.0),  # type: ignore[arg-type]
        lambda: Rate(1, per=0.0),
        lambda: Rate(1, per=float("nan")),
    ],
)
def test_a_bad_queue_is_refused(make: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        make()


def test_a_queue_whose_last_partitions_stream_id_is_too_long_is_refused() -> None:
    """Every partition's stream id must be a valid id, not only the first's."""
    name = "n" * (200 - len("queues/") - 2)  # queues/<name>/9 fits, /10 does not
    assert len(Queue(name, partitions=10).name) == len(name)
    with pytest.raises(InvalidArgumentError, match="shorten its name"):
        Queue(name, partitions=11)


@pytest.mark.parametrize(
    "options",
    [
        {"queue": "nope"},
        {"queue": "q", "priority": 2**31},
        {"queue": "q", "priority": 1.5},
        {"queue": "q", "priority": True},
        {"queue": "q", "queue_key": ""},
        {"queue": "q", "queue_key": 7},
        {"queue": "q", "queue_key": "\ud800"},
        {"priority": 1},
        {"priority": False},
        {"priority": 0.0},
        {"queue_key": "k"},
    ],
)
def test_a_bad_enqueue_is_refused_and_journals_nothing(options: dict[str, Any]) -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q"))
    with pytest.raises(InvalidArgumentError):
        engine.enqueue("busy", {"tag": "x"}, key="k1", **options)
    assert store.head("ex/k1") == 0
    assert store.head("queues/q/0") == 0


def test_two_queues_of_one_name_and_a_worker_of_an_unknown_queue_are_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        _engine(MemoryStore(), Queue("q"), Queue("q"))
    with pytest.raises(InvalidArgumentError, match="a list of Queue"):
        Engine(MemoryStore(), FLOWS, queues=Queue("q"))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        Worker(_engine(MemoryStore(), Queue("q")), queues=["other"])


def test_a_queued_start_records_its_place() -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q", partitions=1))
    handle = engine.enqueue("busy", {"tag": "x"}, queue="q", priority=-4, queue_key="c7")
    assert engine.state(handle.id).queue == QueuePlace("q", 0, -4, "c7")
    start = json.loads(store.read(engine.stream_of(handle.id))[0].payload)
    assert start["d"]["queue"] == {"name": "q", "partition": 0, "priority": -4, "key": "c7"}
    assert QueueFold("s").line() == []


def test_a_queued_runs_hint_names_its_queue_through_a_checkpoint() -> None:
    store = MemoryStore()
    index = RunIndex(store, time.time)
    index.opened("queued", "f", None, "q")
    partition = partition_of("queued")
    others = [f"o{i}" for i in range(2000) if partition_of(f"o{i}") == partition][:40]
    for other in others:
        index.opened(other, "f", None)
        index.closed(other, Status.COMPLETED, "f")
    index.open_in(partition)  # 40 closed runs: this read checkpoints the partition
    kinds = [record.kind for record in store.read(f"runs/open/{partition}", 81)]
    assert "loom.run.checkpoint" in kinds
    (hint,) = RunIndex(store, time.time).open_in(partition)[1]
    assert (hint.execution_id, hint.queue) == ("queued", "q")


# -- found by review: each fails without its fix -------------------------------------


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


def test_one_pick_admits_a_key_up_to_its_limit() -> None:
    """Runs of one key picked together count one each: with two a key allowed, a pick
    admits the first two of three waiting with that key, and a run of another key."""
    queue = Queue("q", per_key=2)
    store, clock = MemoryStore(), FakeClock()
    book = QueueBook(store, clock, [queue])
    for run, key in (("a", "k"), ("b", "k"), ("c", "k"), ("d", "other")):
        book.add(queue.place(run, 0, key), run, "f", "")
    fold = book.read("q", 0)
    chosen = pick(fold, cap=None, per_key=2, rate=None, now=clock.now, free=4)
    assert chosen == ["a", "b", "d"]
    book.take("q", 0, fold, chosen, "w")
    assert pick(book.read("q", 0), cap=None, per_key=2, rate=None, now=clock.now, free=4) == []


#: blake2b (4 bytes, big-endian) of the key, or else the run's id, modulo the partitions.
_PARTITIONS_OF_IDS = [11, 6, 0, 9, 9, 4, 4, 13]
_PARTITIONS_OF_KEYS = [13, 8, 6, 15, 9, 0, 1, 10]


def test_a_runs_queue_partition_is_a_stable_function_of_its_key_or_id() -> None:
    """Every process, of every Loom version, must put a key in the same partition, or
    the per-key limit (exact within a partition) would not hold across them."""
    queue = Queue("q", partitions=16)
    assert [queue.place(f"run-{n}", 0, None).partition for n in range(8)] == _PARTITIONS_OF_IDS
    assert [queue.place("any", 0, f"customer-{n}").partition for n in range(8)] == (
        _PARTITIONS_OF_KEYS
    )


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


def test_runs_cancelled_while_waiting_use_up_no_rate() -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q", rate=Rate(2, per=3600.0)))
    cancelled = [engine.enqueue("busy", {"tag": t, "s": 0.0}, queue="q") for t in "ab"]
    for handle in cancelled:
        engine.cancel(handle.id, "not wanted")
    live = engine.enqueue("busy", {"tag": "live", "s": 0.0}, queue="q")
    with Worker(engine):
        assert live.result(timeout=10) == "live"
        _wait(lambda: engine.queue("q").waiting == [])
    assert len(parts_of(engine).enqueueing.book.read("q", 0).admitted) == 1, (
        "only the live run's counts"
    )


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


def test_a_worker_without_the_pinned_code_never_admits_the_run() -> None:
    store = MemoryStore()
    queue = Queue("q", rate=Rate(5, per=60.0))
    old = Engine(store, [job_v1], listeners=[], queues=[queue])
    new = Engine(store, [job_v2], listeners=[], queues=[queue])
    handle = new.enqueue("job", None, queue="q")
    with Worker(old):
        time.sleep(0.3)  # a few polls
        assert new.queue("q").waiting == [handle.id]
        assert parts_of(new).enqueueing.book.read("q", 0).admitted == []
    with Worker(new):
        assert handle.result(timeout=10) == "v2"


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


def test_a_queues_limits_are_named_never_positional() -> None:
    with pytest.raises(TypeError):
        Queue("q", 3)  # type: ignore[call-arg]
    assert Queue("q", concurrency=3).concurrency == 3


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


def test_a_queued_runs_wake_that_fails_to_land_is_raised_and_puts_nothing_on_the_queue() -> None:
    from loom_kernel.spi import Fault

    store = MemoryStore()
    engine = _engine(store, Queue("q"))
    parked = engine.enqueue("parks", "p", queue="q")
    with Worker(engine):
        _wait(lambda: parked.get().status is Status.SUSPENDED)
    store.inject_fault(Fault.UNAVAILABLE)  # the wake's append fails, nothing landed
    with pytest.raises(StoreUnavailableError):
        engine.resume(parked.id, "yes", on="go")
    assert parked.get().status is Status.SUSPENDED, "not woken"
    assert engine.queue("q").waiting == [], "nothing to drive was queued"
    assert engine.resume(parked.id, "yes", on="go").status is Status.RUNNING, "tried again"
    with Worker(engine):
        assert parked.result(timeout=10) == "p:after:yes"


def test_a_queued_run_a_worker_drives_counts_once_as_visited_and_driven() -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q", concurrency=2))
    with Worker(engine, idle_poll=60.0) as worker:
        _wait(lambda: len(worker._visits._heads) == 16)  # its first sweep is over: the next is far
        handles = [engine.enqueue("busy", {"tag": f"t{n}", "s": 0.0}, queue="q") for n in range(3)]
        assert [handle.result(timeout=10) for handle in handles] == ["t0", "t1", "t2"]
        _wait(lambda: worker.stats.driven == 3 and worker.stats.visited >= 3)
        assert worker.stats.visited == 3, "one visit each"


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


def test_an_enqueue_on_a_queue_waits_there_at_once_with_no_worker_running() -> None:
    engine = _engine(MemoryStore(), Queue("q"))
    handle = engine.enqueue("parks", "w", queue="q")
    assert engine.queue("q").waiting == [handle.id], "not left for a sweep to add"


def test_a_waiting_queued_run_migrated_to_new_code_is_driven_by_its_workers() -> None:
    """`resume_as` of a run waiting on its queue gives its entry there the new code
    (keeping its place): workers with only the new code admit it."""
    store = MemoryStore()
    old = Engine(store, [job_v1], listeners=[], queues=[Queue("q")])
    new = Engine(store, [job_v1, job_v2], listeners=[], queues=[Queue("q")])
    only_new = Engine(store, [job_v2], listeners=[], queues=[Queue("q")])
    first = old.enqueue("job", None, queue="q")
    second = old.enqueue("job", None, queue="q")
    new.resume_as(second.id, "2")
    new.resume_as(first.id, "2")
    assert new.queue("q").waiting == [first.id, second.id], "each kept its place"
    with Worker(only_new):
        assert first.result(timeout=10) == "v2"
        assert second.result(timeout=10) == "v2"


def test_a_run_woken_while_its_driver_finishes_waits_behind_the_runs_before_its_wake() -> None:
    """A wake that lands before the driver's done (a listener resuming the run as it
    parks) puts it in line at the wake's place, not back at its first one."""
    engine: list[Engine] = []

    def resume_at_once(_engine: Engine, execution: Any) -> None:
        if execution.status is Status.SUSPENDED:
            engine[0].resume(execution.id, "now", on="go")

    store = MemoryStore()
    engine.append(
        Engine(store, FLOWS, listeners=[resume_at_once], queues=[Queue("q", concurrency=1)])
    )
    parked = engine[0].enqueue("parks", "p", queue="q")
    others = [engine[0].enqueue("busy", {"tag": f"r{i}", "s": 0.0}, queue="q") for i in range(3)]
    with Worker(engine[0], concurrency=1):
        assert parked.result(timeout=10) == "p:after:now"
        for handle in others:
            handle.result(timeout=10)
    assert _order == ["p:before", "r0", "r1", "r2", "p:after:now"]


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


def test_a_migrated_queued_run_whose_queue_cannot_be_read_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`resume_as` of a run waiting on its queue migrates the run; a queue that cannot
    be read then (its entry keeps the old code) is logged, not passed over in silence."""
    store = MemoryStore()
    old = Engine(store, [job_v1], listeners=[], queues=[Queue("q")])
    new = Engine(store, [job_v1, job_v2], listeners=[], queues=[Queue("q")])
    handle = old.enqueue("job", None, queue="q")

    def unreadable(*_args: Any) -> Any:
        raise StoreUnavailableError("the queue is unreadable (injected)")

    monkeypatch.setattr(parts_of(new).enqueueing.book, "read", unreadable)
    with caplog.at_level(logging.WARNING, logger="loom"):
        new.resume_as(handle.id, "2")
    assert [r.getMessage() for r in caplog.records] == [
        f"loom: {handle.id}: its queue not told of its new code: the queue is unreadable (injected)"
    ]


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
