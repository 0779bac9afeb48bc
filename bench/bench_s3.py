"""Loom on S3 against raw conditional PUTs, on local S3 servers: ratios from one run.

Run:

    python3 -m uv run python bench/bench_s3.py            # Ceph RGW if installed, and moto
    python3 -m uv run python bench/bench_s3.py --server rgw

The servers are started by the benchmark on 127.0.0.1 (scripts/install-rgw installs
Ceph RGW). Work: durable steps through the engine (workflows of 10 steps, and one
run of 200 steps) against `put_object(IfNoneMatch="*")` calls of the same size, in
alternating rounds; then a cold resume of a run of 1,000 steps parked at a gate,
by a new engine on a new store (requests counted by operation, and milliseconds).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from call_counter import on_servers
from loom_kernel import Context, Engine, flow
from loom_store_s3 import S3Options, S3Store
from loom_store_s3.testing import RequestCounter, S3Server

ROUNDS = 5
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=("rgw", "moto", "both"), default="both")
    chosen = parser.parse_args().server
    on_servers(chosen, _measure)


if __name__ == "__main__":
    main()
