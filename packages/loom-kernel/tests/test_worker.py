"""The worker and enqueue: runs started without being driven are driven by a worker,
timers fire on their own, and a stopping worker lets go of what it holds."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from loom_kernel import (
    Context,
    Engine,
    ExecutionEndedError,
    InvalidArgumentError,
    MemoryStore,
    ResultTimeoutError,
    RunHandle,
    SchemaError,
    Status,
    StoreUnavailableError,
    Worker,
    flow,
)
from loom_kernel._coordination import driving_here, partition_of
from loom_kernel._engine import parts_of
from loom_kernel._replay import Drive
from loom_kernel.events import ExecutionClaimed, ExecutionStarted

effects: Counter[str] = Counter()
effects_lock = threading.Lock()


def _drive_of(call: Callable[[], Any]) -> Callable[[], Drive[Any]]:
    """A worker task's drive that makes `call` and asks for no pass of async code."""

    def drive() -> Drive[Any]:
        return call()
        yield  # a generator, as a drive is

    return drive


_idle = _drive_of(lambda: None)  # a task that does nothing


def _effect(name: str) -> str:
    with effects_lock:
        effects[name] += 1
    return name


@flow(name="three", version="1")
def three(ctx: Context, tag: str) -> Any:
    return [ctx.step(f"s{i}", lambda i=i: _effect(f"{tag}:{i}")) for i in range(3)]


@flow(name="broken", version="1")
def broken(ctx: Context, _input: Any) -> Any:
    raise ValueError("no")


@flow(name="napper", version="1")
def napper(ctx: Context, seconds: float) -> Any:
    ctx.sleep(seconds)
    return "rested"


gate = threading.Event()
at_gate = threading.Event()  # set once a "slow" run's step waits at the gate


def _wait_at_gate(tag: str) -> Any:
    at_gate.set()
    return gate.wait(10) and _effect(f"{tag}:wait")


@flow(name="slow", version="1")
def slow(ctx: Context, tag: str) -> Any:
    ctx.step("wait", lambda: _wait_at_gate(tag))
    return ctx.step("after", lambda: _effect(f"{tag}:after"))


FLOWS = [three, broken, napper, slow]


def _driven(worker: Worker, count: int) -> int:
    """The runs `worker` drove, once it has counted `count` (a handle can see a run
    end a moment before the slot that drove it counts it)."""
    deadline = time.monotonic() + 10
    while worker.stats.driven < count and time.monotonic() < deadline:
        time.sleep(0.005)
    return worker.stats.driven


def _visited(worker: Worker, count: int) -> int:
    """As `_driven`, for the runs looked at (counted last, once a drive is over)."""
    deadline = time.monotonic() + 10
    while worker.stats.visited < count and time.monotonic() < deadline:
        time.sleep(0.005)
    return worker.stats.visited


def _engine(store: MemoryStore, **options: Any) -> Engine:
    return Engine(store, FLOWS, listeners=[], **options)


@pytest.fixture(autouse=True)
def _clean() -> None:
    effects.clear()
    gate.clear()
    at_gate.clear()


def test_enqueue_journals_a_run_no_one_drives_until_a_worker_does() -> None:
    store = MemoryStore()
    engine = _engine(store)
    handle = engine.enqueue("three", "a", key="a")
    assert isinstance(handle, RunHandle)
    view = engine.get("a")
    assert (view.status, view.owner, view.position) == (Status.RUNNING, None, 1)
    assert not effects, "nothing ran inline"
    with pytest.raises(ResultTimeoutError, match="still running"):
        handle.result(timeout=0.05)
    with Worker(_engine(store), idle_poll=0.05):
        assert handle.result(timeout=10) == ["a:0", "a:1", "a:2"]
    assert effects == Counter({"a:0": 1, "a:1": 1, "a:2": 1})
    assert engine.enqueue("three", "a", key="a") == handle, "the same key, the same run"
    assert engine.get("a").position == view.position + 5  # claim, 3 steps, end


def test_an_enqueue_on_the_workers_own_engine_wakes_it_at_once() -> None:
    engine = _engine(MemoryStore())
    with Worker(engine, idle_poll=60.0):
        time.sleep(0.2)  # the worker is idle: its next poll is a minute away
        started = time.monotonic()
        assert engine.enqueue("three", "b").result(timeout=10) == ["b:0", "b:1", "b:2"]
        assert time.monotonic() - started < 30


def test_a_failed_or_cancelled_run_raises_from_result() -> None:
    store = MemoryStore()
    engine = _engine(store)
    failed = engine.enqueue("broken")
    cancelled = engine.enqueue("three", "c")
    engine.cancel(cancelled.id, "changed my mind")
    with (
        Worker(_engine(store), idle_poll=0.05),
        pytest.raises(ExecutionEndedError, match="failed: ValueError: no") as caught,
    ):
        failed.result(timeout=10)
    assert (caught.value.status, caught.value.error_type) == ("failed", "ValueError")
    with pytest.raises(ExecutionEndedError, match="cancelled: changed my mind"):
        cancelled.result(timeout=0)
    assert not effects


def test_bad_arguments_are_refused() -> None:
    engine = _engine(MemoryStore())
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="concurrency"):
            Worker(engine, concurrency=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="idle_poll"):
        Worker(engine, idle_poll=float("nan"))
    with pytest.raises(InvalidArgumentError, match="timeout"):
        engine.enqueue("three", "x").result(timeout=-1)


