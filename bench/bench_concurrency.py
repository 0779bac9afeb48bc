"""Many runs at once on one SQLite file: Loom's steps/s against one raw writer.

Run:

    python3 -m uv run python bench/bench_concurrency.py [--levels 1 4 16 64]

N threads of one process each start workflows of 10 steps on one engine, on one
database file (WAL), at synchronous=FULL and at NORMAL. Against it, in alternating
rounds: one raw sqlite3 writer committing one row per transaction (the same bytes as
a step's record), the most one writer that syncs per commit can do. Printed: Loom's
steps/s as a multiple of the raw writer's commits/s (median and range over the
rounds), and the p50 and p99 time per step (a workflow's time over its 10 steps), from
the same run (a workflow: its start, 10 steps, its end, and its two run index
records). Group commit is what lets Loom pass 1x: appends of threads that wait on
one sync share the next one.

With `--sync-delay-ms N` the whole run (Loom and the raw writer alike) goes on a
simulated disk whose every sync takes N ms longer (bench/slow_sync.c, compiled with
the machine's `cc` and loaded with LD_PRELOAD; Linux): a disk that acknowledges a sync
from its cache, as a VM's often does, makes a sync too cheap to show what group
commit saves, and this shows it. The table says when it is simulated.

With `--async-levels`: N tasks on one event loop each `await engine.start_async` of
an async workflow of 10 steps (each an `async def`): the flows' code runs on the
caller's loop, and each drive's thread (one of Loom's own per call) makes its
journal writes, so N runs' appends still share group commits. Printed as above.

Then async starts at once: N `start_async` calls from tasks of one loop (its default
executor as asyncio makes it), of an async flow whose one step awaits CHILD_SECONDS
of I/O, against the same through `asyncio.to_thread(engine.start)`: wall time ÷ that
wait (each drive has a thread of Loom's own; the default executor's few threads run
a few drives at a time).

Then a worker's async runs (`--worker-async`): N async runs enqueued at once to a
`Worker` of N slots, each awaiting WORKER_WAIT seconds of I/O: wall time ÷ that
wait, and the most threads of the worker's pool alive at once ÷ N (a slot is a task of
the worker's loop for an async flow: a thread is held only while a journal write or a
sync step is made, not while the code awaits).

Then the fan-out: a parent that awaits N children (`await_children`), each a step
that takes CHILD_SECONDS, driven by a `Worker` of N + 1 slots on the parent's engine
(children take its slots side by side) and inline with no worker (one after
another): wall time as a multiple of one child's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from loom_kernel import AsyncContext, Context, Engine, Worker, flow, open_store
from loom_orchestration import await_children

STEPS = 10
ROUNDS = 5
CHILD_SECONDS = 0.2
WORKER_WAIT = 2.0  # long enough for every run to be awaiting at once
PAYLOAD = b'{"v":"1.16.0","d":{"index":1,"name":"step","result":{"n":1,"ok":true}}}'


@flow(name="bench.ten_steps", version="1")
def ten_steps(ctx: Context, _input: Any) -> int:
    for index in range(STEPS):
        ctx.step(f"step-{index}", lambda i=index: {"n": i, "ok": True})
    return STEPS


async def _step_result(index: int) -> dict[str, Any]:
    return {"n": index, "ok": True}


@flow(name="bench.ten_steps_async", version="1")
async def ten_steps_async(ctx: AsyncContext, _input: Any) -> int:
    for index in range(STEPS):
        await ctx.step(f"step-{index}", _step_result, index)
    return STEPS


class RawWriter:
    """One sqlite3 connection, one INSERT per BEGIN IMMEDIATE ... COMMIT."""

    def __init__(self, path: Path, synchronous: str) -> None:
        import sqlite3

        self.connection = sqlite3.connect(path, isolation_level=None)
        self.connection.execute("PRAGMA journal_mode=WAL")
        self.connection.execute(f"PRAGMA synchronous={synchronous}")
        self.connection.execute(
            "CREATE TABLE IF NOT EXISTS events "
            "(stream TEXT, position INTEGER, payload BLOB, PRIMARY KEY (stream, position))"
        )
        self.position = 0

    def commits_per_second(self, seconds: float) -> float:
        began = time.perf_counter()
        count = 0
        while time.perf_counter() - began < seconds:
            self.position += 1
            self.connection.execute("BEGIN IMMEDIATE")
            self.connection.execute(
                "INSERT INTO events VALUES ('s', ?, ?)", (self.position, PAYLOAD)
            )
            self.connection.execute("COMMIT")
            count += 1
        return count / (time.perf_counter() - began)


def _loom_round(engine: Engine, threads: int, seconds: float) -> tuple[float, list[float]]:
    """Steps/s of `threads` threads starting workflows for `seconds`, and each
    workflow's time per step."""
    stop = time.perf_counter() + seconds
    per_step: list[float] = []
    lock = threading.Lock()
    done = [0]

    def run() -> None:
        mine: list[float] = []
        while time.perf_counter() < stop:
            began = time.perf_counter()
            engine.start("bench.ten_steps")
            mine.append((time.perf_counter() - began) / STEPS)
        with lock:
            per_step.extend(mine)
            done[0] += len(mine)

    began = time.perf_counter()
    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - began
    return done[0] * STEPS / elapsed, per_step


