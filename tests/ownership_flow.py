"""The flow the ownership tests drive from two processes: one slow step, then another."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from loom_kernel import Context, Flow, flow


def slow_then_after(side: Path, flag: Path) -> Flow:
    """A flow whose first step records itself in `side`, then waits while `flag` exists."""

    def slow() -> str:
        handle = os.open(side, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(handle, b"slow\n")
        os.close(handle)
        deadline = time.monotonic() + 60
        while flag.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return "slow done"

    @flow(name="slow_then_after", version="1")
    def slow_then_after(ctx: Context, _input: Any) -> Any:
        return [ctx.step("slow", slow), ctx.step("after", lambda: "after")]

    return slow_then_after
