"""Loom on S3 against raw conditional PUTs, on local S3 servers: ratios from one run.

Run:

    python3 -m uv run python bench/bench_s3.py            # Ceph RGW if installed, and moto
    python3 -m uv run python bench/bench_s3.py --server rgw

The servers are started by the benchmark on 127.0.0.1 (scripts/install-rgw installs
Ceph RGW). Work: durable steps through the engine (workflows of 10 steps, and one
run of 200 steps) against `put_object(IfNoneMatch="*")` calls of the same size, in
alternating rounds; then a cold resume of a run of 1,000 steps parked at a gate,
by a new engine on a new store (requests counted by operation, and milliseconds);
then a run taken over: a process that journaled its start and one step is killed
(SIGKILL, as it makes its second step) and a new engine's `recover()` takes the run
over at once and drives its other TAKEN_OVER steps (requests counted, per step);
then CONCURRENT runs at once: a `Worker` of CONCURRENT slots driving as many 10-step
workflows (enqueued, handed to its slots), against CONCURRENT threads of raw
conditional PUTs, as many as the workflows' steps, in alternating rounds.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from call_counter import on_servers
from loom_kernel import Context, Engine, Worker, flow
from loom_store_s3 import S3Options, S3Store
from loom_store_s3.testing import RequestCounter, S3Server
from timing import seconds_in_threads

ROUNDS = 5
CONCURRENT = 32
TAKEN_OVER = 200
_DIE = "LOOM_BENCH_DIE_AT_STEP_2"
BODY = b'{"v":1,"commit":"0123456789abcdef0123456789abcdef","start":7,"count":1}\n' + b"x" * 90


def _timed(func: Callable[[], object]) -> float:
    began = time.perf_counter()
    func()
    return time.perf_counter() - began


@flow(name="bench.steps")
def steps(ctx: Context, count: int) -> int:
    for index in range(count):
        ctx.step(f"s{index}", lambda index=index: {"n": index, "ok": True})
    return count


@flow(name="bench.parked")
def parked(ctx: Context, count: int) -> Any:
    for index in range(count):
        ctx.step(f"s{index}", lambda index=index: {"n": index})
    return ctx.suspend("go")


def _second_step() -> dict[str, int]:
    if os.environ.get(_DIE):  # the process dies before its second step is journaled
        os.kill(os.getpid(), signal.SIGKILL)
    return {"n": 1}


@flow(name="bench.left")
def left(ctx: Context, count: int) -> int:
    ctx.step("s0", lambda: {"n": 0})
    ctx.step("s1", _second_step)
    for index in range(2, count):
        ctx.step(f"s{index}", lambda index=index: {"n": index})
    return count


def _taken_over(server: S3Server, bucket: str, client: Any, requests: RequestCounter) -> None:
    """Requests per step of a run whose process was killed mid-run, taken over by
    `recover()` (as a worker's sweep does), all of it and the steps' share."""
    url = f"s3://{bucket}/taken?endpoint_url={server.endpoint_url}"
    engine = Engine(_store(server, bucket, client, "taken"), [left], listeners=[])
    engine.start("bench.left", 2)  # the store indexed, as one in use is
    child = subprocess.run(
        [sys.executable, __file__, "--leave-running", url, str(TAKEN_OVER + 1)],
        env={**os.environ, **server.environment(), _DIE: "1"},
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.returncode
    requests.take()
    (run,) = engine.recover()
    taken = requests.take()
    view = engine.get(run)
    assert (view.status.value, view.result) == ("completed", TAKEN_OVER + 1), view
    total = sum(taken.values())
    puts = taken.get("PutObject", 0)
    print(
        f"| requests per step of a run taken over ({TAKEN_OVER} steps left, "
        f"`recover()`) | {total / TAKEN_OVER:.2f} in all {taken}; "
        f"{puts / TAKEN_OVER:.2f} PUTs (goal <= 1.2) |"
    )


def _leave_running(url: str, count: int) -> None:
    """In a child process: start a run of `left` (which kills this process)."""
    from loom_kernel import open_store

    Engine(open_store(url), [left], listeners=[]).start("bench.left", count)


def _raw_puts(client: Any, bucket: str, count: int) -> float:
    prefix = uuid.uuid4().hex
    return _timed(
        lambda: [
            client.put_object(
                Bucket=bucket, Key=f"raw/{prefix}/{n:08d}", Body=BODY, IfNoneMatch="*"
            )
            for n in range(count)
        ]
    )


def _raw_puts_at_once(client: Any, bucket: str, threads: int, each: int) -> float:
    """Seconds for `threads` threads to make `each` conditional PUTs apiece."""
    prefix = uuid.uuid4().hex

    def put(number: int) -> None:
        for n in range(each):
            client.put_object(
                Bucket=bucket, Key=f"raw/{prefix}/{number}/{n:06d}", Body=BODY, IfNoneMatch="*"
            )

    return seconds_in_threads(threads, put)


def _worker_runs(engine: Engine, runs: int) -> float:
    """Seconds for a running worker of `engine` to drive `runs` enqueued workflows."""
    began = time.perf_counter()
    handles = [engine.enqueue("bench.steps", 10) for _ in range(runs)]
    for handle in handles:
        handle.result(timeout=600)
    return time.perf_counter() - began


def _measure_at_once(server: S3Server) -> None:
    client = server.client()
    bucket = server.new_bucket()
    engine = Engine(_store(server, bucket, client, "at-once"), [steps, parked], listeners=[])
    ratios: list[float] = []
    with Worker(engine, concurrency=CONCURRENT):
        _worker_runs(engine, CONCURRENT)  # warm up the pool and the slots
        for _ in range(ROUNDS):
            raw = _raw_puts_at_once(client, bucket, CONCURRENT, 10)
            loom = _worker_runs(engine, CONCURRENT)
            ratios.append(raw / loom)
    print(
        f"| {CONCURRENT} runs at once on a Worker: Loom steps/s ÷ raw conditional PUTs/s "
        f"from {CONCURRENT} threads | {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f}) |"
    )


def _store(server: S3Server, bucket: str, client: Any, prefix: str) -> S3Store:
    return S3Store(bucket, prefix, S3Options(endpoint_url=server.endpoint_url), client=client)


def _measure(server: S3Server) -> None:
    client = server.client()
    bucket = server.new_bucket()
    requests = RequestCounter(client)
    engine = Engine(_store(server, bucket, client, "bench"), [steps, parked])
    engine.start("bench.steps", 10)  # warm up the connection pool and the code paths
    _raw_puts(client, bucket, 20)

    short_ratios: list[float] = []
    long_ratios: list[float] = []
    raw_rates: list[float] = []
    for _ in range(ROUNDS):
        raw = _raw_puts(client, bucket, 100)
        raw_rates.append(100 / raw)
        short = _timed(lambda: [engine.start("bench.steps", 10) for _ in range(10)])
        short_ratios.append((100 / short) / (100 / raw))
        long = _timed(lambda: engine.start("bench.steps", 200))
        long_ratios.append((200 / long) / (100 / raw))
    requests.take()
    engine.start("bench.steps", 10)
    per_workflow = requests.take()

    run = engine.start("bench.parked", 1000)
    cold_engine = Engine(_store(server, bucket, client, "bench"), [steps, parked])
    requests.take()
    began = time.perf_counter()
    cold_engine.resume(run.id, "now")
    cold_ms = (time.perf_counter() - began) * 1000
    cold_requests = requests.take()
    raw_ms = 1000 / statistics.median(raw_rates)

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"

    print(f"\n## {server.name} at {server.endpoint_url}")
    print(f"raw conditional PUT: {raw_ms:.1f} ms median ({statistics.median(raw_rates):.0f}/s)")
    print("| measure | ratio (median, range over rounds) |")
    print("| --- | --- |")
    print(
        f"| Loom steps/s ÷ raw conditional PUTs/s, workflows of 10 steps | {spread(short_ratios)} |"
    )
    print(
        f"| Loom steps/s ÷ raw conditional PUTs/s, one run of 200 steps | {spread(long_ratios)} |"
    )
    print(f"| requests per 10-step workflow | {per_workflow} |")
    total = sum(cold_requests.values())
    print(
        f"| cold resume of a 1,000-step run | {total} requests {cold_requests}, "
        f"{cold_ms:.0f} ms = {cold_ms / raw_ms:.0f}x one PUT |"
    )
    _taken_over(server, bucket, client, requests)
    _measure_at_once(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=("rgw", "moto", "both"), default="both")
    parser.add_argument("--leave-running", nargs=2, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.leave_running:
        _leave_running(arguments.leave_running[0], int(arguments.leave_running[1]))
        return
    on_servers(arguments.server, _measure)


if __name__ == "__main__":
    main()
