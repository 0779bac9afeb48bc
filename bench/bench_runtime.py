"""The runtime's store-wide calls against one start, the S3 requests a worker makes,
and a worker against inline starts: ratios from one run.

Run:

    python3 -m uv run python bench/bench_runtime.py             # 1k, 10k and 100k runs
    python3 -m uv run python bench/bench_runtime.py --sizes 1000 10000

1. Flat store-wide calls. Stores (memory, and SQLite at synchronous=full) holding N
   finished runs (N = 1k, 10k, 100k; a tenth of them slept on a timer that fired,
   spread over N/100 minute buckets), plus 10 failed and 10 parked runs whatever N:
   `recover()` with nothing to drive, `executions(status="failed")`, `loom ls --status
   failed`, and an idle `fire_due_timers()`, each by a new engine (as another process
   would), as a multiple of one start of a one-step flow on the same store.
2. S3 requests (moto): per run started inline, per run enqueued and driven by a worker,
   and per idle poll of a worker, turned into requests and dollars per idle month.
3. A worker against inline starts: steps/s of runs of 10 steps driven by an in-process
   `Worker(concurrency=1)` after `enqueue`, against `start` inline, on SQLite at
   synchronous=full and normal, in alternating rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loom_kernel import Context, Engine, MemoryStore, Worker, flow, open_store
from loom_kernel._engine import parts_of
from loom_kernel._hosting._cli import main as loom_main
from loom_kernel._hosting._worker import _IDLE_POLL_COSTLY
from loom_kernel.spi import JournalStore
from loom_kernel.testing import FakeClock
from timing import median_seconds

SLEEPERS = 10  # one run in SLEEPERS sleeps on a timer
PER_BUCKET = 100  # runs per fake minute while filling
FIXED = 10  # failed and parked runs, whatever N
#: AWS S3 Standard, us-east-1: LIST (and PUT) per 1,000 requests, GET per 1,000.
LIST_PRICE, GET_PRICE = 0.005, 0.0004


@flow(name="bench.one")
def one(ctx: Context, what: str) -> Any:
    ctx.step("only", lambda: what)
    if what == "sleep":
        ctx.sleep(30)
    if what == "fail":
        raise ValueError("asked to fail")
    if what == "park":
        ctx.suspend("go")
    return what


@flow(name="bench.ten")
def ten(ctx: Context, _input: Any) -> int:
    for index in range(10):
        ctx.step(f"s{index}", lambda index=index: index)
    return 10


def _timed(func: Callable[[], object], repeat: int = 5) -> float:
    return median_seconds(func, repeat)


def _fill(store: JournalStore, finished: int) -> None:
    clock = FakeClock(time.time() - 10 * 86_400)  # the fake minutes all lie in the past
    engine = Engine(store, [one], clock=clock, listeners=[])
    for number in range(finished):
        engine.start("bench.one", "sleep" if number % SLEEPERS == 0 else "done")
        if number % PER_BUCKET == PER_BUCKET - 1:
            clock.advance(61)
    for number in range(FIXED):
        engine.start("bench.one", "fail", key=f"failed-{number}")
        engine.start("bench.one", "park", key=f"parked-{number}")
    clock.advance(3600)
    engine.fire_due_timers()
    assert parts_of(engine).driver.timers.buckets() == [], "every handled bucket is retired"


_HEADER = (
    "| store | one start | recover() | executions(failed) | loom ls --status failed "
    "| idle fire_due_timers() |\n| --- | --- | --- | --- | --- | --- |"
)


def _row(label: str, store: JournalStore, url: str | None) -> None:
    """One row of the flat table: each call by a new engine, as a multiple of one start."""

    def fresh() -> Engine:
        return Engine(store, [one], listeners=[])

    starter = fresh()
    start = _timed(lambda: starter.start("bench.one", "done"), 21)
    recover = _timed(lambda: fresh().recover())
    failed = _timed(lambda: list(fresh().executions(status="failed")))
    assert len(list(fresh().executions(status="failed"))) == FIXED
    idle = _timed(lambda: fresh().fire_due_timers())
    listing = "(no URL)"
    if url is not None:

        def ls() -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                assert loom_main(["ls", "--store", url, "--status", "failed"]) == 0

        listing = f"{_timed(ls) / start:.1f}x"
    print(
        f"| {label} | {start * 1000:.2f} ms | {recover / start:.1f}x | {failed / start:.1f}x "
        f"| {listing} | {idle / start:.2f}x |"
    )


def _flat(sizes: list[int]) -> None:
    print("\n## store-wide calls as a multiple of one start (each by a new engine)")
    print(_HEADER)
    for size in sizes:
        memory = MemoryStore()
        _fill(memory, size)
        _row(f"memory, {size:,} runs", memory, None)
    with tempfile.TemporaryDirectory() as scratch:
        for size in sizes:
            path = Path(scratch) / f"flat-{size}.db"
            with open_store(f"sqlite://{path}?synchronous=off") as filling:
                _fill(filling, size)  # filled fast; measured below at synchronous=full
            url = f"sqlite://{path}"
            with open_store(url) as store:
                _row(f"SQLite, {size:,} runs", store, url)


def _s3_servers() -> list[Callable[[], Any]]:
    """moto, and Ceph RGW when it is installed (scripts/install-rgw)."""
    from loom_store_s3.testing import MotoServer, RadosGateway

    servers: list[Callable[[], Any]] = [MotoServer]
    if not RadosGateway.missing():
        servers.append(RadosGateway)
    else:
        print("\n(Ceph RGW is not installed: run scripts/install-rgw to measure it too)")
    return servers


def _s3_requests(make_server: Callable[[], Any]) -> None:
    from loom_store_s3 import S3Options, S3Store
    from loom_store_s3.testing import RequestCounter

    idle_poll = _IDLE_POLL_COSTLY  # the Worker's default on a store whose heads cost a request
    with make_server() as server:
        client = server.client()
        bucket = server.new_bucket()
        requests = RequestCounter(client)
        store = S3Store(bucket, "bench", S3Options(endpoint_url=server.endpoint_url), client=client)
        name = server.name
        clock = FakeClock(time.time())
        engine = Engine(store, [one, ten], listeners=[], clock=clock)
        engine.start("bench.ten")  # warm up: the store is marked indexed
        requests.take()
        engine.start("bench.ten")
        inline = requests.take()
        handle = engine.enqueue("bench.ten")
        enqueued = requests.take()
        worker = Engine(store, [one, ten], listeners=[], clock=clock)
        visit = next(
            hint
            for hint in parts_of(worker).driver.runs.open_runs()
            if hint.execution_id == handle.id
        )
        requests.take()
        parts_of(worker).recovery.recover_open(visit)
        driven = requests.take()
        assert handle.get().status.value == "completed"

        def idle_polls(count: int) -> dict[str, int]:
            """What `count` idle polls cost, `idle_poll` seconds apart (each seals the
            minute that passed since the one before)."""
            requests.take()
            for _ in range(count):
                clock.advance(idle_poll)
                worker.fire_due_timers()
                list(parts_of(worker).driver.runs.open_runs())
            return requests.take()

        idle_polls(2)  # the first poll reads the floor and the partitions
        fresh = idle_polls(10)
        sleeper = engine.start("bench.one", "sleep")
        slept = requests.take()
        clock.advance(61)
        worker.fire_due_timers()
        woken = requests.take()
        assert worker.get(sleeper.id).status.value == "completed"
        for _ in range(300):  # five hours of minutes, each with a timer fired and retired
            engine.start("bench.one", "sleep")
            clock.advance(60)
            worker.fire_due_timers()
        idle_polls(1)  # the first poll after them reads what they added to the run index
        aged = idle_polls(10)
        store.close()

    def total(counts: dict[str, int], per: int = 1) -> str:
        mean = {name: round(count / per, 1) for name, count in sorted(counts.items())}
        return f"{round(sum(counts.values()) / per, 1)} {mean}"

    def dollars(counts: dict[str, int], per: int) -> float:
        polls_a_month = 30 * 86_400 / idle_poll
        cheap = counts.get("GetObject", 0) + counts.get("DeleteObjects", 0)
        costly = sum(counts.values()) - cheap  # LIST and PUT
        return polls_a_month / per * (costly * LIST_PRICE + cheap * GET_PRICE) / 1000

    print(f"\n## S3 requests ({name}), a run of 10 steps")
    print("| what | requests |")
    print("| --- | --- |")
    print(f"| start inline (hint, start, steps, end, close) | {total(inline)} |")
    print(f"| enqueue | {total(enqueued)} |")
    print(f"| the worker's drive of it (claim, steps, end, close) | {total(driven)} |")
    print(f"| a run that sleeps once, inline to its park | {total(slept)} |")
    print(f"| firing that timer (the wake, the run's end, retiring its minute) | {total(woken)} |")
    print(f"| one idle poll, {idle_poll:.0f} s after the last (mean of 10) | {total(fresh, 10)} |")
    print(f"| the same after 300 minutes of timers were handled | {total(aged, 10)} |")
    print(
        f"| an idle worker for 30 days, polling every {idle_poll:.0f} s | "
        f"${dollars(fresh, 10):.2f} at AWS prices "
        f"(${dollars(aged, 10):.2f} after the 300 minutes) |"
    )


def _worker_against_inline(
    synchronous: str, concurrency: int, rounds: int = 9, runs: int = 40
) -> None:
    """Alternating rounds: `runs` inline starts, then `runs` enqueues that a worker
    already running in this process drives (as a deployed worker would be)."""
    with tempfile.TemporaryDirectory() as scratch:
        store = open_store(f"sqlite://{Path(scratch) / 'w.db'}?synchronous={synchronous}")
        engine = Engine(store, [ten], listeners=[])
        engine.start("bench.ten")
        ratios = []
        first = engine.enqueue("bench.ten")
        began = time.perf_counter()
        worker = Worker(engine, concurrency=concurrency)
        with worker:
            first.result(timeout=60)  # the worker's start, to its first run's end
            started = time.perf_counter() - began
            for _ in range(rounds):
                inline = _timed(lambda: [engine.start("bench.ten") for _ in range(runs)], 1)
                seen = worker.stats.visited
                began = time.perf_counter()
                for _ in range(runs):
                    engine.enqueue("bench.ten")
                while worker.stats.visited < seen + runs:
                    time.sleep(0.002)  # coarse enough not to take the GIL from the drive
                worked = time.perf_counter() - began
                ratios.append(inline / worked)
            began = time.perf_counter()
        stopped = time.perf_counter() - began
        store.close()
    print(
        f"| synchronous={synchronous} | {concurrency} | {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f}) | {started * 1000:.0f} ms "
        f"| {stopped * 1000:.0f} ms |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--only", choices=("flat", "s3", "worker"), action="append")
    args = parser.parse_args()
    parts = set(args.only or ("flat", "s3", "worker"))
    if "flat" in parts:
        _flat(args.sizes)
    if "s3" in parts:
        for make_server in _s3_servers():
            _s3_requests(make_server)
    if "worker" in parts:
        print(
            "\n## a worker against inline starts (SQLite, runs of 10 steps, 9 alternating rounds)"
        )
        print(
            "| SQLite | worker concurrency | worker steps/s ÷ inline steps/s, median (range) "
            "| start to the first run's end | stop |\n| --- | --- | --- | --- | --- |"
        )
        for synchronous in ("full", "normal"):
            for concurrency in (1, 8):  # one slot, and the default
                _worker_against_inline(synchronous, concurrency)


if __name__ == "__main__":
    main()
