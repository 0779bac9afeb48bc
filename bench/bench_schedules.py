"""Schedules: what an idle schedule adds to a worker's poll, against a poll with no
schedule, and what a scheduled run costs against a direct start: ratios from one run.

Run:

    python3 -m uv run python bench/bench_schedules.py             # SQLite, RGW, moto
    python3 -m uv run python bench/bench_schedules.py --server none  # SQLite only

On each store (SQLite at synchronous=full; S3 on the local servers the benchmark
starts on 127.0.0.1: Ceph RGW if scripts/install-rgw installed it, and moto):

1. A look: the worker's schedule poller at a poll where its refresh is due (it reads
   the notices of changes made elsewhere; every FULL_EVERY looks it lists and reads
   every schedule), with 1 and with 100 idle schedules (a tick a year away), against
   the same look on a store with no schedule: time per look (over rounds of
   FULL_EVERY looks, one of them full), the ratio, and the store calls (S3: requests
   by operation) per look.
2. A poll between looks (what every other poll of a worker costs a schedule),
   against the empty look.
3. A tick: firing one due tick of a one-step flow (read the schedule, append the
   decision, start the run by its id, drive it) against starting the same run
   directly (`engine.start` with a key): time and store calls.
4. On S3, the requests a month of looks costs a worker (a look at most every 60 s,
   the worker's idle pace there) with and without an idle schedule, and a month of
   an hourly schedule's ticks, at AWS's prices ($0.005 per 1,000 PUTs or LISTs,
   $0.0004 per 1,000 GETs).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from call_counter import CallCounter, on_servers
from loom_kernel import Context, Engine, flow, open_store
from loom_kernel.spi import JournalStore
from loom_kernel.testing import FakeClock
from loom_orchestration import create_schedule
from loom_orchestration._schedules._poller import FULL_EVERY, REFRESH_COSTLY, SchedulePoller
from loom_store_s3 import S3Options, S3Store
from loom_store_s3.testing import RequestCounter, S3Server

ROUNDS = 5
TICKS = 20
YEARLY = "0 0 1 1 *"
BASE = 1_796_601_630.0  # 2026-12-07T00:00:30Z: half a minute before a tick
MONTH = 30 * 24 * 3600
PRICE_PER_1000 = {"ListObjectsV2": 0.005, "PutObject": 0.005, "GetObject": 0.0004}


@flow(name="bench.tick", version="1")
def tick(ctx: Context, data: Any) -> Any:
    return ctx.step("note", lambda: {"ok": True})


class Monotonic:
    """A poller's clock for listings, moved on by the benchmark."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _looks(engine: Engine, count: Callable[[], dict[str, int]]) -> tuple[float, Any]:
    """Seconds per look (median over rounds of FULL_EVERY looks) and the calls of one
    round divided by FULL_EVERY."""
    monotonic = Monotonic()
    poller = SchedulePoller(engine, refresh=1.0, monotonic=monotonic)
    poller()
    count()
    times = []
    calls: collections.Counter[str] = collections.Counter()
    for round_number in range(ROUNDS):
        began = time.perf_counter()
        for _ in range(FULL_EVERY):
            monotonic.now += 1.0
            poller()
        times.append((time.perf_counter() - began) / FULL_EVERY)
        taken = count()
        if round_number == 0:
            calls.update(taken)
    per_look = {name: round(n / FULL_EVERY, 3) for name, n in sorted(calls.items())}
    return statistics.median(times), per_look


def _between_polls(engine: Engine) -> float:
    poller = SchedulePoller(engine, refresh=3600.0, monotonic=Monotonic())
    poller()
    began = time.perf_counter()
    for _ in range(1000):
        poller()
    return (time.perf_counter() - began) / 1000


