"""Fresh stores of each kind the runtime runs on: `new_store` (memory, SQLite, moto, PostgreSQL)
for any test (a plugin of the top conftest), and `store_maker` for a test module's
own mix of kinds."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from loom_kernel import MemoryStore, open_store
from loom_kernel.spi import JournalStore

StoreFactory = Callable[[], JournalStore]


def store_maker(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, opened: list[JournalStore]
) -> StoreFactory:
    """A maker of fresh, empty stores of `kind` (memory, sqlite, postgres (a schema of
    the session's cluster), or a local S3 server's: moto, rgw), each added to `opened`
    for the caller to close."""

    def make() -> JournalStore:
        if kind == "memory":
            store: JournalStore = MemoryStore()
        elif kind == "sqlite":
            store = open_store(f"sqlite:///{tempfile.mkdtemp(dir=tmp_path)}/loom.db")
        elif kind == "postgres":
            store = request.getfixturevalue("postgres_server").store()
        else:
            store = request.getfixturevalue(f"{kind}_server").store()
        opened.append(store)
        return store

    make.kind = kind  # type: ignore[attr-defined]
    return make


@pytest.fixture(params=["memory", "sqlite", "moto", "postgres"])
def new_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    """Fresh stores: in memory, on SQLite, on S3 (moto), on PostgreSQL."""
    opened: list[JournalStore] = []
    yield store_maker(request, tmp_path, request.param, opened)
    for store in opened:
        store.close()
