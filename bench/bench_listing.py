"""Listing runs: `Engine.runs()` and `loom ls` (from the run index) and `executions()`
(every journal) over a SQLite store of N ended runs, against a raw sqlite3
`SELECT id, status` of N rows; and the first `recover()` after those N starts with no
reader since, against one start: ratios from one run.

Run:

    python3 -m uv run python bench/bench_listing.py                # 100,000 runs
    python3 -m uv run python bench/bench_listing.py --runs 10000

The store holds N ended runs of a one-step flow (a tenth failed) and 10 parked ones.
Each listing is made by a new engine (as another process would: nothing cached),
median of 3; the raw side reads a table of N (id, status) rows in a database of its
own, median of 3.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sqlite3
import tempfile
import time
from collections.abc import Callable
from typing import Any

from loom_kernel import Context, Engine, flow, open_store
from loom_kernel._hosting._cli import main as loom_main
from timing import median_seconds

PARKED = 10


@flow(name="bench.listed")
def listed(ctx: Context, what: str) -> Any:
    ctx.step("only", lambda: what)
    if what == "fail":
        raise ValueError("asked to fail")
    if what == "park":
        ctx.suspend("go")
    return what


def _timed(func: Callable[[], object], repeat: int = 3) -> float:
    return median_seconds(func, repeat)


def _raw(folder: str, runs: int) -> float:
    path = os.path.join(folder, "raw.db")
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE runs (id TEXT PRIMARY KEY, status TEXT)")
    connection.executemany(
        "INSERT INTO runs VALUES (?, ?)",
        ((f"{number:032x}", "completed") for number in range(runs)),
    )
    connection.commit()
    connection.close()

    def select() -> None:
        reader = sqlite3.connect(path)
        assert len(reader.execute("SELECT id, status FROM runs").fetchall()) == runs
        reader.close()

    return _timed(select)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100_000)
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    url = f"sqlite:///{folder.lstrip('/')}/loom.db"
    with open_store(url + "?synchronous=off") as store:
        engine = Engine(store, [listed], listeners=[])
        for number in range(args.runs):
            engine.start("bench.listed", "fail" if number % 10 == 0 else "done")
        for number in range(PARKED):
            engine.start("bench.listed", "park", key=f"parked-{number}")
    total = args.runs + PARKED
    with open_store(url) as store:  # first: nothing has read the index since the starts
        began = time.perf_counter()
        Engine(store, [listed], listeners=[]).recover()
        first_recover = time.perf_counter() - began
        starter = Engine(store, [listed], listeners=[])
        one_start = _timed(lambda: starter.start("bench.listed", "done"), repeat=21)
    total += 21
    raw = _raw(folder, total)
    with open_store(url) as store:

        def runs() -> None:
            assert len(Engine(store, [listed], listeners=[]).runs()) == total

        def executions() -> None:
            assert sum(1 for _ in Engine(store, [listed], listeners=[]).executions()) == total

        listing = _timed(runs)
        journals = _timed(executions, repeat=1)

    def ls() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            assert loom_main(["ls", "--store", url]) == 0

    shell = _timed(ls)
    print(f"{total:,} runs ({PARKED} open); raw SELECT id, status: {raw * 1e3:.0f} ms")
    print(f"Engine.runs():  {listing * 1e3:7.0f} ms  {listing / raw:6.1f}x raw (goal <= 3x)")
    print(f"loom ls:        {shell * 1e3:7.0f} ms  {shell / raw:6.1f}x raw (goal <= 3x)")
    print(f"executions():   {journals * 1e3:7.0f} ms  {journals / raw:6.1f}x raw (every journal)")
    print(
        f"first recover() after the starts: {first_recover * 1e3:.0f} ms = "
        f"{first_recover / one_start:.0f}x one start ({one_start * 1e3:.2f} ms; goal <= 20x)"
    )


if __name__ == "__main__":
    main()
