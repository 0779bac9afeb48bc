"""loom_kernel.testing.sandbox: an engine, a fake clock and a memory store in one call."""

from __future__ import annotations

from typing import Any

from loom_kernel import Context, Status, flow
from loom_kernel.testing import sandbox

calls: list[str] = []


@flow
def remind(ctx: Context, _input: Any) -> Any:
    def flaky() -> str:
        calls.append("try")
        if len(calls) < 3:
            raise ConnectionError("not yet")
        return "sent"

    ctx.sleep(3600)
    return ctx.step("send", flaky)


def test_engines_of_a_sandbox_share_its_store_and_clock_and_never_wait() -> None:
    calls.clear()
    box = sandbox(remind)
    run = box.engine.start("remind")
    assert run.status is Status.SUSPENDED
    other = box.new_engine()  # another process over the same store
    assert other is not box.engine
    assert other.fire_due_timers() == []
    box.clock.advance(3600)
    assert other.fire_due_timers() == [run.id]  # default retries, no real waits
    assert box.engine.get(run.id).result == "sent"
    assert calls == ["try", "try", "try"]


def test_the_clock_and_sandbox_need_no_extra_and_the_kit_names_the_one_it_needs() -> None:
    """flows.md sends tests to `loom_kernel.testing.FakeClock`; without the `testing`
    extra that import failed with a bare `No module named 'hypothesis'`."""
    import subprocess
    import sys

    script = """
import sys
sys.modules["hypothesis"] = None  # as if the extra were not installed
from loom_kernel.testing import FakeClock, sandbox
print(FakeClock(5.0)())
try:
    from loom_kernel.testing import StoreContract
except ImportError as exc:
    print(exc)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    clock, error = done.stdout.splitlines()
    assert clock == "5.0"
    assert error == (
        "loom_kernel.testing.StoreContract needs the 'testing' extra (hypothesis is not "
        "installed): pip install 'loom-kernel[testing]'"
    )
