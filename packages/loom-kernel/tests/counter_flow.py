"""`counter`, the flow several test files start and read: five steps, each followed by
a gate, and the total at the end."""

from __future__ import annotations

from typing import Any

from loom_kernel import Context, flow


@flow(name="counter", version="1")
def counter(ctx: Context, _input: Any) -> Any:
    total = 0
    for number in range(5):
        total += ctx.step(f"n{number}", lambda number=number: number)
        ctx.suspend(f"g{number}")
    return total
