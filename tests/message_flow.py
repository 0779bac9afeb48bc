"""The flow the message process tests drive: it receives three messages, and after
each journals a step whose side effect appends the message to a file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from loom_kernel import Context, Flow, flow


def consume(side: Path, die_on: str | None = None) -> Flow:
    """Receive 3 messages; the step after each appends it to `side` (and, for the
    message `die_on`, kills its process right after that side effect)."""

    def effect(message: str) -> str:
        handle = os.open(side, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(handle, f"{message}\n".encode())
        os.close(handle)
        if message == die_on:
            os.kill(os.getpid(), 9)  # between the receive and its step's record
        return message

    @flow(name="consume", version="1")
    def consume_flow(ctx: Context, count: int) -> Any:
        got = []
        for index in range(count):
            message = ctx.receive(timeout=3600)
            got.append(ctx.step(f"effect{index}", effect, message))
        return got

    return consume_flow
