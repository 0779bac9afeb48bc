"""Loom on PostgreSQL against raw conditional INSERTs and DBOS Transact, on one server.

Run (DBOS goes in a throwaway environment, never in the project's):

    python3 -m uv run --with dbos python bench/bench_postgres.py

A throwaway cluster (fsync on, synchronous_commit on: every commit durable) serves
all three. Work: workflows of 10 steps, each returning a small dict, run by 1, 16
and 64 threads at once. Raw: each thread's own connection INSERTs rows of a table
keyed (stream, position), one per transaction, as many as the workflows' steps: the
cost of one durable conditional write, with no engine. Each side runs in a process
of its own (DBOS owns process-wide state), the sides alternating round by round so
that the machine's drift hits all alike; printed are the median ratios and ranges.
A peer that is not installed is reported as such, not guessed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

STEPS = 10
LEVELS = (1, 16, 64)
POOL = 20  # connections each side may open: DBOS's default system-database pool


def _in_threads(level: int, workflows: int, run: Callable[[int], object]) -> float:
    """Seconds for `level` threads to run `workflows` workflows between them."""
    barrier = threading.Barrier(level + 1)
    share = [workflows // level + (1 if n < workflows % level else 0) for n in range(level)]

    def thread(number: int) -> None:
        barrier.wait()
        base = sum(share[:number])
        for offset in range(share[number]):
            run(base + offset)

    threads = [threading.Thread(target=thread, args=(n,)) for n in range(level)]
    for started in threads:
        started.start()
    barrier.wait()
    began = time.perf_counter()
    for started in threads:
        started.join()
    return time.perf_counter() - began


def loom_side(url: str, level: int, workflows: int, tag: str) -> float:
    from loom_kernel import Context, Engine, flow, open_store

    @flow(name="ten_steps", version="1")
    def ten_steps(ctx: Context, number: int) -> Any:
        for index in range(STEPS):
            ctx.step(f"s{index}", lambda i=index: {"n": i, "ok": True})
        return number

    store = open_store(f"{url}&pool_max={POOL}")
    engine = Engine(store, [ten_steps], listeners=[])
    engine.start("ten_steps", -1, key=f"{tag}-warm")
    seconds = _in_threads(
        level, workflows, lambda n: engine.start("ten_steps", n, key=f"{tag}-{n}")
    )
    store.close()
    return workflows * STEPS / seconds


def raw_side(url: str, level: int, workflows: int, tag: str) -> float:
    import psycopg
    from loom_store_postgres._options import parse_postgres_url

    conninfo, _options = parse_postgres_url(url)
    with psycopg.connect(conninfo, autocommit=True) as setup:
        setup.execute(
            'CREATE TABLE IF NOT EXISTS raw_steps (stream text COLLATE "C", position bigint, '
            "payload bytea, PRIMARY KEY (stream, position))"
        )
    local = threading.local()
    payload = b'{"v":"1","d":{"index":1,"name":"s1","result":{"n":1,"ok":true}}}'

    def workflow(number: int) -> None:
        connection = getattr(local, "connection", None)
        if connection is None:
            connection = local.connection = psycopg.connect(conninfo, autocommit=True)
        for position in range(1, STEPS + 1):
            connection.execute(
                "INSERT INTO raw_steps VALUES (%s, %s, %s)",
                (f"{tag}-{number}", position, payload),
            )

    seconds = _in_threads(level, workflows, workflow)
    return workflows * STEPS / seconds


def dbos_side(url: str, level: int, workflows: int, tag: str) -> float | None:
    try:
        from dbos import DBOS, DBOSConfig, SetWorkflowID
    except ImportError:
        return None
    from loom_store_postgres._options import parse_postgres_url

    conninfo, _options = parse_postgres_url(url)

    @DBOS.step()
    def step(index: int) -> dict[str, Any]:
        return {"n": index, "ok": True}

    @DBOS.workflow()
    def workflow(number: int) -> int:
        for index in range(STEPS):
            step(index)
        return number

    database = conninfo.rsplit("/", 1)[0] + "/dbos_bench"
    config: DBOSConfig = {
        "name": "loom-bench",
        "system_database_url": database,
        "sys_db_pool_size": POOL,
    }
    with contextlib.redirect_stdout(io.StringIO()):
        DBOS(config=config)
        DBOS.launch()
    try:
        workflow(-1)

        def run(number: int) -> None:
            with SetWorkflowID(f"{tag}-{number}"):
                workflow(number)

        seconds = _in_threads(level, workflows, run)
    finally:
        DBOS.destroy()
    return workflows * STEPS / seconds


SIDES = {"loom": loom_side, "raw": raw_side, "dbos": dbos_side}


def _child(side: str, url: str, level: int, workflows: int, tag: str) -> float | None:
    result = subprocess.run(
        [sys.executable, __file__, "--side", side, "--url", url, "--level", str(level),
         "--workflows", str(workflows), "--tag", tag],
        capture_output=True, text=True, check=False, timeout=900,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{side} at {level}: {result.stderr[-2000:]}")
    rate: float | None = json.loads(result.stdout.strip().splitlines()[-1])
    return rate


def _spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per level")
    parser.add_argument("--workflows", type=int, default=128, help="workflows per timing")
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--level", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(SIDES[args.side](args.url, args.level, args.workflows, args.tag)))
        return

    from loom_store_postgres.testing import PostgresServer

    with PostgresServer(fsync=True) as server:
        url = server.store_url(schema="bench")
        rows: list[tuple[str, str]] = []
        for level in LEVELS:
            over_raw: list[float] = []
            over_dbos: list[float] = []
            rates: dict[str, list[float]] = {"loom": [], "raw": [], "dbos": []}
            for number in range(args.rounds):
                got = {
                    side: _child(side, url, level, args.workflows, f"{side}-{level}-{number}")
                    for side in ("loom", "raw", "dbos")
                }
                for side, rate in got.items():
                    if rate is not None:
                        rates[side].append(rate)
                loom, raw, dbos = got["loom"], got["raw"], got["dbos"]
                assert loom is not None
                assert raw is not None
                over_raw.append(loom / raw)
                if dbos is not None:
                    over_dbos.append(loom / dbos)
            rows.append((f"{level:>2} at once: Loom steps/s ÷ raw INSERTs/s", _spread(over_raw)))
            rows.append(
                (
                    f"{level:>2} at once: Loom steps/s ÷ DBOS steps/s (goal > 1)",
                    _spread(over_dbos) if over_dbos else "DBOS not installed: `--with dbos`",
                )
            )
            medians = ", ".join(
                f"{side} {statistics.median(found):,.0f}" for side, found in rates.items() if found
            )
            rows.append((f"{level:>2} at once: steps/s (median)", medians))
        width = max(len(name) for name, _ in rows)
        print(f"PostgreSQL {server.port}, fsync on; {args.workflows} workflows of {STEPS} steps")
        for name, value in rows:
            print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
