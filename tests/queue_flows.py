"""The flows and queues of the queue process tests.

A `queued_job` step appends `start <run> <key> <time>` and, after `seconds`, `end <run>
<key> <time>` to the file named by LOOM_QUEUE_SIDE, so the test can tell how many
runs were in their step at once, across processes. While the file named by the job's
`hold` (or by LOOM_QUEUE_HOLD) exists, the step waits first (up to a minute).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from loom_kernel import Context, Queue, flow

QUEUES = [Queue("capped", concurrency=3), Queue("keyed", per_key=1)]


def _line(text: str) -> None:
    handle = os.open(os.environ["LOOM_QUEUE_SIDE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(handle, f"{text}\n".encode())
    finally:
        os.close(handle)


def _work(run: str, key: str, seconds: float, hold: str | None) -> str:
    _line(f"start {run} {key} {time.time():.6f}")
    deadline = time.monotonic() + 60
    if hold:
        while Path(hold).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    time.sleep(seconds)
    _line(f"end {run} {key} {time.time():.6f}")
    return run


@flow(name="queued_job", version="1")
def queued_job(ctx: Context, job: dict[str, Any]) -> Any:
    run = ctx.execution_id
    hold = job.get("hold") or os.environ.get("LOOM_QUEUE_HOLD")
    first = ctx.step("work", lambda: _work(run, job.get("key") or "-", job["seconds"], hold))
    return ctx.step("after", lambda: first + ":after")


FLOWS = [queued_job]
