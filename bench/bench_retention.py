"""Retention on SQLite: what a sweep costs per deleted run, against deleting the same
rows by hand with raw sqlite3, its peak memory, and the disk a run takes before and
after it is deleted: ratios from one run.

Run:

    python3 -m uv run python bench/bench_retention.py                 # 100,000 runs
    python3 -m uv run python bench/bench_retention.py --runs 10000

1. N runs of a one-step flow are started (keyed, ended) on a SQLite store at
   synchronous=normal, and the same number of journals of the same shape are written
   to a raw sqlite3 table (one transaction per run, as Loom commits one).
2. `Engine.gc(Retention(keep_for=0))` deletes them all, batch by batch, under
   tracemalloc: the time per deleted run and the peak memory of the sweep.
3. Raw: `DELETE FROM records WHERE stream = ?` per run, one transaction each: the
   time per run. The ratio is Loom's sweep over raw.
4. The store's bytes (page count x page size, after VACUUM) before and after.
5. The disk a step takes: runs of 1 and of 11 steps on two fresh stores, the
   difference per extra step, against the bytes of the step result's own JSON (the
   goal is at most 3x).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import tempfile
import time
import tracemalloc
from typing import Any

from loom_kernel import Context, Engine, Retention, flow, open_store


@flow(name="bench.retained")
def retained(ctx: Context, value: int) -> Any:
    return ctx.step("work", lambda: {"value": value, "ok": True})


@flow(name="bench.steps")
def steps(ctx: Context, count: int) -> Any:
    result = None
    for number in range(count):
        result = ctx.step("work", lambda n=number: {"value": n, "ok": True})
    return result


def _per_step(folder: str, runs: int = 2_000) -> tuple[float, float, int]:
    """(bytes a run of one step takes, bytes each step more takes, bytes of a step
    result's JSON), on fresh SQLite stores."""
    sizes = []
    for count in (1, 11):
        path = os.path.join(folder, f"steps{count}.db")
        store = open_store(f"sqlite:///{path}?synchronous=normal")
        engine = Engine(store, [steps], listeners=[])
        for _ in range(runs):
            engine.start("bench.steps", count)
        store.close()
        sizes.append(_bytes(path))
    user = len(json.dumps({"value": 5, "ok": True}, separators=(",", ":")))
    return sizes[0] / runs, (sizes[1] - sizes[0]) / (10 * runs), user


def _bytes(path: str) -> int:
    connection = sqlite3.connect(path)
    connection.execute("VACUUM")
    pages = connection.execute("PRAGMA page_count").fetchone()[0]
    size = connection.execute("PRAGMA page_size").fetchone()[0]
    connection.close()
    return int(pages * size)


def _raw(path: str, runs: int) -> float:
    """Seconds per run to delete `runs` three-record journals by hand."""
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("PRAGMA journal_mode=wal")
    connection.execute("PRAGMA synchronous=normal")
    connection.execute(
        "CREATE TABLE records (stream TEXT, position INTEGER, kind TEXT, payload BLOB, "
        "timestamp REAL, PRIMARY KEY (stream, position)) WITHOUT ROWID"
    )
    payload = b'{"v":"1.21.0","d":{"index":0,"name":"work","result":{"value":1}}}'
    for number in range(runs):
        connection.execute("BEGIN")
        connection.executemany(
            "INSERT INTO records VALUES (?, ?, ?, ?, ?)",
            [(f"ex/r{number}", position, "k", payload, 1.0) for position in (1, 2, 3)],
        )
        connection.execute("COMMIT")
    began = time.perf_counter()
    for number in range(runs):
        connection.execute("BEGIN")
        connection.execute("DELETE FROM records WHERE stream = ?", (f"ex/r{number}",))
        connection.execute("COMMIT")
    spent = time.perf_counter() - began
    connection.close()
    return spent / runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100_000)
    args = parser.parse_args()
    runs = args.runs
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "loom.db")
    store = open_store(f"sqlite:///{path}?synchronous=normal")
    engine = Engine(store, [retained], listeners=[])
    for number in range(runs):
        engine.start("bench.retained", number, key=f"r{number}")
    store.close()
    before = _bytes(path)
    store = open_store(f"sqlite:///{path}?synchronous=normal")
    engine = Engine(store, [retained], listeners=[])
    retention = Retention(keep_for=0, batch=5_000)
    tracemalloc.start()
    began = time.perf_counter()
    deleted = 0
    while True:
        swept = engine.gc(retention)
        deleted += len(swept.deleted)
        if not swept.more:
            break
    spent = time.perf_counter() - began
    _current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    store.close()
    after = _bytes(path)
    raw = _raw(os.path.join(folder, "raw.db"), runs)
    per_run = spent / max(deleted, 1)
    print(f"runs deleted: {deleted:,} of {runs:,}")
    print(f"sweep per run: {per_run * 1e6:,.0f} us; raw DELETE per run: {raw * 1e6:,.0f} us")
    print(f"ratio sweep / raw: {per_run / raw:.1f}x")
    print(f"peak memory of the sweep: {peak / 2**20:.1f} MiB ({peak / max(runs, 1):.0f} B a run)")
    print(
        f"store bytes: {before:,} before, {after:,} after "
        f"({before / max(runs, 1):.0f} -> {after / max(runs, 1):.0f} B a run)"
    )
    one_step, per_step, user = _per_step(folder)
    print(
        f"disk per step: {per_step:.0f} B for a {user}-byte result, "
        f"{per_step / user:.1f}x its JSON (goal <= 3x); a one-step run {one_step:.0f} B"
    )


if __name__ == "__main__":
    main()
