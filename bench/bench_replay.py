"""Fold + replay throughput and its growth with history length, as ratios from one run.

Run: python3 -m uv run python bench/bench_replay.py [--sizes 1000,10000,100000]

A run with N recorded steps, parked at a gate, is resumed: the engine reads the
journal, decodes and folds it, re-runs the flow (every step answered from its frame)
and parks at the next gate. Cold: a fresh engine (nothing cached). Warm: the engine
that last drove it (folded state cached; only the replay of the flow's code remains).
The floor is one json.loads of the whole journal as a JSON array: the C parser's cost
for the bytes a cold resume cannot avoid reading.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from loom_kernel import Context, Engine, MemoryStore, flow
from loom_kernel.events import ExecutionStarted, ExecutionSuspended, StepCompleted, encode_event


@flow(name="long", version="1")
def long_run(ctx: Context, count: int) -> Any:
    for index in range(count):
        ctx.step(f"step-{index}", dict, n=index)
    while True:
        ctx.suspend("next")


def _journaled_run(store: MemoryStore, count: int) -> str:
    events: list[Any] = [ExecutionStarted("long", "version:1", count, "bench", None)]
    events += [StepCompleted(i, f"step-{i}", {"n": i, "ok": True}) for i in range(count)]
    events.append(ExecutionSuspended(0, "next"))
    records = [encode_event(e, 1.0) for e in events]
    for start in range(0, len(records), 10_000):
        store.append("ex/bench", start, records[start : start + 10_000])
    return "bench"


def _best(func: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        func()
        best = min(best, time.perf_counter() - began)
    return best


def _measure(size: int) -> tuple[float, float, float]:
    """Seconds for a cold resume, a warm resume, and parsing the journal's JSON."""
    store = MemoryStore()
    execution_id = _journaled_run(store, size)
    joined = b"[" + b",".join(r.payload for r in store.read("ex/bench")) + b"]"
    repeat = 5 if size <= 10_000 else 2
    cold = _best(lambda: Engine(store, [long_run]).resume(execution_id, None), repeat)
    warm_engine = Engine(store, [long_run])
    warm_engine.get(execution_id)
    warm = _best(lambda: warm_engine.resume(execution_id, None), repeat)
    floor = _best(lambda: json.loads(joined), repeat)
    return cold, warm, floor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1000,10000,100000")
    sizes = [int(size) for size in parser.parse_args().sizes.split(",")]
    print(
        f"{'steps':>8} {'cold events/s':>14} {'warm events/s':>14} {'cold/parse floor':>16} "
        f"{'cold per event vs 1st size':>27}"
    )
    first_per_event = None
    for size in sizes:
        cold, warm, floor = _measure(size)
        events = size + 2
        per_event = cold / events
        first_per_event = first_per_event or per_event
        print(
            f"{size:>8} {events / cold:>14,.0f} {events / warm:>14,.0f} {cold / floor:>15.2f}x "
            f"{per_event / first_per_event:>26.2f}x"
        )
    print("(cold/parse floor: a cold resume's cost over parsing the journal's JSON alone;")
    print(" the last column stays near 1 when a resume is linear in the history)")


if __name__ == "__main__":
    main()
