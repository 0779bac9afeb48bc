"""The worker itself: its arguments, its polls firing due timers, many runs across two
workers each step once, its live status line, and how it stops: within its grace, at
a signal (a second one ends the process), putting back the signal handlers it replaced."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from loom_kernel import (
    Context,
    Engine,
    InvalidArgumentError,
    MemoryStore,
    Queue,
    Status,
    Worker,
    flow,
)
from loom_kernel._engine import parts_of
from loom_kernel.events import ExecutionClaimed
from worker_helpers import _driven, _engine, at_gate, effects, gate

pytestmark = pytest.mark.usefixtures("fresh_effects")


def test_bad_arguments_are_refused() -> None:
    engine = _engine(MemoryStore())
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="concurrency"):
            Worker(engine, concurrency=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="idle_poll"):
        Worker(engine, idle_poll=float("nan"))
    for bad_grace in (-0.5, float("nan"), float("inf"), None, "5"):
        with pytest.raises(InvalidArgumentError, match="grace is a number of seconds >= 0"):
            Worker(engine, grace=bad_grace)  # type: ignore[arg-type]
    Worker(engine, grace=0)  # no grace: a stop releases its drives at once
    with pytest.raises(InvalidArgumentError, match="timeout"):
        engine.enqueue("three", "x").result(timeout=-1)


def test_an_idle_poll_of_nothing_is_refused_and_a_tiny_one_does_not_spin(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`idle_poll=0` made the poll loop wait for nothing: a core spun while idle."""
    from loom_kernel._hosting._cli import main

    engine = _engine(MemoryStore())
    for nothing in (0, 0.0, -1):
        with pytest.raises(InvalidArgumentError, match="idle_poll is a number of seconds above 0"):
            Worker(engine, idle_poll=nothing)
    with pytest.raises(SystemExit):
        main(["worker", "--store", "memory://", "--flows", "m:F", "--idle-poll", "0"])
    assert "--idle-poll is a number of seconds above 0" in capsys.readouterr().err

    class CountsPolls(MemoryStore):
        polls = 0

        def _head(self, stream: str) -> int:
            if stream == "runs/open/0":
                CountsPolls.polls += 1
            return super()._head(stream)

    tiny = Worker(_engine(CountsPolls()), idle_poll=1e-9)
    with tiny:
        time.sleep(0.5)
    assert CountsPolls.polls < 200, f"{CountsPolls.polls} polls in half a second: it spun"


def test_a_worker_started_twice_is_refused() -> None:
    worker = Worker(_engine(MemoryStore()), idle_poll=0.02).start()
    try:
        with pytest.raises(InvalidArgumentError, match="running already"):
            worker.start()
    finally:
        worker.stop()


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


def test_an_idle_worker_doubles_its_pause_between_polls_up_to_idle_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from loom_kernel._hosting import _worker

    monkeypatch.setattr(_worker, "_FASTEST_POLL", 0.001)
    monkeypatch.setattr(_worker, "_SHORTEST_POLL", 0.001)
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


# -- the live status line --------------------------------------------------------------


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


def test_the_live_status_line_is_cut_at_200_characters() -> None:
    import io

    worker = Worker(_engine(MemoryStore(), worker_id="w" * 190), concurrency=3)
    out = io.StringIO()
    worker._show(out)
    assert out.getvalue() == "\r" + ("loom worker " + "w" * 190)[:200]


# -- stopping --------------------------------------------------------------------------


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