def test_a_worker_fires_due_timers() -> None:
    engine = _engine(MemoryStore())
    run = engine.start("napper", 0.2)
    assert run.status is Status.SUSPENDED
    with Worker(engine, idle_poll=0.05) as worker:
        assert engine.handle(run.id).result(timeout=10) == "rested"
        deadline = time.monotonic() + 10
        while worker.stats.timers == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # counted once its wake's drive returns
    assert (worker.stats.timers, worker.stats.failures) == (1, 0), "one timer, counted once"


def test_two_workers_drive_two_hundred_runs_each_step_once() -> None:
    store = MemoryStore()
    handles = [_engine(store).enqueue("three", f"r{n}") for n in range(200)]
    workers = [_engine(store, worker_id=f"w{n}") for n in range(2)]
    with (
        Worker(workers[0], concurrency=4, idle_poll=0.02),
        Worker(workers[1], concurrency=4, idle_poll=0.02),
    ):
        for handle in handles:
            handle.wait(timeout=30)
    assert all(count == 1 for count in effects.values())
    assert len(effects) == 600
    claims = [
        entry.event
        for handle in handles
        for entry in _engine(store).history(handle.id)
        if isinstance(entry.event, ExecutionClaimed)
    ]
    assert len(claims) == len(handles), "each run claimed once"
    assert {claim.by for claim in claims} <= {"w0", "w1"}


def test_a_stopping_worker_releases_its_run_and_another_takes_it_at_once() -> None:
    store = MemoryStore()
    first = _engine(store, lease=3600.0)  # a lease that would keep the run an hour
    handle = first.enqueue("slow", "s")
    worker = Worker(first, idle_poll=0.02).start()
    assert at_gate.wait(10), "the step is in flight (not merely claimed) when the stop comes"
    stopper = threading.Thread(target=worker.stop, kwargs={"grace": 0.0})
    stopper.start()
    assert worker._slots.released.wait(10)
    gate.set()  # the step in flight finishes; the next one is not started
    stopper.join(10)
    assert not stopper.is_alive()
    assert effects == Counter({"s:wait": 1})
    view = first.get(handle.id)
    assert view.status is Status.RUNNING
    with Worker(_engine(store, lease=3600.0), idle_poll=0.02):
        assert handle.result(timeout=10) == "s:after"
    assert effects == Counter({"s:wait": 1, "s:after": 1})


def test_a_run_released_at_a_stop_is_taken_by_a_running_worker_at_its_next_poll() -> None:
    # The other worker saw the run open (driven by the first) long before the stop:
    # with a lease of an hour its next sweep is half an hour away.
    store = MemoryStore()
    first = _engine(store, lease=3600.0)
    handle = first.enqueue("slow", "r")
    worker = Worker(first, idle_poll=0.02).start()
    assert at_gate.wait(10)
    other = Worker(_engine(store, lease=3600.0), idle_poll=0.02).start()
    try:
        deadline = time.monotonic() + 10
        while other.stats.visited == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # it has looked at the run, and left it to its owner
        assert other.stats.visited >= 1
        assert other.stats.driven == 0
        stopper = threading.Thread(target=worker.stop, kwargs={"grace": 0.0})
        stopper.start()
        assert worker._slots.released.wait(10)
        gate.set()
        stopper.join(10)
        # Not `status is RUNNING` here: the other worker may have finished it already.
        assert handle.result(timeout=10) == "r:after", "taken over at once"
        assert _driven(other, 1) == 1, "by the other worker: the stop left it running"
    finally:
        other.stop()
    assert effects == Counter({"r:wait": 1, "r:after": 1})


@flow(name="elsewhere", version="1")
def elsewhere(ctx: Context, _input: Any) -> Any:
    return ctx.step("s", lambda: "done")


def _stop_with_runs_released(worker: Worker, engine: Engine, runs: list[str]) -> None:
    """Stop `worker` as if `runs` were in flight when its grace ended: each is left
    running, owned by `engine` (their flow is one its engine lacks, so that its polls
    leave them alone)."""
    starter = Engine(engine.store, [elsewhere], listeners=[])
    for execution_id in runs:
        starter.enqueue("elsewhere", key=execution_id)  # no worker: nobody's
        driver = parts_of(starter).driver
        state = driver.checkout(execution_id)
        driver.append(state, [ExecutionClaimed(engine.worker_id, None)])  # this engine's
        assert engine.get(execution_id).owner == engine.worker_id
    worker._wind_down = lambda: setattr(worker, "_released_runs", runs)  # type: ignore[method-assign]
    worker.stop()


def test_the_nudges_of_a_stop_end_at_the_first_store_failure() -> None:
    store = MemoryStore()
    engine = _engine(store, lease=3600.0)
    worker = Worker(engine, idle_poll=0.02)
    calls: list[str] = []

    def down(execution_id: str, flow_name: str) -> None:
        calls.append(execution_id)
        raise StoreUnavailableError("the store went away at the stop")

    parts_of(engine).driver.runs.nudged = down  # type: ignore[method-assign,assignment]
    worker.start()
    _stop_with_runs_released(worker, engine, ["a", "b", "c"])
    assert calls == ["a"], "one failed call, not one per released run"
    assert worker._stopped.is_set()


def test_a_stop_whose_last_beat_fails_nudges_nothing_and_still_ends() -> None:
    store = MemoryStore()
    engine = _engine(store, lease=3600.0)
    worker = Worker(engine, idle_poll=0.02).start()
    nudged: list[str] = []
    parts_of(engine).driver.runs.nudged = lambda execution_id, _flow: nudged.append(execution_id)  # type: ignore[method-assign,assignment]

    def no_beat() -> None:
        raise StoreUnavailableError("the last beat cannot be written")

    parts_of(engine).driver.heartbeat.beat = no_beat  # type: ignore[method-assign]
    _stop_with_runs_released(worker, engine, ["a"])
    assert nudged == [], "the old beat still lists the run: a nudge would find it held"
    assert worker._stopped.is_set()


