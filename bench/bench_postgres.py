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

Queues: JOBS one-step runs on a `Queue` capped at 16, enqueued by an engine with no
worker, driven by two `Worker`s of 8 slots (two store instances: two processes as
far as the server knows); against the same jobs as rows claimed with `FOR UPDATE
SKIP LOCKED` by 16 threads, each job claimed in one transaction and its step row
written and the job marked done in a second: jobs/s ÷ jobs/s, alternating.
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

from timing import seconds_in_threads

STEPS = 10
LEVELS = (1, 16, 64)
POOL = 20  # connections each side may open: DBOS's default system-database pool


def _in_threads(level: int, workflows: int, run: Callable[[int], object]) -> float:
    """Seconds for `level` threads to run `workflows` workflows between them."""
    share = [workflows // level + (1 if n < workflows % level else 0) for n in range(level)]

    def thread(number: int) -> None:
        base = sum(share[:number])
        for offset in range(share[number]):
            run(base + offset)

    return seconds_in_threads(level, thread)


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


JOBS = 400
QUEUE_CAP = 16
PER_WORKER = 8


def loom_queue_side(url: str, level: int, jobs: int, tag: str) -> float:
    """Jobs/s through the queue (`level` 1) or enqueued with no queue (0: each run
    journaled with no owner, claimed by a worker's poll as after a crash)."""
    from loom_kernel import Context, Engine, Queue, Worker, flow, open_store

    @flow(name="one_step", version="1")
    def one_step(ctx: Context, number: int) -> Any:
        return ctx.step("only", lambda: {"n": number})

    queue = Queue(f"jobs_{tag.replace('-', '_')}", concurrency=QUEUE_CAP)
    stores = [open_store(f"{url}&pool_max={POOL}") for _ in range(3)]
    web = Engine(stores[0], [one_step], listeners=[], queues=[queue])
    engines = [
        Engine(s, [one_step], listeners=[], queues=[queue], worker_id=f"{tag}-w{n}")
        for n, s in enumerate(stores[1:])
    ]
    on = queue.name if level else None
    handles = [web.enqueue("one_step", n, queue=on) for n in range(jobs)]
    began = time.perf_counter()
    workers = [Worker(e, concurrency=PER_WORKER, idle_poll=0.05).start() for e in engines]
    for handle in handles:
        handle.result(timeout=300)
    elapsed = time.perf_counter() - began
    for worker in workers:
        worker.stop()
    for store in stores:
        store.close()
    return jobs / elapsed


def skip_locked_side(url: str, _level: int, jobs: int, tag: str) -> float:
    import psycopg
    from loom_store_postgres._options import parse_postgres_url

    conninfo, _options = parse_postgres_url(url)
    table = f"jobs_{tag.replace('-', '_')}"
    with psycopg.connect(conninfo, autocommit=True) as setup:
        setup.execute(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, state text NOT NULL)")
        setup.execute("CREATE TABLE IF NOT EXISTS job_steps (job bigint, step int, payload bytea)")
        setup.execute(
            f"INSERT INTO {table} (state) SELECT 'queued' FROM generate_series(1, %s)", (jobs,)
        )

    def drain(_number: int) -> None:
        with psycopg.connect(conninfo, autocommit=True) as connection:
            while True:
                row = connection.execute(
                    f"UPDATE {table} SET state = 'running' WHERE id = (SELECT id FROM {table} "
                    "WHERE state = 'queued' ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) "
                    "RETURNING id"
                ).fetchone()
                if row is None:
                    return
                with connection.transaction():
                    connection.execute(
                        "INSERT INTO job_steps VALUES (%s, 1, %s)", (row[0], b'{"n":1}')
                    )
                    connection.execute(f"UPDATE {table} SET state = 'done' WHERE id = %s", row)

    seconds = _in_threads(QUEUE_CAP, QUEUE_CAP, drain)
    return jobs / seconds


SIDES = {
    "loom": loom_side,
    "raw": raw_side,
    "dbos": dbos_side,
    "loom-queue": loom_queue_side,
    "skip-locked": skip_locked_side,
}


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
    parser.add_argument("--only-queues", action="store_true", help="the queue section alone")
    args = parser.parse_args()
    if args.side:
        print(json.dumps(SIDES[args.side](args.url, args.level, args.workflows, args.tag)))
        return

    from loom_store_postgres.testing import PostgresServer

    with PostgresServer(fsync=True) as server:
        url = server.store_url(schema="bench")
        rows: list[tuple[str, str]] = []
        for level in () if args.only_queues else LEVELS:
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
        queue_ratios, bound_ratios, queue_rates = [], [], []
        for number in range(args.rounds):
            loom_jobs = _child("loom-queue", url, 1, JOBS, f"q-{number}")
            plain_jobs = _child("loom-queue", url, 0, JOBS, f"p-{number}")
            raw_jobs = _child("skip-locked", url, 0, JOBS, f"q-{number}")
            assert loom_jobs is not None
            assert plain_jobs is not None
            assert raw_jobs is not None
            queue_ratios.append(loom_jobs / raw_jobs)
            bound_ratios.append(loom_jobs / plain_jobs)
            queue_rates.append((loom_jobs, plain_jobs, raw_jobs))
        rows.append(("queue, 2 workers: Loom jobs/s ÷ SKIP LOCKED jobs/s", _spread(queue_ratios)))
        rows.append(
            (
                "queue, 2 workers: Loom jobs/s with the queue ÷ without",
                _spread(bound_ratios),
            )
        )
        rows.append(
            (
                "queue, 2 workers: jobs/s (median)",
                f"loom queue {statistics.median(r[0] for r in queue_rates):,.0f}, "
                f"loom no queue {statistics.median(r[1] for r in queue_rates):,.0f}, "
                f"skip-locked {statistics.median(r[2] for r in queue_rates):,.0f}",
            )
        )
        width = max(len(name) for name, _ in rows)
        print(f"PostgreSQL {server.port}, fsync on; {args.workflows} workflows of {STEPS} steps")
        for name, value in rows:
            print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