def test_a_poll_that_meets_a_store_fault_is_counted_and_the_worker_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One transient fault reading the overdue timer bucket escaped the timer poll and
    ended the worker's thread: the process lived on, and nothing drove its runs."""
    from loom_kernel import StoreUnavailableError

    blips = [1]

    class Blips(MemoryStore):
        def _read(self, stream: str, after: int, limit: int | None) -> Any:
            if stream == "timers/-overdue" and blips[0]:
                blips[0] -= 1
                raise StoreUnavailableError("one blip")
            return super()._read(stream, after, limit)

    engine = _engine(Blips())
    with caplog.at_level("WARNING", logger="loom"), Worker(engine, idle_poll=0.02) as worker:
        deadline = time.monotonic() + 10
        while blips != [0] and time.monotonic() < deadline:
            time.sleep(0.01)
        handle = engine.enqueue("three", "after the blip")
        assert handle.wait(timeout=10).status is Status.COMPLETED
        assert worker._thread is not None
        assert worker._thread.is_alive()
    assert blips == [0]
    assert worker.stats.failures >= 1
    assert "timer buckets: StoreUnavailableError: one blip" in caplog.text


@flow(name="awaits_child", version="1")
def awaits_child(ctx: Context, _input: Any) -> Any:
    return ctx.suspend("child")


@flow(name="child_work", version="1")
def child_work(ctx: Context, _input: Any) -> Any:
    return ctx.step("work", lambda: "done")


def test_a_parent_a_listener_resumed_in_a_slot_counts_as_driven() -> None:
    """An escalation drove a parent from a listener and `driven` stayed 0: each drive
    a slot makes counts, the ones its listeners make included."""

    def resume_parent(engine: Engine, execution: Any) -> None:
        if execution.flow == "child_work" and execution.status is Status.COMPLETED:
            engine.resume("the-parent", execution.result)

    engine = Engine(MemoryStore(), [awaits_child, child_work], listeners=[resume_parent])
    assert engine.start("awaits_child", key="the-parent").status is Status.SUSPENDED
    with Worker(engine, idle_poll=0.02) as worker:
        engine.enqueue("child_work", key="the-child").result(timeout=10)
        assert engine.handle("the-parent").result(timeout=10) == "done"
        assert _driven(worker, 2) == 2, "the child and the parent its listener resumed"
    assert (worker.stats.driving, worker.stats.failures) == (0, 0)


release_blocked = threading.Event()


@flow(name="blocks", version="1")
def blocks(ctx: Context, _input: Any) -> Any:
    return ctx.step("wait", lambda: release_blocked.wait(10))


def test_driving_counts_drives_within_the_queue_cap_not_busy_slots() -> None:
    """The status line said `driving 7/8` on a queue capped at 6: slots busy with a
    poll or a visit are not runs being driven."""
    release_blocked.clear()
    engine = Engine(MemoryStore(), [blocks], listeners=[], queues=[Queue("q", concurrency=6)])
    handles = [engine.enqueue("blocks", queue="q") for _ in range(10)]
    most = 0
    with Worker(engine, concurrency=8, idle_poll=0.01) as worker:
        deadline = time.monotonic() + 10
        while worker.stats.driving < 6 and time.monotonic() < deadline:
            time.sleep(0.005)
        for _ in range(100):  # a while at the cap: never more than it
            most = max(most, worker.stats.driving)
            time.sleep(0.002)
        release_blocked.set()
        assert all(handle.result(timeout=10) is True for handle in handles)
        assert _driven(worker, 10) == 10
    assert most == 6
    assert worker.stats.driving == 0


def test_a_poll_that_fails_is_logged_counted_once_and_the_worker_polls_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = _engine(MemoryStore())
    worker = Worker(engine, idle_poll=0.02)
    poll = worker._pollers.poll
    calls: list[int] = []

    def fails_once() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a poller's bug")
        return poll()

    worker._pollers.poll = fails_once  # type: ignore[method-assign]
    with caplog.at_level("ERROR", logger="loom"), worker:
        deadline = time.monotonic() + 10
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(calls) >= 3, "it polled on"
    assert worker.stats.failures == 1
    said = [r for r in caplog.records if r.getMessage().startswith("loom: a poll of worker ")]
    assert len(said) == 1, caplog.text
    assert said[0].exc_info is not None
