"""What the message tests share: flows that receive twice, receive after a gate,
receive with a deadline, wait at a gate with a deadline, wait for the first of several
things and publish their progress, and engines of them on a fake clock."""

from __future__ import annotations

from typing import Any

from loom_kernel import Context, Engine, GateTimeoutError, flow
from loom_kernel.spi import JournalStore
from loom_kernel.testing import FakeClock


@flow(name="inbox.two")
def two(ctx: Context, topic: str | None) -> Any:
    return [ctx.receive(topic), ctx.receive(topic)]


@flow(name="inbox.gated")
def gated(ctx: Context, _input: Any) -> Any:
    ctx.suspend("go")
    return [ctx.receive(), ctx.receive(timeout=0)]


@flow(name="inbox.patient")
def patient(ctx: Context, timeout: float) -> Any:
    first = ctx.receive("t", timeout=timeout)
    second = ctx.receive("t", timeout=timeout)
    return [first, second]


@flow(name="inbox.deadline")
def deadline(ctx: Context, timeout: float) -> Any:
    try:
        return ctx.suspend("approve", timeout=timeout)
    except GateTimeoutError as exc:
        return f"timed out after {exc.timeout:g} ({exc.execution_id}, {exc.gate}): {exc}"


@flow(name="inbox.first")
def first(ctx: Context, gates: list[str]) -> Any:
    woken = ctx.wait_first(gates=gates, topics=["cancel"], timeout=60)
    return [woken.kind, woken.name, woken.value]


@flow(name="inbox.progress")
def progress(ctx: Context, steps: int) -> Any:
    for index in range(steps):
        ctx.step(f"s{index}", lambda: None)
        ctx.set_event("done", index + 1)
    ctx.suspend("finish")
    return "finished"


FLOWS = [two, gated, patient, deadline, first, progress]


def _engine(store: JournalStore, clock: FakeClock | None = None, **options: Any) -> Engine:
    return Engine(store, FLOWS, clock=clock or FakeClock(), listeners=[], **options)
