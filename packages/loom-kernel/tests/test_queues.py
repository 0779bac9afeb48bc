"""Queues with limits: a concurrency cap that counts runs being driven (not parked
ones), a per-key limit, a rate limit and priorities, kept by any number of workers;
partitions that split the limits and keep a key's runs together; wakes of a queued run
go back through its queue; a queued run keeps its place through a migration; bad
queues and enqueues are refused and journal nothing."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
from loom_kernel import (
    Engine,
    InvalidArgumentError,
    MemoryStore,
    Queue,
    Rate,
    Status,
    StoreUnavailableError,
    Worker,
)
from loom_kernel._coordination import QueueBook, QueueFold, RunIndex, partition_of, pick
from loom_kernel._engine import parts_of
from loom_kernel.events import QueuePlace
from loom_kernel.testing import FakeClock
from queue_helpers import FLOWS, _engine, _order, _peaks, _wait, job_v1, job_v2

pytestmark = pytest.mark.usefixtures("fresh_counts")


# -- the limits ------------------------------------------------------------------------


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


def test_a_worker_polls_again_when_the_rates_window_has_room_not_at_its_idle_pace() -> None:
    """A rate held back waiting runs: the worker's next poll comes as the window's
    oldest admission leaves it (40 runs at a rate of 4 a second took 14.5 s, where
    the rate allows about 10, waiting for idle polls)."""
    from queue_helpers import _serving

    clock = FakeClock()
    engine = _engine(MemoryStore(), Queue("q", rate=Rate(2, per=60.0)), clock=clock)
    for number in range(3):
        engine.enqueue("parks", f"p{number}", queue="q")
    serving, _slots = _serving(engine, concurrency=8)
    queue = parts_of(engine).enqueueing.book.queues["q"]
    assert len(serving._admit(queue, 0, 8)) == 2, "the window holds two"
    serving._due = None
    clock.advance(20)
    assert serving._admit(queue, 0, 8) == []
    assert 39 < serving.until_due() <= 40, "the first admission leaves the window in 40 s"


def test_pick_shares_a_partitions_runs_among_the_workers_present() -> None:
    """A worker with many free slots leaves the other workers present theirs: it holds
    at most its share of the cap, and takes at most its share of the waiting runs; a
    worker not seen for a while counts for nothing."""
    store, now = MemoryStore(), 1000.0
    book = QueueBook(store, lambda: now, [Queue("q")])
    for number in range(8):
        book.add(QueuePlace("q", 0, 0, None), f"r{number}", "busy", "")
    with book.holding("q", 0):
        fold = book.refresh("q", 0)
        book.take("q", 0, fold, ["r0"], "b")  # b took one: it is present
    fold = book.read("q", 0)
    assert fold.pollers == {"b": now}
    alone = pick(fold, cap=None, per_key=None, rate=None, now=now, free=8)
    assert len(alone) == 7, "no worker named: the old behaviour, everything that fits"
    shared = pick(
        fold, cap=None, per_key=None, rate=None, now=now, free=8, me="a", present_since=now - 10
    )
    assert shared == ["r1", "r2", "r3", "r4"], "half of the seven waiting"
    capped = pick(
        fold, cap=4, per_key=None, rate=None, now=now, free=8, me="a", present_since=now - 10
    )
    assert capped == ["r1", "r2"], "half the cap of four, less nothing held yet"
    gone = pick(
        fold, cap=4, per_key=None, rate=None, now=now, free=8, me="a", present_since=now + 1
    )
    assert len(gone) == 3, "b not seen since: a takes what the cap leaves (4 - 1 held)"


def test_a_worker_whose_clock_ran_ahead_is_not_present_once_it_stopped() -> None:
    """A take stamped an hour ahead kept its worker "present" for an hour after it
    left, halving everyone's share of the cap: presence is bounded by the reader's
    clock (ahead by a third of a lease at most)."""
    store, now = MemoryStore(), 1000.0
    clocks = {"ahead": now + 3600.0, "b": now}
    taker = "ahead"
    book = QueueBook(store, lambda: clocks[taker], [Queue("q")])
    for number in range(8):
        book.add(QueuePlace("q", 0, 0, None), f"r{number}", "busy", "")
    with book.holding("q", 0):
        book.take("q", 0, book.refresh("q", 0), ["r0"], "ahead")
    fold = book.read("q", 0)
    assert fold.pollers == {"ahead": now + 3600.0}
    mine = pick(
        fold, cap=4, per_key=None, rate=None, now=now, free=8, me="a", present_since=now - 10
    )
    assert mine == ["r1", "r2", "r3"], "the whole cap less the run held: nobody shares it"


def test_a_take_of_no_run_moves_no_rate_window() -> None:
    """A worker saying it is there (a take of no run) with its clock past the window
    emptied the window: a queue at Rate(2, per=10) admitted 20 runs in 6 s."""
    store = MemoryStore()
    clocks = {"now": 1000.0}
    book = QueueBook(store, lambda: clocks["now"], [Queue("q", rate=Rate(2, per=10.0))])
    for number in range(4):
        book.add(QueuePlace("q", 0, 0, None), f"r{number}", "busy", "")
    with book.holding("q", 0):
        book.take("q", 0, book.refresh("q", 0), ["r0", "r1"], "hosting")
        clocks["now"] = 1011.0  # a worker whose clock is 11 s ahead says it is there
        book.take("q", 0, book.refresh("q", 0), [], "ahead")
    fold = book.read("q", 0)
    assert fold.admitted == [1000.0, 1000.0], "the two admissions still fill the window"
    rate = Rate(2, per=10.0)
    assert pick(fold, cap=None, per_key=None, rate=rate, now=1001.0, free=4) == []


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


# -- a queued run's place --------------------------------------------------------------


def test_a_queued_start_records_its_place() -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q", partitions=1))
    handle = engine.enqueue("busy", {"tag": "x"}, queue="q", priority=-4, queue_key="c7")
    assert engine.state(handle.id).queue == QueuePlace("q", 0, -4, "c7")
    start = json.loads(store.read(engine.stream_of(handle.id))[0].payload)
    assert start["d"]["queue"] == {"name": "q", "partition": 0, "priority": -4, "key": "c7"}
    assert QueueFold("s").line() == []


@pytest.mark.usefixtures("flow_loop")
def test_a_queue_place_defaults_to_the_first_partition_the_middle_priority_and_no_key() -> None:
    from loom_kernel.events import QueuePlace

    assert QueuePlace("q") == QueuePlace("q", partition=0, priority=0, key=None)


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


def test_an_enqueue_on_a_queue_waits_there_at_once_with_no_worker_running() -> None:
    engine = _engine(MemoryStore(), Queue("q"))
    handle = engine.enqueue("parks", "w", queue="q")
    assert engine.queue("q").waiting == [handle.id], "not left for a sweep to add"


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


def test_recover_leaves_queued_runs_to_their_workers() -> None:
    store = MemoryStore()
    engine = _engine(store, Queue("q", concurrency=1))
    handle = engine.enqueue("busy", {"tag": "x", "s": 0.0}, queue="q")
    assert engine.recover() == []
    assert handle.get().status is Status.RUNNING
    assert _order == []
    assert engine.queue("q").waiting == [handle.id]


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


# -- wakes go back through the queue ---------------------------------------------------


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


# -- refused at the call ---------------------------------------------------------------


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


def test_a_queues_limits_are_named_never_positional() -> None:
    with pytest.raises(TypeError):
        Queue("q", 3)  # type: ignore[call-arg]
    assert Queue("q", concurrency=3).concurrency == 3


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
