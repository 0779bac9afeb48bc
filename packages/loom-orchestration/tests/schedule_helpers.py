"""What the schedule tests share: a flow that notes each tick it ran, one that parks
until resumed (a run that lasts), engines on a fake clock, and the runs a schedule
started."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

from loom_kernel import Context, Engine, Execution, MemoryStore, flow
from loom_kernel.spi import JournalStore
from loom_kernel.testing import FakeClock

#: 2026-12-07T00:00:30Z: half a minute before a minute's tick.
BASE = datetime(2026, 12, 7, 0, 0, 30, tzinfo=UTC).timestamp()

_lock = threading.Lock()
ran: list[str] = []  # the ticks the `tick` flow ran, in order


@flow(name="tick", version="1")
def tick(ctx: Context, data: dict[str, Any]) -> Any:
    def note() -> str:
        with _lock:
            ran.append(data["tick"])
        return str(data["tick"])

    return ctx.step("note", note)


@flow(name="lasts", version="1")
def lasts(ctx: Context, data: dict[str, Any]) -> Any:
    """Runs until its timer: `input["input"]` seconds."""
    ctx.sleep(float(data["input"]))
    return data["tick"]


FLOWS = [tick, lasts]


def engine(
    store: JournalStore | None = None, clock: FakeClock | None = None, **options: Any
) -> Engine:
    """An engine with the schedule flows on a fake clock (the listeners installed:
    children and schedules)."""
    return Engine(store or MemoryStore(), FLOWS, clock=clock or FakeClock(BASE), **options)


def runs_of(engine: Engine, name: str) -> list[Execution]:
    """The runs a schedule started, by id (so by tick)."""
    return list(engine.executions(f"sched/{name}@"))


def reset() -> None:
    with _lock:
        ran.clear()
