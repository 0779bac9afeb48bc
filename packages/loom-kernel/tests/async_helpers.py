"""What the async-flow tests share: a coroutine step that ends at once, and a sync step
that takes a fifth of a second."""

from __future__ import annotations

import time


async def instant() -> str:
    return "done"


def _slow_step() -> str:
    time.sleep(0.2)
    return "slow"