def _ticks(
    make: Callable[[str], JournalStore], count_of: Callable[[JournalStore], Callable[[], Any]]
) -> tuple[float, float, Any, Any]:
    """Seconds per fired tick and per direct start (medians), and the calls of each."""
    clock = FakeClock(BASE)
    store = make("ticks")
    count = count_of(store)
    engine = Engine(store, [tick], clock=clock)
    create_schedule(engine, "minutely", "bench.tick", cron="* * * * *", overlap="allow_all")
    poller = SchedulePoller(engine, monotonic=Monotonic())
    poller()
    engine.start("bench.tick", None, key="warm")
    fired, started = [], []
    tick_calls, start_calls = None, None
    count()
    for number in range(TICKS):
        clock.advance(60)
        began = time.perf_counter()
        poller()
        fired.append(time.perf_counter() - began)
        tick_calls = tick_calls or count()
        began = time.perf_counter()
        engine.start("bench.tick", None, key=f"direct-{number}")
        started.append(time.perf_counter() - began)
        start_calls = start_calls or count()
        count()
    return statistics.median(fired), statistics.median(started), tick_calls, start_calls


def _measure(
    label: str,
    make: Callable[[str], JournalStore],
    count_of: Callable[[JournalStore], Callable[[], Any]],
) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    for schedules in (0, 1, 100):
        store = make(f"idle{schedules}")
        count = count_of(store)
        engine = Engine(store, [tick], clock=FakeClock(BASE))
        for number in range(schedules):
            create_schedule(engine, f"idle-{number:03d}", "bench.tick", cron=YEARLY)
        results[schedules] = _looks(engine, count)
        if schedules == 1:
            results["between"] = _between_polls(engine)
    results["tick"] = _ticks(make, count_of)
    empty = results[0][0]
    print(f"\n## {label}")
    print("| measure | time ratio | store calls (requests on S3) per look |")
    print("| --- | --- | --- |")
    rows = [("a look, no schedule (the base)", f"1.00x ({empty * 1e6:.0f} us)", results[0][1])]
    for schedules in (1, 100):
        seconds, calls = results[schedules]
        rows.append(
            (f"a look, {schedules} idle schedule(s) ÷ base", f"{seconds / empty:.2f}x", calls)
        )
    between = results["between"] / empty
    rows.append(("a poll between looks, 1 idle schedule ÷ base", f"{between:.3f}x", "none"))
    fired, started, tick_calls, start_calls = results["tick"]
    rows.append(
        (
            "a fired tick ÷ a direct start of the same run",
            f"{fired / started:.2f}x",
            f"{tick_calls} vs {start_calls}",
        )
    )
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
    return results


def _s3_cost(results: dict[Any, Any]) -> None:
    listing = results[1][1]
    _fired, _started, tick_calls, _start = results["tick"]
    listings = MONTH / REFRESH_COSTLY
    month = sum(PRICE_PER_1000.get(op, 0.005) * n * listings / 1000 for op, n in listing.items())
    ticks = sum(PRICE_PER_1000.get(op, 0.005) * n * 720 / 1000 for op, n in tick_calls.items())
    empty = sum(
        PRICE_PER_1000.get(op, 0.005) * n * listings / 1000 for op, n in results[0][1].items()
    )
    print(
        f"| a month of looks at most every {REFRESH_COSTLY:.0f} s | ${month:.2f} with 1 idle "
        f"schedule, ${empty:.2f} with none | |"
    )
    print(f"| a month of an hourly schedule's ticks (720) | ${ticks:.2f} | |")


def _s3(server: S3Server) -> None:
    client = server.client()
    bucket = server.new_bucket()
    requests = RequestCounter(client)

    def make(prefix: str) -> JournalStore:
        options = S3Options(endpoint_url=server.endpoint_url)
        return S3Store(bucket, f"{prefix}-{time.monotonic_ns()}", options, client=client)

    label = f"S3: {server.name} at {server.endpoint_url}"
    results = _measure(label, make, lambda _store: requests.take)
    _s3_cost(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=("rgw", "moto", "both", "none"), default="both")
    chosen = parser.parse_args().server
    with tempfile.TemporaryDirectory() as directory:
        _measure(
            "SQLite (synchronous=full)",
            lambda name: open_store(f"sqlite://{directory}/{name}.db"),
            lambda store: CallCounter(store).take,
        )
    on_servers(chosen, _s3)


if __name__ == "__main__":
    main()
