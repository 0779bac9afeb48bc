"""The flow of the chain process tests: each run of the chain receives one message on
"tick" and rotates, counting, so a run is a message and a rotation."""

from __future__ import annotations

from typing import Any

from loom_kernel import Context, flow
from loom_orchestration import rotate


@flow(name="chain.step", version="1")
def step(ctx: Context, run: dict[str, Any]) -> Any:
    got = ctx.receive("tick")
    return rotate(ctx, {"count": run["carry"]["count"] + 1, "last": got})


FLOWS = [step]
