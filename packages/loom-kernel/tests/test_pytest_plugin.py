"""The pytest plugin as a user meets it: `loom_engine`, `loom_clock`, `loom_advance`
and `loom_store` (this test runs once on each kind `--loom-stores` names: memory and
SQLite by default), nothing shared between tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from loom_kernel import Context, Engine, MemoryStore, Status, flow
from loom_kernel.spi import JournalStore
from loom_kernel.testing import FakeClock

pytest_plugins = ["pytester"]


@flow(name="plugin.reminder", version="1")
def reminder(ctx: Context, hours: float) -> Any:
    ctx.sleep(hours * 3600)
    return ctx.step("send", lambda: "reminded")


def test_a_flow_that_sleeps_is_driven_by_advancing_the_clock(
    loom_engine: Callable[..., Engine],
    loom_advance: Callable[[Engine, float], list[str]],
    loom_clock: FakeClock,
) -> None:
    engine = loom_engine(reminder)
    run = engine.start("plugin.reminder", 2, key="r")
    assert run.status is Status.SUSPENDED
    assert loom_advance(engine, 3600) == []
    assert loom_advance(engine, 3600) == ["r"]
    assert engine.get("r").result == "reminded"
    assert loom_clock() == FakeClock()() + 7200


def test_each_test_gets_a_fresh_store_of_each_kind(
    loom_store: JournalStore, request: pytest.FixtureRequest
) -> None:
    assert list(loom_store.streams()) == [], "nothing left by another test"
    kind = request.node.callspec.params["loom_store"]
    assert kind in ("memory", "sqlite")
    assert isinstance(loom_store, MemoryStore) == (kind == "memory")


def test_the_stores_are_chosen_on_the_command_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_one(loom_store):
            assert loom_store is not None
        """
    )
    result = pytester.runpytest("-p", "no:xdist", "--loom-stores", "memory", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_one?memory? PASSED*"])
    bad = pytester.runpytest("-p", "no:xdist", "--loom-stores", "mongo")
    assert bad.ret != 0
    bad.stdout.fnmatch_lines(["*--loom-stores takes memory, sqlite, s3, postgres*"])


def test_a_test_runs_on_postgresql_when_asked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from loom_kernel.spi import NewRecord

        def test_one(loom_store):
            assert type(loom_store).__name__ == "PostgresStore"
            assert loom_store.append("s", 0, [NewRecord("k", b"1", 1.0)]) == 1
        """
    )
    result = pytester.runpytest("-p", "no:xdist", "--loom-stores", "postgres", "-v")
    result.assert_outcomes(passed=1)