def _async_round(engine: Engine, runs: int, seconds: float) -> tuple[float, list[float]]:
    """As `_loom_round`, with `runs` tasks of one event loop calling `start_async`."""
    per_step: list[float] = []

    async def run(stop: float) -> None:
        while time.perf_counter() < stop:
            began = time.perf_counter()
            await engine.start_async("bench.ten_steps_async")
            per_step.append((time.perf_counter() - began) / STEPS)

    async def main() -> float:
        began = time.perf_counter()
        await asyncio.gather(*(run(began + seconds) for _ in range(runs)))
        return time.perf_counter() - began

    elapsed = asyncio.run(main())
    return len(per_step) * STEPS / elapsed, per_step


def _work() -> str:
    time.sleep(CHILD_SECONDS)
    return "done"


@flow(name="bench.child", version="1")
def child(ctx: Context, _input: Any) -> str:
    return str(ctx.step("work", _work))


@flow(name="bench.fan_out", version="1")
def fan_out(ctx: Context, count: int) -> int:
    return len(await_children(ctx, [(child, n) for n in range(count)]))


def _fan_out(directory: Path, count: int) -> str:
    store = open_store(f"sqlite://{directory / f'fan-{count}.db'}")
    engine = Engine(store, [child, fan_out])
    began = time.perf_counter()
    engine.start("bench.fan_out", count)  # no worker: every child inline, in turn
    inline = time.perf_counter() - began
    with Worker(engine, concurrency=count + 1, idle_poll=0.05):
        began = time.perf_counter()
        engine.enqueue("bench.fan_out", count).result(timeout=600)
        worker = time.perf_counter() - began
    store.close()
    return f"| {count} | {worker / CHILD_SECONDS:.2f}x | {inline / CHILD_SECONDS:.2f}x |"


async def _io_wait() -> str:
    await asyncio.sleep(CHILD_SECONDS)
    return "done"


@flow(name="bench.awaits_io", version="1")
async def awaits_io(ctx: AsyncContext, _input: Any) -> str:
    return str(await ctx.step("io", _io_wait))


def _async_starts(directory: Path, count: int) -> str:
    """`count` async starts at once from one loop (its default executor as asyncio
    makes it), of a flow whose step awaits CHILD_SECONDS of I/O: wall time ÷ one
    run's, through `start_async` and through `asyncio.to_thread(engine.start)`."""
    store = open_store(f"sqlite://{directory / f'starts-{count}.db'}")
    engine = Engine(store, [awaits_io], listeners=[])

    async def wall(start: Callable[[], Awaitable[Any]]) -> float:
        began = time.perf_counter()
        await asyncio.gather(*(start() for _ in range(count)))
        return time.perf_counter() - began

    def through_start_async() -> Awaitable[Any]:
        return engine.start_async("bench.awaits_io")

    def through_to_thread() -> Awaitable[Any]:
        return asyncio.to_thread(engine.start, "bench.awaits_io")

    own = asyncio.run(wall(through_start_async))
    shared = asyncio.run(wall(through_to_thread))
    store.close()
    return f"| {count} | {own / CHILD_SECONDS:.2f}x | {shared / CHILD_SECONDS:.2f}x |"


@flow(name="bench.awaits_long", version="1")
async def awaits_long(ctx: AsyncContext, _input: Any) -> str:
    await ctx.step("before", _step_result, 0)
    await asyncio.sleep(WORKER_WAIT)
    return str(await ctx.step("after", _step_result, 1))


def _worker_async(directory: Path, count: int) -> str:
    """`count` async runs enqueued at once to a worker of `count` slots, each a step,
    WORKER_WAIT seconds awaited, a step: wall time ÷ that wait, and the pool's
    threads at the most ÷ `count`."""
    store = open_store(f"sqlite://{directory / f'worker-async-{count}.db'}")
    engine = Engine(store, [awaits_long], listeners=[])
    most = 0
    with Worker(engine, concurrency=count, idle_poll=0.05):
        began = time.perf_counter()
        handles = [engine.enqueue("bench.awaits_long") for _ in range(count)]
        while not all(handle.get().status.finished for handle in handles):
            pool = sum(t.name.startswith("loom-drive") for t in threading.enumerate())
            most = max(most, pool)
            time.sleep(0.01)
        wall = time.perf_counter() - began
    store.close()
    return f"| {count} | {wall / WORKER_WAIT:.2f}x | {most / count:.2f} |"


