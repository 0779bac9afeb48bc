"""The workload of tests/test_power_loss.py (run as a script, with tests/durable_copy.c
loaded): runs of three steps started one after another on a SQLite store at
synchronous=full, every fifth parked at a gate; each run's id printed once `start`
returned it (acknowledged), then "finished", and the store is held open until stdin
ends (a closed store checkpoints: the test kills the process before that). With
LOOM_COMPACT_OFTEN set, the run index compacts a partition every second close.

    python power_loss_flow.py DATABASE RUNS
"""

from __future__ import annotations

import os
import sys

from loom_kernel import Context, Engine, flow, open_store


@flow(name="power.three")
def three(ctx: Context, number: int) -> int:
    for index in range(3):
        ctx.step(f"step-{index}", lambda i=index: {"n": number, "i": i})
    if number % 5 == 4:
        ctx.suspend("go")
    return number


def main() -> int:
    database, runs = sys.argv[1], int(sys.argv[2])
    if os.environ.get("LOOM_COMPACT_OFTEN"):  # the run index compacts every 2 closes
        from loom_kernel._coordination import _run_index

        setattr(_run_index, "_COMPACT_AT", 2)  # noqa: B010 (Final to mypy)
        setattr(_run_index, "_COMPACT_EVERY", 2)  # noqa: B010
    with open_store(f"sqlite:///{database.lstrip('/')}?synchronous=full") as store:
        engine = Engine(store, [three], listeners=[])
        for number in range(runs):
            view = engine.start("power.three", number)
            print(f"{view.status.value} {view.id}", flush=True)
        print("finished", flush=True)
        sys.stdin.read()  # until the test closes it (or kills this process first)
    return 0


if __name__ == "__main__":
    sys.exit(main())
