"""pytest fixtures for testing your own flows, loaded by pytest itself once Loom is
installed (the `pytest11` entry point; the `testing` extra brings pytest):

- `loom_clock`: a `FakeClock` of the test's own;
- `loom_store`: a fresh store, the test run once on each kind `--loom-stores` names
  (default `memory,sqlite`; `s3` runs on moto, from loom-store-s3's testing extra;
  `postgres` on a throwaway cluster, from loom-store-postgres);
- `loom_engine(*flows, **options)`: an `Engine` on both, made for this test;
- `loom_advance(engine, seconds)`: move the clock and fire what came due; the ids of
  the runs it woke.

Nothing is shared between tests: each gets a new clock, store and engines, so there is
no global state to reset.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loom_kernel._engine import Engine
from loom_kernel._replay import Flow
from loom_kernel._spi import FakeClock, JournalStore, open_store
from loom_kernel._spi._memory_store import MemoryStore

__all__ = [
    "STORE_KINDS",
    "loom_advance",
    "loom_clock",
    "loom_engine",
    "loom_store",
    "pytest_addoption",
    "pytest_generate_tests",
]

#: The kinds of store `loom_store` can be: memory (built in), sqlite
#: (loom-store-sqlite), s3 (loom-store-s3 with its testing extra: moto), postgres
#: (loom-store-postgres: a throwaway cluster, with PostgreSQL's server installed).
STORE_KINDS = ("memory", "sqlite", "s3", "postgres")
_DISTRIBUTION = {
    "sqlite": "loom_store_sqlite",
    "s3": "loom_store_s3",
    "postgres": "loom_store_postgres",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--loom-stores",
        default="memory,sqlite",
        help="the stores `loom_store` runs each test on, comma-separated, of "
        f"{', '.join(STORE_KINDS)} (default: memory,sqlite)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "loom_store" not in metafunc.fixturenames:
        return
    option = str(metafunc.config.getoption("--loom-stores"))
    kinds = [kind.strip() for kind in option.split(",") if kind.strip()]
    unknown = sorted(set(kinds) - set(STORE_KINDS))
    if unknown or not kinds:
        raise pytest.UsageError(
            f"--loom-stores takes {', '.join(STORE_KINDS)}, comma-separated, not {option!r}"
        )
    metafunc.parametrize("loom_store", kinds, indirect=True)


@pytest.fixture
def loom_clock() -> FakeClock:
    """A fake clock of this test's own: time moves only when the test moves it."""
    return FakeClock()


@pytest.fixture
def loom_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[JournalStore]:
    """A fresh, empty store of the kind this run of the test is for."""
    kind = getattr(request, "param", "memory")
    distribution = _DISTRIBUTION.get(kind)
    if distribution is not None and importlib.util.find_spec(distribution) is None:
        pytest.skip(f"{distribution} is not installed: no {kind} store to test on")
    if kind == "memory":
        yield MemoryStore()
        return
    if kind == "sqlite":
        with open_store(f"sqlite:///{tmp_path}/loom.db") as store:
            yield store
        return
    if kind == "postgres":
        yield from _postgres_store()
        return
    from loom_store_s3.testing import MotoServer  # noqa: PLC0415 - only where asked for

    with MotoServer() as server:
        bucket = server.new_bucket()
        url = f"s3://{bucket}/test?endpoint_url={server.endpoint_url}"
        with pytest.MonkeyPatch.context() as patched:
            for name, value in server.environment().items():
                patched.setenv(name, value)
            with open_store(url) as store:
                yield store


def _postgres_store() -> Iterator[JournalStore]:
    """A store on a PostgreSQL cluster of the test's own (started in about a second)."""
    from loom_store_postgres.testing import (  # noqa: PLC0415 - only where asked for
        PostgresServer,
        find_programs,
    )

    if find_programs() is None:
        pytest.skip("PostgreSQL's server is not installed (initdb, pg_ctl): no postgres store")
    with PostgresServer() as server, open_store(server.store_url()) as store:
        yield store


@pytest.fixture
def loom_engine(loom_store: JournalStore, loom_clock: FakeClock) -> Callable[..., Engine]:
    """Makes an `Engine` with these flows on this test's store and clock (the
    installed listeners load as in production; pass `listeners=[]` for none)."""

    def make(*flows: Flow | Callable[..., Any], **options: Any) -> Engine:
        options.setdefault("clock", loom_clock)
        return Engine(loom_store, list(flows), **options)

    return make


@pytest.fixture
def loom_advance(loom_clock: FakeClock) -> Callable[[Engine, float], list[str]]:
    """Moves this test's clock on by `seconds` and fires the timers that came due on
    `engine`; the ids of the runs it woke."""

    def advance(engine: Engine, seconds: float) -> list[str]:
        loom_clock.advance(seconds)
        return engine.fire_due_timers()

    return advance
