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
   alternate), printed as Loom ÷ DBOS, at each concurrency of `--levels` (default
   SLOTS; the issue's levels: `--levels 1 4 16 64`), a burst of at least RUNS runs
   and of two runs per slot.
3. Workers that share a queue: JOBS runs of one step that waits SLEEP s, started by
   name from a process with no flow code, driven by one worker of PER_WORKER slots,
   then by two such workers (in alternating rounds): the two's wall time ÷ the one's
   (about 0.5 when the runs spread); and with a cap of one worker's slots, the share
   of the runs the second worker drove (about 0.5).
4. A rate: RATED runs on a queue with `Rate(RATE_LIMIT, per=RATE_PER)` and a worker
   with slots to spare: the wall time ÷ the time the rate allows (about 1).
"""

from __future__ import annotations

import argparse
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

from loom_kernel import Context, Engine, Queue, Rate, Worker, flow, open_store

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


def _runs(slots: int) -> int:
    """The runs of a burst at a concurrency of `slots`."""
    return max(RUNS, 2 * slots)


def _loom_burst(engine: Engine, queue: str | None, runs: int = RUNS) -> None:
    handles = [engine.enqueue("bench.steps", queue=queue) for _ in range(runs)]
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


def loom_queue_best(directory: str, slots: int = SLOTS) -> float:
    """Steps/s of Loom's queue (a cap of `slots`, a worker of as many), best of REPEAT
    bursts."""
    runs = _runs(slots)
    store = open_store(f"sqlite://{directory}/loom-best-{slots}.db")
    engine = Engine(store, [steps], listeners=[], queues=[Queue("bench", concurrency=slots)])
    with Worker(engine, concurrency=slots):
        _loom_burst(engine, "bench", runs)
        best = min(_timed(lambda: _loom_burst(engine, "bench", runs)) for _ in range(REPEAT))
    store.close()
    return runs * STEPS / best


def dbos_queue_best(directory: str, slots: int = SLOTS) -> float | None:
    """Steps/s of DBOS's queue with the same concurrency, best of REPEAT bursts; None
    when DBOS is not installed (`uv run --with dbos`)."""
    try:
        from dbos import DBOS, DBOSConfig
    except ImportError:
        return None
    runs = _runs(slots)
    path = os.path.join(directory, f"dbos-{slots}.sqlite")
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

    config: DBOSConfig = {
        "name": "loom-queue-bench",
        "system_database_url": f"sqlite:///{path}",
        "log_level": "WARNING",
    }
    with contextlib.redirect_stdout(io.StringIO()):
        DBOS(config=config)
        DBOS.launch()
    queue = DBOS.register_queue("bench", global_concurrency=slots, polling_interval_sec=0.05)

    def burst() -> None:
        handles = [queue.enqueue(workflow) for _ in range(runs)]
        for handle in handles:
            handle.get_result()

    try:
        burst()
        best = min(_timed(burst) for _ in range(REPEAT))
    finally:
        DBOS.destroy()
    return runs * STEPS / best


JOBS = 32
SLEEP = 0.1
PER_WORKER = 4
RATED = 40
RATE_LIMIT = 8
RATE_PER = 0.5


def _sleep() -> str:
    time.sleep(SLEEP)
    return "done"


@flow(name="bench.sleeps")
def sleeps(ctx: Context, _input: Any) -> str:
    return str(ctx.step("wait", _sleep))


def _shared_burst(directory: str, name: str, workers: int, cap: int) -> tuple[float, float]:
    """JOBS runs started by name from an engine with no code, on a queue capped at
    `cap`, driven by `workers` workers of PER_WORKER slots: (wall time, the share of
    the runs the last worker drove)."""
    store = open_store(f"sqlite://{directory}/{name}.db")
    queue = Queue("shared", concurrency=cap)
    web = Engine(store, [], listeners=[], queues=[queue])
    engines = [
        Engine(store, [sleeps], listeners=[], queues=[queue], worker_id=f"{name}-w{n}")
        for n in range(workers)
    ]
    running = [Worker(e, concurrency=PER_WORKER, idle_poll=0.05).start() for e in engines]
    try:
        began = time.perf_counter()
        handles = [web.enqueue("bench.sleeps", queue="shared") for _ in range(JOBS)]
        for handle in handles:
            handle.result(timeout=120)
        elapsed = time.perf_counter() - began
    finally:
        for worker in running:
            worker.stop()
    store.close()
    return elapsed, running[-1].stats.driven / JOBS


def workers_share(directory: str) -> tuple[float, float, float, float]:
    """(two workers' time ÷ one's: median, min, max over alternating rounds; the
    second worker's share of the runs with a cap of one worker's slots)."""
    ratios = []
    for number in range(3):
        one, _ = _shared_burst(directory, f"one-{number}", 1, 2 * PER_WORKER)
        two, _ = _shared_burst(directory, f"two-{number}", 2, 2 * PER_WORKER)
        ratios.append(two / one)
    _, share = _shared_burst(directory, "capped", 2, PER_WORKER)
    return statistics.median(ratios), min(ratios), max(ratios), share


def rate_against_ideal(directory: str) -> float:
    """Wall time of RATED runs at Rate(RATE_LIMIT, per=RATE_PER) ÷ what the rate allows."""
    store = open_store(f"sqlite://{directory}/rated.db")
    queue = Queue("rated", rate=Rate(RATE_LIMIT, per=RATE_PER))
    engine = Engine(store, [sleeps], listeners=[], queues=[queue])
    with Worker(engine, concurrency=2 * RATE_LIMIT, idle_poll=1.0):
        began = time.perf_counter()
        handles = [engine.enqueue("bench.sleeps", queue="rated") for _ in range(RATED)]
        for handle in handles:
            handle.result(timeout=120)
        elapsed = time.perf_counter() - began
    store.close()
    allowed = (RATED // RATE_LIMIT - 1) * RATE_PER + SLEEP  # the last window, then a run
    return elapsed / allowed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--levels", type=int, nargs="+", default=[SLOTS], help="concurrencies to set against DBOS"
    )
    parser.add_argument(
        "--only-sharing", action="store_true", help="only the workers' sharing and the rate"
    )
    args = parser.parse_args()
    levels = args.levels
    with tempfile.TemporaryDirectory() as directory:
        median, low, high, share = workers_share(directory)
        print(
            f"## Workers sharing a queue: {JOBS} runs of a {SLEEP} s step, workers of "
            f"{PER_WORKER} slots, started by name from a process with no flow code\n"
            f"two workers' wall time ÷ one's (cap {2 * PER_WORKER}): {median:.2f} (rounds "
            f"{low:.2f} to {high:.2f}; 0.5 is an even spread)\n"
            f"the second worker's share of the runs (cap {PER_WORKER}, one worker's slots): "
            f"{share:.2f} (0.5 is an even spread)"
        )
        print(
            f"\n## A rate: {RATED} runs at Rate({RATE_LIMIT}, per={RATE_PER}), a worker of "
            f"{2 * RATE_LIMIT} slots\nwall time ÷ what the rate allows: "
            f"{rate_against_ideal(directory):.2f}"
        )
        if args.only_sharing:
            return
        print()
        median, low, high = queue_against_plain(directory)
        print(
            f"## Loom: a queue (cap {SLOTS}) against a plain enqueue, {RUNS} runs of {STEPS} "
            f"steps, a worker of {SLOTS} slots, SQLite synchronous=full, {ROUNDS} rounds\n"
            f"queue steps/s ÷ plain steps/s: {median:.2f} (rounds {low:.2f} to {high:.2f})"
        )
        print(f"\n## Loom's queue against DBOS's, best of {REPEAT} bursts each")
        print("| concurrency | runs | Loom steps/s ÷ DBOS steps/s |\n| --- | --- | --- |")
        for slots in levels:
            loom = loom_queue_best(directory, slots)
            dbos = dbos_queue_best(str(Path(directory)), slots)
            if dbos is None:
                print("DBOS is not installed: run with `uv run --with dbos`")
                return
            print(f"| {slots} | {_runs(slots)} | {loom / dbos:.2f} |", flush=True)


if __name__ == "__main__":
    main()
