"""What the queue tests share: `busy`, a flow that counts how many runs are in their
step at once (per key, and `*` for all) and notes the order they ran in; flows that
park, listen and sleep; two versions of one job; engines with queues; a worker's queue
serving driven by hand; and a wait for a condition."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from loom_kernel import Context, Engine, MemoryStore, Queue, flow
from loom_kernel._engine import parts_of
from loom_kernel._hosting._queue_serving import QueueServing
from loom_kernel._hosting._slots import Slots, WorkerStats

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


def reset_counts() -> None:
    """Forget the runs counted and their order in the test before."""
    _running.clear()
    _peaks.clear()
    _order.clear()
