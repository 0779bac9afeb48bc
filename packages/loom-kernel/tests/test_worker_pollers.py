"""A worker's pollers (the `loom.pollers` group): each is made once with the worker's
engine and called on its polls; the worker wakes when one says it has work, however
long its idle pace; one that raises is counted and logged, and polled again."""

from __future__ import annotations

import threading
import time

import pytest
from loom_kernel import Engine, MemoryStore, Worker


class Ticker:
    """A poller that has work every `every` seconds, and notes when it was called."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.made_with: list[Engine] = []
        self.calls: list[float] = []
        self.called = threading.Event()

    def factory(self, engine: Engine) -> Ticker:
        self.made_with.append(engine)
        return self

    def __call__(self) -> float | None:
        self.calls.append(time.monotonic())
        if len(self.calls) >= 6:
            self.called.set()
        return self.every


def test_a_poller_that_says_when_it_has_work_wakes_an_idle_worker() -> None:
    engine = Engine(MemoryStore(), [], listeners=[])
    ticker = Ticker(0.05)
    began = time.monotonic()
    with Worker(engine, idle_poll=30.0, pollers=[ticker.factory]):
        assert ticker.called.wait(10), "six polls though the idle pace is 30 s"
    assert ticker.made_with == [engine], "made once, with the worker's engine"
    assert ticker.calls[5] - began < 10


def test_a_poller_that_raises_is_counted_and_polled_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []
    again = threading.Event()

    def failing(_engine: Engine) -> object:
        def poll() -> float | None:
            calls.append(1)
            if len(calls) >= 3:
                again.set()
            raise RuntimeError("the poller broke")

        return poll

    engine = Engine(MemoryStore(), [], listeners=[])
    worker = Worker(engine, idle_poll=0.05, pollers=[failing])  # type: ignore[list-item]
    with caplog.at_level("WARNING", logger="loom"), worker:
        assert again.wait(10), "polled again after each failure"
    assert worker.stats.failures >= 3
    assert "a poller failed: RuntimeError: the poller broke" in caplog.text


def test_a_poller_is_called_at_every_poll_whatever_it_said() -> None:
    """What it says only wakes the worker: a poller with work an hour away still
    looks at every poll (a schedule created elsewhere is seen at the next one)."""
    engine = Engine(MemoryStore(), [], listeners=[])
    hourly = Ticker(3600.0)
    with Worker(engine, idle_poll=0.05, pollers=[hourly.factory]):
        assert hourly.called.wait(10), "six calls in well under an hour"
