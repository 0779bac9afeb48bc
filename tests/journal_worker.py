"""A worker process for the crash and concurrency tests on real stores (run as a script).

    python journal_worker.py crash STORE_URL SIDE_FILE EXECUTIONS STEPS
    python journal_worker.py race  STORE_URL SIDE_FILE EXECUTIONS STEPS

crash: recover what a killed predecessor left, start every execution (idempotent by
key) and drive them all to the end. race: the same, with a human gate in each flow
that every racing worker tries to resume (deduped by key), so workers collide.
Every step appends one line to SIDE_FILE before it returns: that is its side effect.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

from loom_kernel import (
    ConflictError,
    Context,
    Engine,
    LoomError,
    NotSuspendedError,
    RetryPolicy,
    Status,
    StoreUnavailableError,
    flow,
    open_store,
)


def main() -> int:
    mode, url, side_file, executions, steps = sys.argv[1:6]
    side = os.open(side_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def effect(execution_id: str, index: int) -> int:
        os.write(side, f"{execution_id}:{index}\n".encode())
        return index

    @flow(name="pipeline", version="1")
    def pipeline(ctx: Context, count: int) -> Any:
        done = [ctx.step(f"step-{i}", effect, ctx.execution_id, i) for i in range(count)]
        if mode == "race":
            done.append(ctx.suspend("approval"))
            done.append(ctx.step("after-gate", effect, ctx.execution_id, count))
        return done

    store = open_store(url)
    engine = Engine(store, [pipeline], retry=RetryPolicy(attempts=1))
    keys = [f"job-{number}" for number in range(int(executions))]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            engine.recover()
            for key in keys:
                view = engine.start("pipeline", int(steps), key=key)
                if view.status is Status.RUNNING:
                    engine.recover()
                elif view.status is Status.SUSPENDED:
                    with contextlib.suppress(ConflictError, NotSuspendedError):
                        # another worker may get there first; the dedupe key makes it once
                        engine.resume(key, "approved", key="approval-once", on="approval")
            if all(engine.get(key).status is Status.COMPLETED for key in keys):
                return 0
        except (ConflictError, StoreUnavailableError):
            continue  # a racing writer or a busy database: look again
        except LoomError as exc:
            print(f"worker error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    print("worker gave up: not every execution completed in time", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
