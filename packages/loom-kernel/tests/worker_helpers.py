"""What the worker tests share: flows that count their steps' effects (`three`; `slow`,
whose first step waits at `gate`; one that fails; one that sleeps), engines of them,
and waits for a worker's counts to catch up with what a handle saw."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from loom_kernel import Context, Engine, MemoryStore, Worker, flow
from loom_kernel.events import ExecutionClaimed

effects: Counter[str] = Counter()
effects_lock = threading.Lock()


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


def _claims(engine: Engine, execution_id: str) -> int:
    events = (entry.event for entry in engine.history(execution_id))
    return sum(isinstance(event, ExecutionClaimed) for event in events)


def reset_effects() -> None:
    """Forget the effects of the test before, and close the gate."""
    effects.clear()
    gate.clear()
    at_gate.clear()
