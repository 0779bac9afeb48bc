"""Behaviours that no test pinned until mutation sampling showed a change to each went
unnoticed (docs/contributing.md: the mutation sampler)."""

from __future__ import annotations

from typing import Any

import pytest
from loom_kernel import Context, Engine, InvalidIdError, MemoryStore, Status, flow
from loom_kernel._ids import validate_prefix, validate_stream_id
from loom_kernel.spi import InvalidArgumentError
from loom_kernel.testing import FakeClock, sandbox


@pytest.mark.parametrize("bad", [123, None, b"id", 1.5])
def test_an_execution_id_that_is_not_a_str_is_an_invalid_id(bad: Any) -> None:
    with pytest.raises(InvalidIdError, match="an execution id is a str"):
        Engine.stream_of(bad)


def test_the_id_limit_is_two_hundred_characters() -> None:
    assert validate_stream_id("x" * 200) == "x" * 200
    with pytest.raises(InvalidIdError, match="longer than 200"):
        validate_stream_id("x" * 201)
    assert validate_prefix("x" * 200) == "x" * 200
    with pytest.raises(InvalidIdError):
        validate_prefix("x" * 201)


@pytest.mark.parametrize("after", ["a//b", "/a", "a b", "../x", 7])
def test_a_listing_cursor_is_checked_like_a_prefix(after: Any) -> None:
    store = MemoryStore()
    with pytest.raises(InvalidArgumentError):
        store.streams("", after)


@flow(name="counter", version="1")
def counter(ctx: Context, _input: Any) -> Any:
    total = 0
    for number in range(5):
        total += ctx.step(f"n{number}", lambda number=number: number)
        ctx.suspend(f"g{number}")
    return total


def test_an_engine_whose_cached_copy_was_compacted_past_shows_the_current_state() -> None:
    box = sandbox(counter, listeners=[])
    run = box.engine.start("counter", key="c")
    box.engine.resume(run.id, 0)
    stale = box.new_engine()
    assert stale.get(run.id).waiting_on == "g1"  # cached at this position
    other = box.new_engine()
    for payload in (1, 2, 3):
        other.resume(run.id, payload)
    other.compact(run.id)  # the stale engine's next read after its position is trimmed
    assert stale.get(run.id) == other.get(run.id)
    assert stale.get(run.id).waiting_on == "g4"


class VanishingBucketStore(MemoryStore):
    """Deletes a timer bucket between the listing that names it and the read of it."""

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        names = super()._streams(prefix, after, limit)
        if prefix == "timers/" and names:
            super()._delete(names[0])
        return names


@flow(name="nap", version="1")
def nap(ctx: Context, seconds: float) -> str:
    ctx.sleep(seconds)
    return "woke"


def test_a_bucket_deleted_between_listing_and_reading_is_skipped() -> None:
    store, clock = VanishingBucketStore(), FakeClock(6000.0)
    engine = Engine(store, [nap], clock=clock, listeners=[])
    engine.start("nap", 10, key="first")  # minute 100: deleted under the poll
    engine.start("nap", 70, key="second")  # minute 101: fires
    clock.advance(100)
    assert engine.fire_due_timers() == ["second"]
    assert engine.get("first").status is Status.SUSPENDED, "its hint is gone, not doubled"