def _level(
    directory: Path, synchronous: str, threads: int, seconds: float, *, on_a_loop: bool = False
) -> str:
    name = f"{'async-' if on_a_loop else ''}{synchronous}-{threads}"
    store = open_store(f"sqlite://{directory / f'loom-{name}.db'}?synchronous={synchronous}")
    engine = Engine(store, [ten_steps, ten_steps_async], listeners=[])
    raw = RawWriter(directory / f"raw-{name}.db", synchronous)
    ratios: list[float] = []
    latencies: list[float] = []
    one_round = _async_round if on_a_loop else _loom_round
    for _ in range(ROUNDS):
        steps, per_step = one_round(engine, threads, seconds)
        commits = raw.commits_per_second(seconds)
        ratios.append(steps / commits)
        latencies.extend(per_step)
    store.close()
    latencies.sort()
    p50 = latencies[len(latencies) // 2] * 1000
    p99 = latencies[min(len(latencies) - 1, len(latencies) * 99 // 100)] * 1000
    return (
        f"| {synchronous} | {threads} | {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f}) | {p50:.2f} ms | {p99:.2f} ms |"
    )


_SHIM = Path(__file__).with_name("slow_sync.c")


def _on_slow_disk(delay_ms: float) -> None:
    """Run this benchmark again with every sync delayed by `delay_ms` (see the module)."""
    if os.environ.get("SLOW_SYNC_US"):  # this is the run on the simulated disk: is it?
        if "slow_sync.so" not in Path("/proc/self/maps").read_text():
            raise SystemExit("the slow-sync library did not load: no disk is simulated")
        return
    if not sys.platform.startswith("linux"):
        raise SystemExit("--sync-delay-ms works on Linux only (LD_PRELOAD and /proc)")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("--sync-delay-ms needs a C compiler (cc) to build bench/slow_sync.c")
    library = Path(tempfile.mkdtemp(prefix="loom-slow-sync-")) / "slow_sync.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(_SHIM), "-ldl"], check=True
    )
    preload = " ".join(filter(None, [str(library), os.environ.get("LD_PRELOAD")]))
    environment = {
        **os.environ,
        "LD_PRELOAD": preload,
        "SLOW_SYNC_US": str(round(delay_ms * 1000)),
    }
    os.execve(sys.executable, [sys.executable, *sys.argv], environment)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="*", default=[1, 4, 16, 64])
    parser.add_argument("--seconds", type=float, default=1.0, help="per side per round")
    parser.add_argument("--async-levels", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--fan-out", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--async-starts", type=int, nargs="*", default=[1, 10, 100])
    parser.add_argument("--worker-async", type=int, nargs="*", default=[10, 100, 500])
    parser.add_argument(
        "--synchronous", nargs="+", choices=["full", "normal"], default=["full", "normal"]
    )
    parser.add_argument(
        "--sync-delay-ms",
        type=float,
        default=0.0,
        help="simulate a disk whose every sync takes this much longer (needs cc; Linux)",
    )
    args = parser.parse_args()
    if args.sync_delay_ms > 0:
        _on_slow_disk(args.sync_delay_ms)
        print(
            f"Simulated disk: every sync takes {args.sync_delay_ms:g} ms longer "
            "(bench/slow_sync.c), for Loom and the raw writer alike.\n"
        )
    with tempfile.TemporaryDirectory() as scratch:
        if args.levels:
            print(f"## Loom steps/s ÷ one raw writer's commits/s ({ROUNDS} alternating rounds)")
            print("| synchronous | concurrent runs | ratio, median (range) | step p50 | step p99 |")
            print("| --- | --- | --- | --- | --- |")
            for synchronous in args.synchronous:
                for threads in args.levels:
                    print(_level(Path(scratch), synchronous, threads, args.seconds), flush=True)
        if args.async_levels:
            print("\n## Async flows, `start_async` from tasks of one event loop: the same ratio")
            print("| synchronous | concurrent runs | ratio, median (range) | step p50 | step p99 |")
            print("| --- | --- | --- | --- | --- |")
            for synchronous in args.synchronous:
                for runs in args.async_levels:
                    row = _level(Path(scratch), synchronous, runs, args.seconds, on_a_loop=True)
                    print(row, flush=True)
        if args.async_starts:
            print(
                f"\n## Async starts at once from one loop, each awaiting {CHILD_SECONDS} s of "
                "I/O in a step: wall time ÷ that wait"
            )
            print("| starts | `start_async` | `asyncio.to_thread(engine.start)` |")
            print("| --- | --- | --- |")
            for count in args.async_starts:
                print(_async_starts(Path(scratch), count), flush=True)
        if args.worker_async:
            print(
                f"\n## A worker's async runs at once, each awaiting {WORKER_WAIT} s of I/O "
                "between two steps, a slot each"
            )
            print("| runs | wall time ÷ that wait | pool threads at the most ÷ runs |")
            print("| --- | --- | --- |")
            for count in args.worker_async:
                print(_worker_async(Path(scratch), count), flush=True)
        if args.fan_out:
            print(f"\n## Fan-out: wall time ÷ one child's ({CHILD_SECONDS} s), synchronous=full")
            print("| children | a worker of N + 1 slots | inline, no worker |")
            print("| --- | --- | --- |")
            for count in args.fan_out:
                print(_fan_out(Path(scratch), count), flush=True)


if __name__ == "__main__":
    main()
