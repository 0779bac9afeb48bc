"""Fixtures shared by the kernel's tests: a hand-moved clock, engines on one store, the two
loops an async flow may run on, and the worker and queue helpers' state made fresh."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from loom_kernel import Engine, Flow, MemoryStore, RetryPolicy
from loom_kernel._replay import FLOW_LOOP, LoopThread
from loom_kernel.spi import JournalStore
from loom_kernel.testing import FakeClock, sandbox

# The helper modules beside this file (worker_helpers, counter_flow, ...) are imported by
# their bare names, as mypy reads them: under --import-mode=importlib pytest puts no
# test folder on sys.path itself.
sys.path.append(str(Path(__file__).parent))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store() -> JournalStore:
    return MemoryStore()


@pytest.fixture
def make_engine(store: JournalStore, clock: FakeClock) -> Callable[..., Engine]:
    """Engines over the shared store and clock; each call gives a fresh engine (a new process)."""

    def make(flows: Iterable[Flow | Callable[..., Any]], **options: Any) -> Engine:
        options.setdefault("retry", RetryPolicy(attempts=1))
        return sandbox(*flows, store=store, clock=clock, **options).engine

    return make


@pytest.fixture(params=["a loop per drive", "one loop of another thread"])
def flow_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Async flows run on a loop of their drive's own, or (as under a worker or the
    async API) on one loop of another thread, the drive's thread serving their calls."""
    if request.param == "a loop per drive":
        yield
        return
    flows = LoopThread("test-flows", 64)
    token = FLOW_LOOP.set(flows.loop)
    try:
        yield
    finally:
        FLOW_LOOP.reset(token)
        flows.close()
        flows.join_threads(10)


@pytest.fixture
def fresh_effects() -> None:
    """worker_helpers' effects forgotten and its gate closed, for a worker test."""
    from worker_helpers import reset_effects

    reset_effects()


@pytest.fixture
def fresh_counts() -> None:
    """queue_helpers' counts of runs in their step, and their order, forgotten."""
    from queue_helpers import reset_counts

    reset_counts()
