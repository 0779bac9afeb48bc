"""What a worker under `nohup` shows: each run's start, takeover, failure, step retry
exhaustion and timer fire is one INFO line of the `loom` logger naming the run."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from loom_kernel import Context, Engine, MemoryStore, RetryPolicy, Status, flow
from loom_kernel.events import ExecutionStarted
from loom_kernel.testing import FakeClock

REMOTE = "other-host.1:4242:abcdef"


@flow(name="greets", version="1")
def greets(ctx: Context, name: str) -> Any:
    return ctx.step("greet", lambda: f"hello {name}")


@flow(name="raises", version="1")
def raises(ctx: Context, _input: Any) -> Any:
    raise ValueError("no such order")


def _flaky() -> Any:
    raise ConnectionError("the bank is down")


@flow(name="gives_up", version="1")
def gives_up(ctx: Context, _input: Any) -> Any:
    return ctx.step("charge", _flaky, retry=RetryPolicy(attempts=2, backoff=0.0))


@flow(name="dozes", version="1")
def dozes(ctx: Context, _input: Any) -> Any:
    ctx.sleep(5.0)
    return "awake"


FLOWS = [greets, raises, gives_up, dozes]


def _lines(caplog: pytest.LogCaptureFixture, execution_id: str) -> list[str]:
    """The INFO lines of the `loom` logger about one run."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "loom"
        and record.levelno == logging.INFO
        and execution_id in record.getMessage()
    ]


def test_a_start_is_logged_with_its_run_id_and_flow(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="loom")
    engine = Engine(MemoryStore(), FLOWS, listeners=[])
    run = engine.start("greets", "ada", key="greet-ada")
    assert _lines(caplog, "greet-ada") == ["loom: greet-ada started (greets)"]
    assert run.status is Status.COMPLETED
    engine.start("greets", "ada", key="greet-ada")  # the same key: no second start
    assert len(_lines(caplog, "greet-ada")) == 1


def test_a_failed_run_is_logged_with_its_error(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="loom")
    engine = Engine(MemoryStore(), FLOWS, listeners=[])
    assert engine.start("raises", key="bad-order").status is Status.FAILED
    assert "loom: bad-order failed: ValueError: no such order" in _lines(caplog, "bad-order")
    caplog.clear()
    engine.recover()  # a finished run driven again logs nothing
    assert _lines(caplog, "bad-order") == []


def test_a_step_out_of_retries_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="loom")
    engine = Engine(MemoryStore(), FLOWS, listeners=[])
    engine.start("gives_up", key="pay-1")
    assert (
        "loom: pay-1: step 'charge' failed after 2 attempt(s): ConnectionError: the bank is down"
    ) in _lines(caplog, "pay-1")


def test_a_timer_fire_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="loom")
    clock = FakeClock(1_000.0)
    engine = Engine(MemoryStore(), FLOWS, clock=clock, listeners=[])
    assert engine.start("dozes", key="nap-1").status is Status.SUSPENDED
    assert engine.fire_due_timers() == []
    assert not [line for line in _lines(caplog, "nap-1") if "timer" in line]
    clock.advance(6.0)
    assert engine.fire_due_timers() == ["nap-1"]
    assert "loom: nap-1: its timer fired" in _lines(caplog, "nap-1")
    assert engine.get("nap-1").result == "awake"


def test_a_takeover_is_logged_with_the_owner_it_took_from(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from loom_kernel._core import encode_event

    caplog.set_level(logging.INFO, logger="loom")
    store, clock = MemoryStore(), FakeClock(1_000.0)
    started = ExecutionStarted("greets", "version:1", '"bob"', "greet-bob", None, REMOTE)
    store.append("ex/greet-bob", 0, [encode_event(started, clock())])
    clock.advance(60.0)  # its owner not heard of for longer than the lease
    engine = Engine(store, FLOWS, clock=clock, lease=30.0, listeners=[])
    assert engine.recover() == ["greet-bob"]
    assert f"loom: greet-bob taken over from {REMOTE}" in _lines(caplog, "greet-bob")
    caplog.clear()
    engine.start("greets", "cy", key="greet-cy")  # a first claim of its own is no takeover
    engine.recover()
    assert not [line for line in _lines(caplog, "greet-cy") if "taken over" in line]
