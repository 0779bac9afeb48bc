"""The flow of the schedule process tests: each run notes `<tick> <pid>` in the file
named by LOOM_SCHEDULE_SIDE from its one step (so a tick whose step ran twice, in two
processes or one, shows twice), then ends."""

from __future__ import annotations

import os
from typing import Any

from loom_kernel import Context, flow


def _note(tick: str) -> str:
    handle = os.open(
        os.environ["LOOM_SCHEDULE_SIDE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
    )
    try:
        os.write(handle, f"{tick} {os.getpid()}\n".encode())
    finally:
        os.close(handle)
    return tick


@flow(name="stamp", version="1")
def stamp(ctx: Context, data: dict[str, Any]) -> Any:
    return ctx.step("note", lambda: _note(data["tick"]))


FLOWS = [stamp]
