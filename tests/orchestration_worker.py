"""A worker process for the orchestration crash tests (run as a script).

    python orchestration_worker.py DB MODE [CRASH_AT]

MODE start: start the parent `order-1` (its child parks at a human gate when
CRASH_AT is "gated", else it charges and ends). MODE resume-child: approve the
child. MODE recover: recover until the parent has completed. CRASH_AT names the
moment the process SIGKILLs itself: child-started, child-completed, parent-notified.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from loom_kernel import Context, Engine, Execution, Status, flow, open_store
from loom_kernel._engine._listeners import installed_listeners
from loom_orchestration import await_child


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    db, mode = sys.argv[1], sys.argv[2]
    crash_at = sys.argv[3] if len(sys.argv) > 3 else ""

    @flow(name="payment", version="1")
    def payment(ctx: Context, amount: int) -> Any:
        if crash_at == "gated":
            ctx.suspend("approve")

        def charge() -> dict[str, int]:
            if crash_at == "child-started":
                die()
            return {"charged": amount}

        return ctx.step("charge", charge)

    @flow(name="order", version="1")
    def order(ctx: Context, total: int) -> Any:
        receipt = await_child(ctx, payment, total)

        def ship() -> str:
            if crash_at == "parent-notified":
                die()
            return "shipped"

        return {"receipt": receipt, "shipping": ctx.step("ship", ship)}

    def killer(_engine: Engine, execution: Execution) -> None:
        if (
            crash_at == "child-completed"
            and execution.id == "order-1/c0"
            and execution.status.finished
        ):
            die()  # the child's end is journaled; its notice to the parent never goes out

    store = open_store(f"sqlite://{db}?timeout=30")
    engine = Engine(store, [order, payment], listeners=[killer, *installed_listeners()])
    if mode == "start":
        engine.start("order", 10, key="order-1")
    elif mode == "resume-child":
        engine.resume("order-1/c0", "approved", key="approval")
    elif mode == "recover":
        deadline = time.monotonic() + 60
        while engine.get("order-1").status is not Status.COMPLETED:
            if time.monotonic() > deadline:
                return 1
            engine.recover()
    return 0


if __name__ == "__main__":
    sys.exit(main())
