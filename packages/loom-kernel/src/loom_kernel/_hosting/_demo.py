"""`loom demo`: an order-approval flow with a step, two human gates and a timer."""

from __future__ import annotations

import uuid
from typing import Any

from loom_kernel._engine import Engine
from loom_kernel._replay import Context, flow
from loom_kernel._spi import FakeClock, open_store
from loom_kernel._tools import format_timeline

__all__ = ["run_demo"]


def _price(order: dict[str, Any]) -> dict[str, Any]:
    total = sum(line["qty"] * line["price"] for line in order["lines"])
    return {"total": round(total, 2), "currency": "EUR"}


@flow(name="approval", version="1")
def approval(ctx: Context, order: dict[str, Any]) -> dict[str, Any]:
    quote = ctx.step("quote", _price, order)
    manager = ctx.suspend("manager")
    ctx.sleep(3600)  # a cooling-off hour before finance looks at it
    finance = ctx.suspend("finance")
    return {"order": order["id"], "quote": quote, "manager": manager, "finance": finance}


def run_demo(url: str, say: Any = print) -> int:
    """Run the demo on the store at `url`, narrating as it goes. Returns an exit status."""
    clock = FakeClock(start=1_767_225_600.0)  # the demo moves its own clock: no waiting
    order = {"id": "order-7", "lines": [{"sku": "loom", "qty": 2, "price": 19.5}]}
    with open_store(url) as store:
        engine = Engine(store, [approval], clock=clock)
        say(f"Loom demo on {url}: an order approval with a step, two gates and a timer.\n")
        execution = engine.start("approval", order, key=f"demo-{uuid.uuid4().hex[:8]}")
        say(f"start      → {execution.status}, waiting on {execution.waiting_on!r}")
        execution = engine.resume(execution.id, {"approved": True, "by": "maria"})
        say(f"manager ok → {execution.status}, sleeping until the timer is due")
        say(f"timers now → woke {engine.fire_due_timers()} (nothing is due yet)")
        clock.advance(3600)
        woken = engine.fire_due_timers()
        say(f"+1 hour    → woke {woken}; now waiting on {engine.get(execution.id).waiting_on!r}")
        execution = engine.resume(execution.id, {"approved": True, "by": "li"})
        say(f"finance ok → {execution.status}: {execution.result}\n")
        say(f"Timeline of execution {execution.id} (its journal):")
        say(format_timeline(engine.history(execution.id)))
        again = engine.start("approval", order, key=execution.id)
        say(f"\nStarting it again with the same key returns the same run: {again.status}.")
    return 0
