"""`Engine.fork`: a run that ended starts again as a new run, with the same input and
`retry_of` naming the old one; with `from_step`, the old run's first step outcomes
are reused, not run again (DBOS's fork); refused for a run still going, past a gate,
over the kernel's own steps, or below a compaction."""

from __future__ import annotations

from typing import Any

import pytest
from loom_kernel import (
    Context,
    Engine,
    ExecutionNotFoundError,
    InvalidArgumentError,
    MemoryStore,
    RetryPolicy,
    Status,
    flow,
)

effects: list[str] = []
broken = {"charge": True}


def _effect(name: str, value: Any) -> Any:
    effects.append(name)
    if name == "charge" and broken["charge"]:
        raise ValueError("card declined")
    return value


@flow(name="fork.order", version="1")
def order(ctx: Context, total: int) -> Any:
    quote = ctx.step("quote", lambda: _effect("quote", total * 2))
    reserved = ctx.step("reserve", lambda: _effect("reserve", "r-1"))
    return ctx.step("charge", lambda: _effect("charge", {"quote": quote, "hold": reserved}))


@flow(name="fork.gated", version="1")
def gated(ctx: Context, _input: Any) -> Any:
    ctx.step("before", lambda: 1)
    ctx.suspend("ok")
    ctx.step("after", lambda: 2)
    raise ValueError("still broken")


@flow(name="fork.publishes", version="1")
def publishes(ctx: Context, _input: Any) -> Any:
    ctx.set_event("progress", 1)
    raise ValueError("broken")


@pytest.fixture(autouse=True)
def fresh() -> None:
    effects.clear()
    broken["charge"] = True


def _engine(store: MemoryStore | None = None) -> Engine:
    no_wait = RetryPolicy(attempts=3, backoff=0)
    return Engine(store or MemoryStore(), [order, gated, publishes], listeners=[], retry=no_wait)


def test_a_failed_run_started_again_reuses_its_first_steps_and_names_the_old_one() -> None:
    e = _engine()
    old = e.start("fork.order", 21, key="o-1")
    assert old.status is Status.FAILED
    assert effects == ["quote", "reserve", "charge", "charge", "charge"]
    effects.clear()
    broken["charge"] = False
    new = e.fork("o-1", from_step=2)
    assert new.id != "o-1"
    assert (new.status, new.retry_of, new.input) == (Status.COMPLETED, "o-1", 21)
    assert new.result == {"quote": 42, "hold": "r-1"}
    assert effects == ["charge"], "the first two steps were reused, not run"
    assert e.get("o-1").status is Status.FAILED, "the old run is left as it was"
    again = e.fork("o-1", key="o-1-again")
    assert effects == ["charge", "quote", "reserve", "charge"], "from_step=0 runs it all"
    assert e.fork("o-1", key="o-1-again").position == again.position, "a K9 start"


def test_a_fork_is_refused_for_a_run_still_going_past_a_gate_or_over_the_kernels_steps() -> None:
    e = _engine()
    e.start("fork.gated", key="g")
    with pytest.raises(InvalidArgumentError, match="suspended: only a run that ended"):
        e.fork("g")
    e.resume("g", "yes")
    assert e.get("g").status is Status.FAILED
    assert e.fork("g", from_step=1, key="g1").retry_of == "g"
    with pytest.raises(InvalidArgumentError, match="from_step is at most 1 for g"):
        e.fork("g", from_step=2)
    e.start("fork.publishes", key="p")
    with pytest.raises(InvalidArgumentError, match="from_step is at most 0 for p"):
        e.fork("p", from_step=1)
    for bad in (-1, True, 1.5):
        with pytest.raises(InvalidArgumentError, match="from_step is a whole number"):
            e.fork("g", from_step=bad)  # type: ignore[arg-type]
    with pytest.raises(ExecutionNotFoundError):
        e.fork("nobody")


def test_a_compacted_run_can_only_be_run_again_from_the_start() -> None:
    e = _engine()
    e.start("fork.order", 1, key="c")
    e.compact("c")
    with pytest.raises(InvalidArgumentError, match="compacted"):
        e.fork("c", from_step=1)
    assert e.fork("c").retry_of == "c"


def test_an_engine_without_the_code_journals_the_fork_for_a_worker() -> None:
    store = MemoryStore()
    worker = _engine(store)
    worker.start("fork.order", 5, key="w")
    broken["charge"] = False
    web = Engine(store, [], listeners=[])
    forked = web.fork("w", from_step=2)
    assert (forked.status, forked.owner, forked.retry_of) == (Status.RUNNING, None, "w")
    effects.clear()
    assert worker.recover() == [forked.id]
    assert worker.get(forked.id).result == {"quote": 10, "hold": "r-1"}
    assert effects == ["charge"]
