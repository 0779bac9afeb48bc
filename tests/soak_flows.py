"""The flows of the worker soak test: steps, a timer, a human gate and a child.

Every step appends `<run id>:<step>` to the file named by LOOM_SOAK_SIDE (its side
effect), so the test can count how often each step really ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

from loom_kernel import AsyncContext, Context, flow
from loom_orchestration import await_child


def _effect(run: str, step: str) -> str:
    line = f"{run}:{step}\n".encode()
    handle = os.open(os.environ["LOOM_SOAK_SIDE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(handle, line)
    finally:
        os.close(handle)
    return step


@flow(name="soak_child", version="1")
def soak_child(ctx: Context, number: int) -> Any:
    return ctx.step("child-step", lambda: _effect(ctx.execution_id, "child-step")) + str(number)


@flow(name="soak_job", version="1")
def soak_job(ctx: Context, number: int) -> Any:
    """Steps for every run; a short timer for every third, a child for every fourth,
    a human gate for every fifth."""
    run = ctx.execution_id
    done = [
        ctx.step(f"s{index}", lambda index=index: _effect(run, f"s{index}")) for index in range(3)
    ]
    if number % 3 == 0:
        ctx.sleep(0.3)
    if number % 4 == 0:
        done.append(await_child(ctx, soak_child, number))
    if number % 5 == 0:
        done.append(ctx.suspend("approve"))
    done.append(ctx.step("last", lambda: _effect(run, "last")))
    return done


def _wait_while_flagged() -> str:
    flag = os.environ.get("LOOM_SOAK_FLAG", "")
    deadline = time.monotonic() + 120
    while flag and os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.02)
    return "waited"


@flow(name="soak_slow", version="1")
def soak_slow(ctx: Context, _input: Any) -> Any:
    """One step that waits while the file named by LOOM_SOAK_FLAG exists, then another."""
    first = ctx.step("wait", lambda: _effect(ctx.execution_id, "wait") and _wait_while_flagged())
    return [first, ctx.step("after", lambda: _effect(ctx.execution_id, "after"))]


@flow(name="soak_strays", version="1")
async def soak_strays(ctx: AsyncContext, _input: Any) -> Any:
    """A step that leaves a thread running (waiting while the flag file exists) when a
    timeout stops it awaiting that thread."""

    async def leave_a_thread() -> str:
        def stray() -> str:
            _effect(ctx.execution_id, "stray")
            return _wait_while_flagged()

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.to_thread(stray), 0.05)
        return "left"

    return await ctx.step("leave", leave_a_thread)


FLOWS = [soak_job, soak_child, soak_slow, soak_strays]