def test_a_worker_that_fails_as_it_stops_still_says_it_stopped() -> None:
    store = MemoryStore()
    engine = _engine(store)

    def broken() -> None:
        raise OSError("a store that breaks its contract")

    worker = Worker(engine, idle_poll=0.02)
    parts_of(engine).driver.heartbeat.beat = broken  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            worker.run(handle_signals=False)
        except OSError as exc:
            errors.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    assert worker._ready.wait(10)
    stopper = threading.Thread(target=worker.stop, daemon=True)
    stopper.start()
    stopper.join(10)
    assert not stopper.is_alive(), "stop() returns once run() has said it stopped"
    runner.join(10)
    assert [str(exc) for exc in errors] == ["a store that breaks its contract"]


def test_a_released_run_whose_start_never_landed_is_not_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    engine = _engine(store, lease=3600.0)
    worker = Worker(engine, idle_poll=0.02).start()
    worker._wind_down = lambda: setattr(worker, "_released_runs", ["never"])  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="loom"):
        worker.stop()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_worker_does_not_take_a_run_its_owner_is_driving() -> None:
    store = MemoryStore()
    inline = _engine(store)
    result: list[Any] = []
    driver = threading.Thread(target=lambda: result.append(inline.start("slow", "t", key="t")))
    driver.start()
    with Worker(_engine(store), idle_poll=0.02) as worker:
        time.sleep(0.3)  # several polls and a sweep see the run open
        gate.set()
        driver.join(10)
        assert worker.stats.driven == 0
    assert result[0].status is Status.COMPLETED
    assert effects == Counter({"t:wait": 1, "t:after": 1})


def test_a_run_woken_by_a_timer_is_driven_in_the_pool_and_released_on_stop() -> None:
    """The wake of a timer is work like any other: the worker goes on polling while it
    drives, and a stop releases it at its next step."""

    def slow_effect(index: int) -> str:
        time.sleep(0.3)
        return _effect(f"nap:{index}")

    @flow(name="long_nap", version="1")
    def long_nap(ctx: Context, _input: Any) -> Any:
        ctx.sleep(0.05)
        for index in range(6):
            ctx.step(f"s{index}", lambda index=index: slow_effect(index))
        return "done"

    engine = Engine(MemoryStore(), [*FLOWS, long_nap], listeners=[])
    engine.start("long_nap", key="n")
    worker = Worker(engine, grace=0.1, idle_poll=0.02).start()
    deadline = time.monotonic() + 10
    while not effects and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.enqueue("three", "q").result(timeout=5) == ["q:0", "q:1", "q:2"]
    began = time.monotonic()
    worker.stop()
    assert time.monotonic() - began < 1.5, "released at its next step, not driven to its end"
    assert engine.get("n").status is Status.RUNNING


def test_a_timer_wake_released_before_its_first_step_journals_the_wake_and_no_step() -> None:
    woken = threading.Event()
    hold = threading.Event()

    @flow(name="wakes", version="1")
    def wakes(ctx: Context, _input: Any) -> Any:
        ctx.sleep(0.05)
        woken.set()
        hold.wait(10)  # released here, before the first step after the wake
        return ctx.step("after", lambda: _effect("after"))

    store = MemoryStore()
    engine = Engine(store, [*FLOWS, wakes], listeners=[])
    engine.start("wakes", key="w")
    worker = Worker(engine, grace=0.05, idle_poll=0.02).start()
    assert woken.wait(10)
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    time.sleep(0.2)  # the grace is over: the drive is released
    hold.set()
    stopper.join(10)
    assert "after" not in effects, "a released drive starts no step"
    kinds = [record.kind for record in store.read("ex/w")]
    assert kinds[-1] == "EXECUTION_RESUMED", "the wake landed; nothing after it"


def test_a_visit_that_has_not_started_driving_is_released_too() -> None:
    class SlowReads(MemoryStore):
        slow = False

        def _read(self, stream: str, after: int, limit: int | None) -> Any:
            if self.slow and stream.startswith("ex/"):
                time.sleep(0.4)  # a slow GET, while the visit loads the run
            return super()._read(stream, after, limit)

    store = SlowReads()
    engine = _engine(store)
    worker = Worker(engine, grace=0.0, idle_poll=0.02).start()
    store.slow = True
    _engine(store).enqueue("three", "late", key="late")  # from another process
    time.sleep(0.15)  # the visit is loading the run
    worker.stop()
    assert not effects, "no step started once the worker was released"
    assert engine.get("late").status is Status.RUNNING


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


def test_an_enqueue_beside_a_free_slot_is_handed_to_it_and_driven_with_no_claim() -> None:
    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, idle_poll=60.0) as worker:
        time.sleep(0.1)  # idle: its next poll is a minute away
        handle = engine.enqueue("three", "h", key="h")
        assert handle.result(timeout=10) == ["h:0", "h:1", "h:2"]
        assert _driven(worker, 1) == 1
    events = [entry.event for entry in engine.history("h")]
    assert not any(isinstance(event, ExecutionClaimed) for event in events)
    assert isinstance(events[0], ExecutionStarted)
    assert events[0].by == engine.worker_id, "started as the engine's own, as start does"
    assert effects == Counter({"h:0": 1, "h:1": 1, "h:2": 1})


def _claims(engine: Engine, execution_id: str) -> int:
    events = (entry.event for entry in engine.history(execution_id))
    return sum(isinstance(event, ExecutionClaimed) for event in events)


