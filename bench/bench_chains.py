"""Run chains: what a rotation costs against doing the same by hand, ratios from one run.

Run:

    python3 -m uv run python bench/bench_chains.py               # SQLite, RGW, moto
    python3 -m uv run python bench/bench_chains.py --server none  # SQLite only

The same work two ways, in alternating rounds of ROTATIONS each, on SQLite at
synchronous=full and on S3 (the local servers the benchmark starts on 127.0.0.1:
Ceph RGW if scripts/install-rgw installed it, and moto):

- a chain: `send_to_chain` wakes the current run parked at a receive, which rotates
  (its successor starts, gets its ledger of the chain's inbox, and parks at its own
  receive);
- by hand: `engine.send` to a run parked at a receive, which ends; then
  `engine.start` of the next run (by its key), which parks at a receive.

Printed: time of a rotation ÷ time of the same by hand (median and range over
rounds), and the store calls (S3: requests by operation) of one of each.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from call_counter import CallCounter, on_servers
from loom_kernel import Context, Engine, flow, open_store
from loom_kernel.spi import JournalStore
from loom_orchestration import rotate, send_to_chain, start_chain
from loom_store_s3 import S3Options, S3Store
from loom_store_s3.testing import RequestCounter, S3Server

ROUNDS = 5
ROTATIONS = 40


@flow(name="bench.link", version="1")
def link(ctx: Context, run: dict[str, Any]) -> Any:
    return rotate(ctx, {"last": ctx.receive("tick")})


@flow(name="bench.plain", version="1")
def plain(ctx: Context, _input: Any) -> Any:
    return {"last": ctx.receive("tick")}


def _measure(label: str, make: Callable[[str], tuple[JournalStore, Callable[[], Any]]]) -> None:
    store, count = make("bench")
    engine = Engine(store, [link, plain], listeners=None)
    start_chain(engine, "bench", "bench.link")
    engine.start("bench.plain", key="plain-0")
    chained = plain_number = 0

    def by_chain() -> None:
        nonlocal chained
        for _ in range(ROTATIONS):
            chained += 1
            send_to_chain(engine, "bench", chained, topic="tick")

    def by_hand() -> None:
        nonlocal plain_number
        for _ in range(ROTATIONS):
            engine.send(f"plain-{plain_number}", plain_number, topic="tick")
            plain_number += 1
            engine.start("bench.plain", key=f"plain-{plain_number}")

    by_chain()
    by_hand()  # warm both paths
    ratios = []
    for _ in range(ROUNDS):
        began = time.perf_counter()
        by_chain()
        chain_time = time.perf_counter() - began
        began = time.perf_counter()
        by_hand()
        hand_time = time.perf_counter() - began
        ratios.append(chain_time / hand_time)
    count()
    chained += 1
    send_to_chain(engine, "bench", chained, topic="tick")
    one_rotation = count()
    engine.send(f"plain-{plain_number}", plain_number, topic="tick")
    plain_number += 1
    engine.start("bench.plain", key=f"plain-{plain_number}")
    one_by_hand = count()
    print(f"\n## {label}")
    print("| measure | value |")
    print("| --- | --- |")
    print(
        f"| a rotation ÷ send + start by hand | {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f}) |"
    )
    print(f"| store calls of a rotation | {dict(sorted(one_rotation.items()))} |")
    print(f"| store calls of the same by hand | {dict(sorted(one_by_hand.items()))} |")


def _s3(server: S3Server) -> None:
    client = server.client()
    bucket = server.new_bucket()
    requests = RequestCounter(client)

    def make(prefix: str) -> tuple[JournalStore, Callable[[], Any]]:
        options = S3Options(endpoint_url=server.endpoint_url)
        return S3Store(bucket, prefix, options, client=client), requests.take

    _measure(f"S3: {server.name} at {server.endpoint_url}", make)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=("rgw", "moto", "both", "none"), default="both")
    chosen = parser.parse_args().server
    with tempfile.TemporaryDirectory() as directory:

        def make(name: str) -> tuple[JournalStore, Callable[[], Any]]:
            store = open_store(f"sqlite://{directory}/{name}.db")
            return store, CallCounter(store).take

        _measure("SQLite (synchronous=full)", make)
    on_servers(chosen, _s3)


if __name__ == "__main__":
    main()
