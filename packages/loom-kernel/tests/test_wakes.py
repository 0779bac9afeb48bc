"""Wake-ups from a store that pushes changes (`SupportsWakeups`): the streams whose
appends have work for a worker start with `WAKE_PREFIXES`, and a worker subscribes
while it runs, polls when woken, and lets go when it stops."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from loom_kernel import Context, Engine, MemoryStore, Queue, Worker, flow
from loom_kernel.spi import WAKE_PREFIXES, NewRecord, SupportsWakeups


class WakingStore(MemoryStore):
    """A memory store that notes every stream appended to and offers wake-ups."""

    def __init__(self) -> None:
        super().__init__()
        self.appended: list[str] = []
        self.subscribers: list[Callable[[], None]] = []

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        self.appended.append(stream)
        return super()._append(stream, expected, records)

    def subscribe_wakes(self, wake: Callable[[], None]) -> Callable[[], None]:
        self.subscribers.append(wake)
        return lambda: self.subscribers.remove(wake)

    def woken(self, action: Callable[[], object]) -> list[str]:
        """The streams under a wake prefix that `action` appended to."""
        self.appended.clear()
        action()
        return [stream for stream in self.appended if stream.startswith(WAKE_PREFIXES)]


@flow(name="wakes.receives")
def receives(ctx: Context, _input: Any) -> Any:
    return ctx.receive("word")


@flow(name="wakes.sleeps")
def sleeps(ctx: Context, _input: Any) -> Any:
    ctx.sleep(3600)
    return "rested"


def test_work_for_a_worker_is_written_under_a_wake_prefix() -> None:
    store = WakingStore()
    assert isinstance(store, SupportsWakeups)
    engine = Engine(store, [receives, sleeps], listeners=[], queues=[Queue("q")])
    assert store.woken(lambda: engine.enqueue("wakes.receives", None, key="r")), "a start"
    assert store.woken(lambda: engine.enqueue("wakes.receives", None, queue="q")), "a queue"
    assert store.woken(lambda: engine.start("wakes.sleeps", None, key="s")), "a timer"
    engine.recover()  # "r" parks at its receive
    assert store.woken(lambda: engine.send("r", "hi", topic="word", drive=False)), "a message"


def test_a_worker_polls_when_woken_and_lets_go_when_it_stops() -> None:
    store = WakingStore()
    polls: list[float] = []
    polled = threading.Event()

    def poller(_engine: Engine) -> Callable[[], None]:
        def poll() -> None:
            polls.append(time.monotonic())
            polled.set()

        return poll

    worker = Worker(Engine(store, [], listeners=[]), idle_poll=60.0, pollers=[poller])
    with worker:
        assert len(store.subscribers) == 1
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the worker idles 1.6 s between polls
            polled.clear()
            assert polled.wait(30)
            if len(polls) >= 2 and polls[-1] - polls[-2] >= 1.6:
                break
        last, pause = polls[-1], polls[-1] - polls[-2]
        polled.clear()
        store.subscribers[0]()
        assert polled.wait(pause)
        assert polls[-1] - last < pause / 2, "polled at its pace, not when woken"
    assert store.subscribers == []


def test_a_store_whose_wake_ups_fail_is_polled_and_the_worker_stops_cleanly(
    caplog: Any,
) -> None:
    """A subscription the store refuses: said once, the worker polls instead, drives
    the work and stops cleanly (nothing to let go of)."""

    class RefusesWakes(WakingStore):
        def subscribe_wakes(self, wake: Callable[[], None]) -> Callable[[], None]:
            raise ConnectionError("no listener today")

    errors: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value or Exception())
    try:
        engine = Engine(RefusesWakes(), [receives, sleeps], listeners=[])
        with caplog.at_level("WARNING", logger="loom"):
            worker = Worker(engine, idle_poll=0.02)
            with worker:
                handle = engine.enqueue("wakes.receives", None, key="r")
                deadline = time.monotonic() + 10
                while engine.get("r").waiting_on is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert engine.get("r").waiting_on is not None, "driven to its receive"
    finally:
        threading.excepthook = previous
    assert handle.id == "r"
    assert errors == []
    assert "no wake-ups from the store (no listener today); polling only" in caplog.text