def test_enqueues_while_every_slot_is_busy_wait_as_the_engines_own_and_need_no_claim() -> None:
    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, concurrency=1, idle_poll=0.02) as worker:
        busy = engine.enqueue("slow", "b", key="busy")  # takes the only slot
        waiting = [engine.enqueue("three", f"w{i}", key=f"w{i}") for i in range(3)]
        assert all(engine.get(f"w{i}").owner == engine.worker_id for i in range(3))
        gate.set()
        assert [handle.result(timeout=10) for handle in waiting] == [
            [f"w{i}:0", f"w{i}:1", f"w{i}:2"] for i in range(3)
        ]
        busy.result(timeout=10)
        assert _driven(worker, 4) == 4
    assert [_claims(engine, f"w{i}") for i in range(3)] == [0, 0, 0]


def test_an_enqueue_waiting_too_long_for_a_busy_slot_is_let_go_to_any_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("loom_kernel._hosting._slots._HANDED_WAIT", 0.2)
    store = MemoryStore()
    engine = _engine(store, lease=600.0)  # taken over at once, not a lease later
    with Worker(engine, concurrency=1, idle_poll=60.0) as worker:
        busy = engine.enqueue("slow", "b", key="busy")  # takes the only slot
        queued = [engine.enqueue("three", f"q{i}", key=f"q{i}") for i in range(3)]
        assert {engine.get(f"q{i}").owner for i in range(3)} == {engine.worker_id}
        with Worker(_engine(store, lease=600.0), idle_poll=0.02):  # another process's
            assert [handle.result(timeout=10) for handle in queued] == [
                [f"q{i}:0", f"q{i}:1", f"q{i}:2"] for i in range(3)
            ]
        gate.set()
        busy.result(timeout=10)
        assert _driven(worker, 1) == 1
    assert [_claims(engine, f"q{i}") for i in range(3)] == [1, 1, 1]
    assert [effects[f"q{i}:0"] for i in range(3)] == [1, 1, 1]


