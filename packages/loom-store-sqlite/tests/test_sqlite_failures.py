"""SQLite's failures as the kernel's errors: locks at open, damaged or foreign files,
missing directories, lost rows and tables, each a refusal that lasts or a fault that
will pass."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from loom_kernel import Context, Engine, flow, open_store
from loom_kernel.spi import (
    LoomError,
    NewRecord,
    SchemaError,
    StoreMisconfiguredError,
    StoreUnavailableError,
)
from loom_store_sqlite import SqliteStore, open_sqlite_store
from loom_store_sqlite.testing import open_connections, raw_connection


def _records(count: int, tag: str = "r") -> list[NewRecord]:
    return [NewRecord("k", f"{tag}{i}".encode(), float(i)) for i in range(count)]


def test_open_and_append_on_a_write_locked_database_raise_the_same_error(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.db"
    existing = tmp_path / "existing.db"
    open_sqlite_store(f"sqlite://{existing}").close()
    blockers = []
    for path in (fresh, existing):
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("PRAGMA journal_mode=WAL")
        blocker.execute("BEGIN EXCLUSIVE")
        blockers.append(blocker)
    try:
        with pytest.raises(StoreUnavailableError, match="locked"):
            open_store(f"sqlite://{fresh}?timeout=0")  # a new database needs the write lock
        store = open_store(f"sqlite://{existing}?timeout=0")  # an existing one only reads
        with pytest.raises(StoreUnavailableError, match="locked"):
            store.append("s", 0, _records(1))
    finally:
        for blocker in blockers:
            blocker.execute("ROLLBACK")
    assert open_store(f"sqlite://{fresh}?timeout=0").append("s", 0, _records(1)) == 1


def test_a_file_that_is_not_a_database_is_a_misconfiguration(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"these are my notes, not a database" * 100)
    with pytest.raises(StoreMisconfiguredError, match="not a SQLite database"):
        open_store(f"sqlite://{path}")


def test_a_schema_that_cannot_be_prepared_closes_what_the_store_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "other.db"
    other = sqlite3.connect(path)
    other.execute("CREATE TABLE loom_streams (name TEXT PRIMARY KEY)")  # not Loom's
    other.commit()
    other.close()
    closed: list[SqliteStore] = []
    close = SqliteStore.close

    def recording_close(self: SqliteStore) -> None:
        closed.append(self)
        close(self)

    monkeypatch.setattr(SqliteStore, "close", recording_close)
    with pytest.raises(StoreUnavailableError, match="cannot prepare sqlite database"):
        open_store(f"sqlite://{path}")
    assert len(closed) == 1, "the connection it opened is closed"
    assert open_connections(closed[0]) == []


def test_a_missing_directory_is_a_misconfiguration(tmp_path: Path) -> None:
    with pytest.raises(StoreMisconfiguredError, match="directory exists"):
        open_store(f"sqlite://{tmp_path}/no/such/dir/loom.db")


@flow
def charge(ctx: Context, _input: Any) -> Any:
    first = ctx.step("quote", lambda: 10)
    second = ctx.step("charge", lambda: first * 2)
    return [first, second, ctx.suspend("ship")]


@pytest.mark.parametrize("missing", [2, 3])
def test_a_row_lost_from_the_database_is_a_schema_error(tmp_path: Path, missing: int) -> None:
    path = tmp_path / "lost.db"
    store = open_store(f"sqlite://{path}")
    Engine(store, [charge], listeners=[]).start("charge", key="order-1")
    with sqlite3.connect(path) as connection:
        connection.execute(
            "DELETE FROM loom_rows WHERE stream = (SELECT id FROM loom_names "
            "WHERE name = 'ex/order-1') AND position = ?",
            (missing,),
        )
    fresh = Engine(open_store(f"sqlite://{path}"), [charge], listeners=[])
    with pytest.raises(SchemaError, match=f"record {missing} is missing"):
        fresh.resume("order-1", "go")


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda store: store.read("s"), "cannot read 's'"),
        (lambda store: store.head("s"), "cannot read the head of 's'"),
        (lambda store: store.streams(""), "cannot list streams"),
        (lambda store: store.trim("s", 2), "cannot trim 's'"),
        (lambda store: store.delete("s"), "cannot delete 's'"),
        (lambda store: store.append("s", 2, _records(1)), "cannot confirm an append to 's'"),
    ],
)
def test_a_database_whose_tables_are_gone_fails_each_call_with_the_stores_error(
    tmp_path: Path, call: Any, says: str
) -> None:
    store = open_sqlite_store(f"sqlite:///{tmp_path / 'gone.db'}")
    store.append("s", 0, _records(2))
    vandal = sqlite3.connect(tmp_path / "gone.db", isolation_level=None)
    vandal.execute("DROP TABLE loom_rows")
    vandal.execute("DROP TABLE loom_names")
    vandal.close()
    with pytest.raises(StoreUnavailableError, match=f"{says}: no such table"):
        call(store)
    store.close()


def test_an_authorizer_that_refuses_is_a_misconfiguration_that_says_so(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "auth.db"))
    try:
        raw_connection(store).set_authorizer(lambda *_args: sqlite3.SQLITE_DENY)
        with pytest.raises(StoreMisconfiguredError, match="an authorizer"):
            store.read("s")
    finally:
        raw_connection(store).set_authorizer(None)
        store.close()


def test_a_row_of_a_kind_no_kind_has_is_an_error_not_a_record(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "kinds.db"))
    try:
        store.append("s", 0, _records(1))
        connection = raw_connection(store)
        connection.execute("UPDATE loom_rows SET kind = 999")
        with pytest.raises(LoomError, match="kind number 999"):
            store.read("s")
    finally:
        store.close()
