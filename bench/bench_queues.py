"""Queues with limits: what a queue costs against a plain enqueue, and Loom's queue
against DBOS's at the same concurrency: ratios from one run.

Run:

    python3 -m uv run --with dbos python bench/bench_queues.py

1. A burst of RUNS runs of STEPS steps, enqueued on a queue with a concurrency cap of
   SLOTS and driven by a `Worker` of SLOTS slots, against the same burst enqueued with
   no queue (each handed to a free slot, or to the worker's own queue), on SQLite at
   synchronous=full, in alternating rounds: steps/s of the queue ÷ steps/s of the
   plain enqueue.
2. The same burst on DBOS (SQLite system database), on a `Queue` with the same
   concurrency and DBOS's queue poll at Loom's busy poll (50 ms), against Loom's queue:
   steps/s, best of REPEAT each (DBOS owns process state, so the two cannot
   alternate), printed as Loom ÷ DBOS.
"""

from __future__ import annotations

import contextlib
import io
import os
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loom_kernel import Context, Engine, Queue, Worker, flow, open_store

RUNS = 40
STEPS = 10
SLOTS = 8
ROUNDS = 9
REPEAT = 5


@flow(name="bench.steps")
def steps(ctx: Context, _input: Any) -> int:
    for index in range(STEPS):
        ctx.step(f"s{index}", lambda index=index: {"n": index, "ok": True})
    return STEPS


def _timed(burst: Callable[[], object]) -> float:
    began = time.perf_counter()
    burst()
    return time.perf_counter() - began


def _loom_burst(engine: Engine, queue: str | None) -> None:
    handles = [engine.enqueue("bench.steps", queue=queue) for _ in range(RUNS)]
    for handle in handles:
        handle.result(timeout=120)


def queue_against_plain(directory: str) -> tuple[float, float, float]:
    """Median, min and max over alternating rounds of queue steps/s ÷ plain steps/s."""
    store = open_store(f"sqlite://{directory}/plain.db")
    engine = Engine(store, [steps], listeners=[], queues=[Queue("bench", concurrency=SLOTS)])
    ratios = []
    with Worker(engine, concurrency=SLOTS):
        _loom_burst(engine, "bench")  # warm both paths
        _loom_burst(engine, None)
        for _ in range(ROUNDS):
            plain = _timed(lambda: _loom_burst(engine, None))
            queued = _timed(lambda: _loom_burst(engine, "bench"))
            ratios.append(plain / queued)
    store.close()
    return statistics.median(ratios), min(ratios), max(ratios)


def loom_queue_best(directory: str) -> float:
    """Steps/s of Loom's queue, best of REPEAT bursts."""
    store = open_store(f"sqlite://{directory}/loom-best.db")
    engine = Engine(store, [steps], listeners=[], queues=[Queue("bench", concurrency=SLOTS)])
    with Worker(engine, concurrency=SLOTS):
        _loom_burst(engine, "bench")
        best = min(_timed(lambda: _loom_burst(engine, "bench")) for _ in range(REPEAT))
    store.close()
    return RUNS * STEPS / best


def dbos_queue_best(directory: str) -> float | None:
    """Steps/s of DBOS's queue with the same concurrency, best of REPEAT bursts; None
    when DBOS is not installed (`uv run --with dbos`)."""
    try:
        from dbos import DBOS, DBOSConfig
    except ImportError:
        return None
    path = os.path.join(directory, "dbos.sqlite")
    with sqlite3.connect(path) as connection:  # WAL first, as Loom's store runs
        connection.execute("PRAGMA journal_mode=WAL")

    @DBOS.step()
    def step(index: int) -> dict[str, Any]:
        return {"n": index, "ok": True}

    @DBOS.workflow()
    def workflow() -> int:
        for index in range(STEPS):
            step(index)
        return STEPS

    config: DBOSConfig = {"name": "loom-queue-bench", "system_database_url": f"sqlite:///{path}"}
    with contextlib.redirect_stdout(io.StringIO()):
        DBOS(config=config)
        DBOS.launch()
    queue = DBOS.register_queue("bench", global_concurrency=SLOTS, polling_interval_sec=0.05)

    def burst() -> None:
        handles = [queue.enqueue(workflow) for _ in range(RUNS)]
        for handle in handles:
            handle.get_result()

    try:
        burst()
        best = min(_timed(burst) for _ in range(REPEAT))
    finally:
        DBOS.destroy()
    return RUNS * STEPS / best


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        median, low, high = queue_against_plain(directory)
        print(
            f"## Loom: a queue (cap {SLOTS}) against a plain enqueue, {RUNS} runs of {STEPS} "
            f"steps, a worker of {SLOTS} slots, SQLite synchronous=full, {ROUNDS} rounds\n"
            f"queue steps/s ÷ plain steps/s: {median:.2f} (rounds {low:.2f} to {high:.2f})"
        )
        loom = loom_queue_best(directory)
        dbos = dbos_queue_best(str(Path(directory)))
    print(f"\n## Loom's queue against DBOS's, concurrency {SLOTS}, best of {REPEAT}")
    if dbos is None:
        print("DBOS is not installed: run with `uv run --with dbos`")
        return
    print(f"Loom steps/s ÷ DBOS steps/s: {loom / dbos:.2f}")


if __name__ == "__main__":
    main()