def test_a_let_go_enqueue_is_taken_by_another_machine_at_once_not_a_lease_later(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's beat at the let-go is all another machine's worker goes by: it must
    no longer list the runs let go (in one process, the engines also see it directly)."""
    monkeypatch.setattr("loom_kernel._hosting._slots._HANDED_WAIT", 0.2)
    store = MemoryStore()
    remote = "other-host.1:4242:abcdef"  # not this process: only its beats tell
    engine = _engine(store, lease=600.0, worker_id=remote)
    with Worker(engine, concurrency=1, idle_poll=60.0):
        busy = engine.enqueue("slow", "b", key="busy")  # takes the only slot
        queued = engine.enqueue("three", "q", key="q")
        assert engine.get("q").owner == remote
        taker = _engine(store, lease=600.0)
        with caplog.at_level("DEBUG", logger="loom"), Worker(taker, idle_poll=0.02):
            assert queued.result(timeout=5) == ["q:0", "q:1", "q:2"]
        gate.set()
        busy.result(timeout=10)
    claims = [e for e in (x.event for x in engine.history("q")) if isinstance(e, ExecutionClaimed)]
    assert [claim.by for claim in claims] == [taker.worker_id], "taken while the slot was busy"
    seen = re.findall(r"busy is running on \S+ \(seen (\S+) s ago\): left to it", caplog.text)
    assert seen, "the busy run was left to its owner"
    assert all(0 <= float(ago) < 5 for ago in seen), "seen moments ago"
    assert effects["q:0"] == 1


def test_a_let_go_enqueue_is_taken_back_by_its_own_worker_once_a_slot_frees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("loom_kernel._hosting._slots._HANDED_WAIT", 0.1)
    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, concurrency=1, idle_poll=0.02) as worker:
        busy = engine.enqueue("slow", "b", key="busy")
        queued = engine.enqueue("three", "q", key="queued")
        deadline = time.monotonic() + 10
        while worker._slots._handed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not worker._slots._handed, "let go after the wait"
        gate.set()
        assert queued.result(timeout=10) == ["q:0", "q:1", "q:2"]
        busy.result(timeout=10)
    claims = [
        e for e in (x.event for x in engine.history("queued")) if isinstance(e, ExecutionClaimed)
    ]
    assert [(claim.by, claim.previous) for claim in claims] == [(engine.worker_id,) * 2]


def test_a_beat_that_fails_as_enqueues_are_let_go_is_counted_and_the_nudges_still_written(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sys

    monkeypatch.setattr("loom_kernel._hosting._slots._HANDED_WAIT", 0.1)
    store = MemoryStore()
    engine = _engine(store, lease=600.0)
    heartbeat = parts_of(engine).driver.heartbeat
    beat = heartbeat.beat

    def failing_as_it_lets_go() -> None:
        if sys._getframe(1).f_code.co_name == "let_go_handed":
            raise StoreUnavailableError("the beats cannot be written")
        beat()

    monkeypatch.setattr(heartbeat, "beat", failing_as_it_lets_go)
    with Worker(engine, concurrency=1, idle_poll=60.0) as worker:
        busy = engine.enqueue("slow", "b", key="busy")  # takes the only slot
        queued = engine.enqueue("three", "q", key="q")
        said = "a beat letting runs go: StoreUnavailableError"

        def nudged() -> bool:
            index = store.read(f"runs/open/{partition_of('q')}")
            return any(b'"nudge"' in record.payload for record in index)

        with caplog.at_level(logging.WARNING, logger="loom"):
            deadline = time.monotonic() + 10
            # Taken off the backlog first, then let go, beaten for and nudged.
            while (worker._slots._handed or not nudged()) and time.monotonic() < deadline:
                time.sleep(0.01)
        assert not worker._slots._handed, "let go after the wait"
        assert said in caplog.text
        assert worker.stats.failures == 1
        assert nudged(), "the nudge written all the same"
        gate.set()
        assert queued.result(timeout=10) == ["q:0", "q:1", "q:2"]
        busy.result(timeout=10)


def test_enqueues_past_the_workers_own_queue_start_unowned_for_any_worker() -> None:
    from loom_kernel._hosting._slots import _HANDED_PER_SLOT

    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, concurrency=1, idle_poll=60.0):
        busy = engine.enqueue("slow", "b", key="busy")
        count = _HANDED_PER_SLOT + 2
        handles = [engine.enqueue("three", f"n{i}", key=f"n{i}") for i in range(count)]
        owners = [engine.get(f"n{i}").owner for i in range(count)]
        assert owners == [engine.worker_id] * _HANDED_PER_SLOT + [None] * 2
        gate.set()
        for i, handle in enumerate(handles):
            assert handle.result(timeout=10) == [f"n{i}:0", f"n{i}:1", f"n{i}:2"]
        busy.result(timeout=10)


def test_a_stopping_worker_lets_go_the_enqueues_waiting_for_its_slots_at_once() -> None:
    store = MemoryStore()
    engine = _engine(store, lease=600.0)  # taken over at once, not a lease later
    worker = Worker(engine, concurrency=1, idle_poll=60.0, grace=5.0).start()
    busy = engine.enqueue("slow", "b", key="busy")
    queued = engine.enqueue("three", "q", key="queued")
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    time.sleep(0.1)
    gate.set()  # the busy run ends within the grace; the waiting one is not started
    stopper.join(10)
    busy.result(timeout=10)
    assert engine.get("queued").status is Status.RUNNING
    assert effects["q:0"] == 0
    with Worker(_engine(store, lease=600.0), idle_poll=0.02):
        assert queued.result(timeout=10) == ["q:0", "q:1", "q:2"]
    assert _claims(engine, "queued") == 1


def test_a_run_handed_to_a_stopping_worker_is_left_to_the_next_one() -> None:
    store = MemoryStore()
    engine = _engine(store)
    worker = Worker(engine, idle_poll=0.02).start()
    time.sleep(0.05)
    original = worker._slots.hand

    def stopping_meanwhile(execution_id: str, drive: Any, let_go: Any, flow: str) -> bool:
        worker._stopping.set()  # stop() began between the slot and the hand-over
        return original(execution_id, drive, let_go, flow)

    worker._slots.hand = stopping_meanwhile  # type: ignore[method-assign]
    handle = engine.enqueue("three", "s", key="stopped")
    worker.stop()
    assert engine.get("stopped").status is Status.RUNNING
    with Worker(_engine(store), idle_poll=0.02):  # after the stopped one's last beat
        assert handle.result(timeout=10) == ["s:0", "s:1", "s:2"]


def test_an_enqueue_that_fails_gives_its_slot_back() -> None:
    from loom_kernel import ExecutionNotFoundError

    store = MemoryStore()
    engine = _engine(store)
    store.delete("ex/gone")  # a deleted run's key can never start another
    with Worker(engine, concurrency=1, idle_poll=0.05) as worker:
        with pytest.raises(ExecutionNotFoundError):
            engine.enqueue("three", "g", key="gone")
        assert worker.stats.in_flight == 0
        assert engine.enqueue("three", "n", key="next").result(timeout=10) == ["n:0", "n:1", "n:2"]


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


def test_the_live_status_line_shows_what_the_worker_did() -> None:
    import io

    worker = Worker(_engine(MemoryStore(), worker_id="w1"), concurrency=3)
    worker.stats.driven, worker.stats.timers, worker.stats.failures = 5, 2, 1
    out = io.StringIO()
    worker._show(out)
    assert out.getvalue() == "\r" + (
        "loom worker w1: driving 0/3 · driven 5 · timers 2 · failures 1"
    ).ljust(80)


def test_run_with_a_status_stream_writes_the_live_line_and_ends_it() -> None:
    import io

    engine = _engine(MemoryStore(), worker_id="w2")
    out = io.StringIO()
    worker = Worker(engine, idle_poll=0.02)
    runner = threading.Thread(target=worker.run, kwargs={"handle_signals": False, "status": out})
    started = time.monotonic()
    runner.start()
    assert worker._ready.wait(10)
    assert engine.enqueue("three", "s").result(timeout=10) == ["s:0", "s:1", "s:2"]
    deadline = time.monotonic() + 10
    while "driven 1" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)  # the line is redrawn at most once a second
    time.sleep(0.5)  # about 25 polls more
    worker.stop()
    runner.join(10)
    text = out.getvalue()
    assert text.startswith("\rloom worker w2: driving ")
    assert "driven 1" in text
    assert text.endswith("\n"), "the line is ended when the worker stops"
    # Polled every 0.02 s, the line is drawn at most once a second, not at each poll.
    drawn = text.count("\r")
    assert drawn <= time.monotonic() - started + 2, (
        f"drawn {drawn} times in {time.monotonic() - started}"
    )


def test_terminal_status_is_stderr_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from loom_kernel._hosting._worker import terminal_status

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert terminal_status() is sys.stderr
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert terminal_status() is None


def test_a_result_with_no_timeout_sees_a_run_another_engine_finishes() -> None:
    """Nothing in this engine says when another engine ends the run: with no timeout
    the handle still looks again, at growing pauses, and returns."""
    store = MemoryStore()
    waiting = _engine(store)
    handle = waiting.enqueue("slow", "o")
    results: list[Any] = []
    waiter = threading.Thread(target=lambda: results.append(handle.result()), daemon=True)
    waiter.start()
    with Worker(_engine(store), idle_poll=0.02):
        assert at_gate.wait(10)
        gate.set()
        waiter.join(10)
    assert results == ["o:after"]


def test_a_worker_started_twice_is_refused() -> None:
    worker = Worker(_engine(MemoryStore()), idle_poll=0.02).start()
    try:
        with pytest.raises(InvalidArgumentError, match="running already"):
            worker.start()
    finally:
        worker.stop()


def test_an_enqueue_that_no_slot_takes_wakes_the_engines_workers() -> None:
    engine = _engine(MemoryStore())
    worker = Worker(engine)  # registered, but with no pool: it takes no hand-over
    parts_of(engine).enqueueing.slots.append(worker._slots)
    assert not worker._wake.is_set()
    engine.enqueue("three", "x", key="x")
    assert worker._wake.is_set(), "its next poll comes now, not after idle_poll"


def test_a_timer_a_worker_cannot_fire_counts_as_a_failure() -> None:
    from loom_kernel._coordination import TimerIndex
    from loom_kernel.spi import NewRecord
    from loom_kernel.testing import FakeClock

    store, clock = MemoryStore(), FakeClock()
    engine = _engine(store, clock=clock)
    TimerIndex(store, clock).add("someone", 0, clock() + 1)  # its minute's bucket
    (bucket,) = TimerIndex(store, clock).buckets()
    store.append(bucket, store.head(bucket), [NewRecord("loom.timer", b"{damaged", clock())])
    clock.advance(120)
    with Worker(engine, idle_poll=0.02) as worker:
        deadline = time.monotonic() + 10
        while worker.stats.failures == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.stats.failures >= 1


def test_run_puts_back_the_signal_handlers_it_replaced() -> None:
    import signal

    def mine(_number: int, _frame: Any) -> None:
        pass

    before = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, mine)
    try:
        worker = Worker(_engine(MemoryStore()), idle_poll=0.02)
        during: list[Any] = []

        def look_then_stop() -> None:
            during.append(signal.getsignal(signal.SIGTERM))
            worker.stop()

        threading.Timer(0.2, look_then_stop).start()
        worker.run(handle_signals=True)  # on the main thread: it installs its own
        assert during == [worker._on_signal]
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


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


def test_stop_returns_once_the_runs_in_flight_have_parked_or_ended() -> None:
    store = MemoryStore()
    engine = _engine(store)
    worker = Worker(engine, concurrency=1, idle_poll=0.02, grace=30.0).start()
    handle = engine.enqueue("slow", "s", key="s")
    deadline = time.monotonic() + 10
    while worker.stats.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    threading.Timer(0.2, gate.set).start()
    worker.stop()
    assert handle.get().status is Status.COMPLETED, "stop waited for the run in flight"
    assert effects["s:after"] == 1


def test_a_second_signal_stops_the_process_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import signal

    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    worker = Worker(_engine(MemoryStore()))
    worker._on_signal(signal.SIGTERM, None)
    assert worker._stopping.is_set()
    assert exits == [], "the first is a graceful stop"
    worker._on_signal(signal.SIGINT, None)
    assert exits == [128 + signal.SIGINT]


def test_a_stopping_worker_lets_its_queue_go_before_its_grace_not_after() -> None:
    store = MemoryStore()
    engine = _engine(store, lease=600.0)
    worker = Worker(engine, concurrency=1, idle_poll=60.0, grace=30.0).start()
    busy = engine.enqueue("slow", "b", key="busy")
    queued = engine.enqueue("three", "q", key="queued")
    with Worker(_engine(store, lease=600.0), idle_poll=0.02):
        stopper = threading.Thread(target=worker.stop)
        stopper.start()  # the busy run holds its slot through the grace
        assert queued.result(timeout=10) == ["q:0", "q:1", "q:2"]
        assert stopper.is_alive(), "taken over during the grace"
        gate.set()
        stopper.join(10)
    busy.result(timeout=10)


def test_an_enqueue_goes_to_a_free_slot_of_a_second_worker_before_a_queue() -> None:
    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, concurrency=1, idle_poll=60.0) as first:
        busy = engine.enqueue("slow", "b", key="busy")  # the first worker's only slot
        assert first.stats.in_flight == 1
        with Worker(engine, concurrency=1, idle_poll=60.0) as second:
            handle = engine.enqueue("three", "f", key="free")
            assert handle.result(timeout=10) == ["f:0", "f:1", "f:2"]
            assert _driven(second, 1) == 1
            assert not first._slots._handed
        gate.set()
        busy.result(timeout=10)


def test_an_interrupt_as_a_run_is_handed_over_leaves_the_worker_whole() -> None:
    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, concurrency=1, idle_poll=0.02) as worker:
        original = worker._slots.hand

        def interrupted(*args: Any) -> bool:
            raise KeyboardInterrupt  # Ctrl-C as the hand-over begins

        worker._slots.hand = interrupted  # type: ignore[method-assign,assignment]
        with pytest.raises(KeyboardInterrupt):
            engine.enqueue("three", "x", key="x")
        worker._slots.hand = original  # type: ignore[method-assign]
        assert worker.stats.in_flight == 0
        assert engine.enqueue("three", "y", key="y").result(timeout=10) == ["y:0", "y:1", "y:2"]
        assert engine.handle("x").result(timeout=10) == ["x:0", "x:1", "x:2"], "found by a poll"


def test_a_handed_run_whose_drive_cannot_begin_is_let_go_and_found_by_a_poll() -> None:
    store = MemoryStore()
    engine = _engine(store)
    original = parts_of(engine).driver.locks.hold
    holds: list[str] = []

    @contextlib.contextmanager
    def hold(key: str, *, wait: float | None = None) -> Iterator[None]:
        holds.append(key)
        if holds.count("x") == 2:  # the enqueue's hold, then the handed drive's
            raise RuntimeError("the drive could not take the run's lock")
        with original(key, wait=wait):
            yield

    parts_of(engine).driver.locks.hold = hold  # type: ignore[method-assign]
    with Worker(engine, concurrency=1, idle_poll=0.02):
        handle = engine.enqueue("three", "x", key="x")
        assert handle.result(timeout=10) == ["x:0", "x:1", "x:2"], "let go, then polled"
    assert holds.count("x") >= 3


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


def test_a_handle_wakes_when_a_drive_of_its_engine_ends_the_run_not_at_its_next_look(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("loom_kernel._engine._handles._FIRST_WAIT", 60.0)  # looks a minute apart
    store = MemoryStore()
    engine = _engine(store)
    with Worker(engine, idle_poll=0.02):
        handle = engine.enqueue("slow", "w", key="woken")
        threading.Timer(0.1, gate.set).start()
        assert handle.result(timeout=30) == "w:after"


def test_a_handle_does_not_wait_when_the_run_ended_between_its_look_and_its_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("loom_kernel._engine._handles._FIRST_WAIT", 60.0)  # looks a minute apart

    @flow(name="parks", version="1")
    def parks(ctx: Context, _input: Any) -> Any:
        return ctx.suspend("go")

    engine = Engine(MemoryStore(), [parks], listeners=[])
    engine.start("parks", key="p")
    driver = parts_of(engine).driver
    looked = driver.execution

    def look_then_finish(execution_id: str) -> Any:
        view = looked(execution_id)
        if not view.status.finished:
            engine.resume("p", "done")  # a drive of the engine ends it after the look
        return view

    waits: list[float | None] = []
    real_wait = driver._finishes.wait

    def wait(timeout: float | None = None) -> bool:
        waits.append(timeout)
        return real_wait(0)

    monkeypatch.setattr(driver, "execution", look_then_finish)
    monkeypatch.setattr(driver._finishes, "wait", wait)
    assert engine.handle("p").result(timeout=120) == "done"
    assert waits == [], "it waited for a finish that had already happened"


def test_run_on_the_main_thread_stops_gracefully_on_sigterm() -> None:
    import os
    import signal

    assert threading.current_thread() is threading.main_thread(), "pytest runs tests there"
    engine = _engine(MemoryStore())
    worker = Worker(engine, idle_poll=0.05)
    previous = signal.getsignal(signal.SIGTERM)
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    worker.run()  # the first SIGTERM stops it; the process lives on
    assert worker._stopped.is_set()
    assert signal.getsignal(signal.SIGTERM) is previous, "its handler is taken back"


def test_a_signal_stops_an_idle_worker_at_once_not_at_its_next_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import signal

    from loom_kernel._hosting import _worker

    monkeypatch.setattr(_worker, "_FASTEST_POLL", 60.0)  # every poll waits out a long pause
    worker = Worker(_engine(MemoryStore()), idle_poll=60.0).start()
    time.sleep(0.1)
    began = time.monotonic()
    worker._on_signal(signal.SIGTERM, None)
    assert worker._thread is not None
    worker._thread.join(10)
    assert not worker._thread.is_alive()
    assert time.monotonic() - began < 5, "woken by the signal, not by its next poll"


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


def test_a_start_handed_to_workers_with_no_slot_and_no_place_runs_inline() -> None:
    """A worker running, but its slot busy and its queue of handed runs full: the run
    `_start_or_hand` starts is driven inline, on the caller's thread, before it returns."""
    from loom_kernel._hosting._slots import _HANDED_PER_SLOT

    threads: dict[str, str] = {}

    @flow(name="where", version="1")
    def where(ctx: Context, tag: str) -> Any:
        return ctx.step("s", lambda: threads.setdefault(tag, threading.current_thread().name))

    store = MemoryStore()
    engine = Engine(store, [*FLOWS, where], listeners=[])
    with Worker(engine, concurrency=1, idle_poll=0.05) as worker:
        busy = engine.enqueue("slow", "busy")
        assert at_gate.wait(10)
        queued = [engine.enqueue("three", f"q{n}") for n in range(_HANDED_PER_SLOT)]
        assert len(worker._slots._handed) == _HANDED_PER_SLOT, "its queue of handed runs is full"
        handle = engine.dispatch("where", "inline", key="inline")
        assert engine.get(handle.id).status is Status.COMPLETED, "driven before returning"
        assert threads == {"inline": threading.current_thread().name}
        late = engine.enqueue("three", "late")  # no slot, no place: left to the polls
        assert not driving_here(engine.worker_id, late.id), "nothing here holds it"
        gate.set()
        assert busy.result(timeout=10) == "busy:after"
        assert all(run.result(timeout=10)[0].startswith("q") for run in queued)
        assert late.result(timeout=10) == ["late:0", "late:1", "late:2"]


def test_a_start_handed_to_no_worker_runs_inline_and_one_taken_by_a_worker_does_not() -> None:
    """`_start_or_hand`, what orchestration's start_child uses: with no worker of this
    engine running, the run is driven inline before the call returns."""
    store = MemoryStore()
    engine = _engine(store)
    handle = engine.dispatch("three", "i", key="inline")
    assert engine.get(handle.id).status is Status.COMPLETED, "driven before returning"
    with Worker(engine, idle_poll=0.05):
        handed = engine.dispatch("three", "w", key="handed")
        assert handed.result(timeout=10) == ["w:0", "w:1", "w:2"]


def test_a_worker_whose_signal_handlers_cannot_be_installed_raises_and_runs_nothing() -> None:
    worker = Worker(_engine(MemoryStore()), idle_poll=0.02)

    def refused() -> dict[int, Any]:
        raise ValueError("signal handlers refused (injected)")

    worker._install_signals = refused  # type: ignore[method-assign]
    raised: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except ValueError as exc:
            raised.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(10)
    went_on = runner.is_alive()
    if went_on:  # end the loop it should never have entered
        worker._stopping.set()
        worker._wake.set()
        runner.join(10)
    assert not went_on, "run() raised at once"
    assert [str(exc) for exc in raised] == ["signal handlers refused (injected)"]


def test_stop_returns_once_a_worker_run_in_the_foreground_has_stopped() -> None:
    """`run()` in a thread of the caller's (as `loom worker` runs it): `stop()` from
    another thread returns once the run in flight has ended within the grace and
    `run()` has returned, not at once."""
    started, ended = threading.Event(), threading.Event()

    def nap() -> str:
        started.set()
        time.sleep(0.3)
        ended.set()
        return "napped"

    @flow(name="naps_in_a_step", version="1")
    def naps(ctx: Context, _input: Any) -> Any:
        return ctx.step("nap", nap)

    engine = Engine(MemoryStore(), [naps], listeners=[])
    worker = Worker(engine, idle_poll=0.02, grace=10)
    running = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    running.start()
    try:
        handle = engine.enqueue("naps_in_a_step", None)
        assert started.wait(10)
        worker.stop()
        assert ended.is_set(), "stop waited for the run in flight"
        assert handle.get().result == "napped"
    finally:
        worker.stop()
        running.join(10)
    assert not running.is_alive()


def test_an_idle_worker_doubles_its_pause_between_polls_up_to_idle_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from loom_kernel._hosting import _worker

    monkeypatch.setattr(_worker, "_FASTEST_POLL", 0.001)
    worker = Worker(_engine(MemoryStore()), idle_poll=0.02)
    waits: list[float] = []

    class Recorded(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            assert timeout is not None
            waits.append(timeout)
            return super().wait(0)  # no real pause: the next poll comes at once

    worker._wake = Recorded()
    with worker:
        deadline = time.monotonic() + 10
        while len(waits) < 7 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert waits[:7] == pytest.approx([0.002, 0.004, 0.008, 0.016, 0.02, 0.02, 0.02])


def test_a_stop_waits_for_its_runs_in_flight_without_spinning() -> None:
    worker = Worker(_engine(MemoryStore()), concurrency=1).start()
    handle = worker.engine.enqueue("slow", "s")
    assert at_gate.wait(10)
    waits = [0]
    wake = worker._wake

    class Counted(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waits[0] += 1
            return wake.wait(timeout)

        def set(self) -> None:
            wake.set()

        def clear(self) -> None:
            wake.clear()

        def is_set(self) -> bool:
            return wake.is_set()

    worker._wake = Counted()
    threading.Timer(0.1, wake.set).start()  # a wake-up as it waits (an enqueue, say)
    threading.Timer(0.5, gate.set).start()  # the run in flight ends half a second on
    worker.stop(grace=5)
    assert handle.result(timeout=10) == "s:after"
    assert waits[0] < 100, f"{waits[0]} waits in half a second: it spun"


def test_an_enqueue_of_a_key_that_exists_gives_back_the_slot_it_reserved() -> None:
    """The slot `enqueue` reserved for a run whose key exists already (nothing to
    hand over) goes back: kept, one run of a one-slot worker would never be driven
    again."""
    engine = _engine(MemoryStore())
    with Worker(engine, concurrency=1, idle_poll=0.05) as worker:
        first = engine.enqueue("three", "a", key="k")
        assert first.result(timeout=10) == ["a:0", "a:1", "a:2"]
        deadline = time.monotonic() + 10
        while worker._slots._in_flight and time.monotonic() < deadline:
            time.sleep(0.005)  # its slot's thread is done with it
        again = engine.enqueue("three", "b", key="k")
        assert again.id == first.id
        assert worker._slots._in_flight == set(), "the slot went back"
        later = engine.enqueue("three", "c")
        assert later.result(timeout=10) == ["c:0", "c:1", "c:2"]


def test_an_enqueue_of_a_key_that_exists_with_every_slot_busy_gives_back_its_place() -> None:
    """With every slot busy, `enqueue` takes a place in the worker's queue; for a run
    whose key exists already (nothing to hand over) the place goes back: kept, the
    worker would count the run as waiting here and never look at it again."""
    engine = _engine(MemoryStore())
    with Worker(engine, concurrency=1, idle_poll=0.05) as worker:
        try:
            first = engine.enqueue("three", "a", key="k")
            assert first.result(timeout=10) == ["a:0", "a:1", "a:2"]
            busy = engine.enqueue("slow", "busy", key="busy")  # takes the only slot
            assert at_gate.wait(10)
            again = engine.enqueue("three", "b", key="k")
            assert again.id == first.id
            slots = worker._slots
            assert (slots._queued, slots._handed) == (set(), set()), "the place went back"
            assert not worker._slots.busy_with(first.id)
        finally:
            gate.set()
        busy.result(timeout=10)


def test_the_live_status_line_is_cut_at_200_characters() -> None:
    import io

    worker = Worker(_engine(MemoryStore(), worker_id="w" * 190), concurrency=3)
    out = io.StringIO()
    worker._show(out)
    assert out.getvalue() == "\r" + ("loom worker " + "w" * 190)[:200]
