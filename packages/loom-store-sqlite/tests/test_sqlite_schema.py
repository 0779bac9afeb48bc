"""The store's own schema: created, upgraded in place, refused when newer, strict, its
unique key the last line of defence, and a failed migration rolled back."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from loom_kernel.spi import NewRecord, SchemaError, StreamDeletedError, TrimmedError
from loom_store_sqlite import SCHEMA_VERSION, open_sqlite_store
from loom_store_sqlite.testing import raw_connection


def _records(count: int) -> list[NewRecord]:
    return [NewRecord("k", str(i).encode(), float(i)) for i in range(count)]


def test_a_newer_store_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    open_sqlite_store(f"sqlite://{path}").close()
    with sqlite3.connect(path) as connection:
        connection.execute(
            "UPDATE loom_meta SET value = ? WHERE key = 'schema_version'",
            (str(SCHEMA_VERSION + 1),),
        )
    with pytest.raises(SchemaError, match="newer than this loom-store-sqlite"):
        open_sqlite_store(f"sqlite://{path}")
    # Refused on a read, before any write lock: even while another writer holds it.
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(SchemaError, match="newer than this loom-store-sqlite"):
            open_sqlite_store(f"sqlite://{path}?timeout=0")
    finally:
        writer.execute("ROLLBACK")
        writer.close()


def test_the_streams_table_is_strict(tmp_path: Path) -> None:
    """A floor that is not an integer (a raw writer's mistake) is refused by SQLite,
    never read back as a head."""
    path = tmp_path / "strict.db"
    open_sqlite_store(f"sqlite://{path}").close()
    with sqlite3.connect(path) as connection, pytest.raises(sqlite3.IntegrityError):
        connection.execute("INSERT INTO loom_names (name, floor) VALUES ('s', 'ten')")


def test_an_older_database_is_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as connection:  # a database from before the store existed
        connection.execute("CREATE TABLE unrelated (x INTEGER)")
    store = open_sqlite_store(f"sqlite://{path}")
    store.append("s", 0, _records(2))
    version = (
        raw_connection(store)
        .execute("SELECT value FROM loom_meta WHERE key = 'schema_version'")
        .fetchone()[0]
    )
    assert int(version) == SCHEMA_VERSION


def _old_database(path: Path, version: int) -> None:
    """A database as loom-store-sqlite `version` (1 or 2) left it: streams and kinds
    named in full in every row, a trimmed stream, a deleted one."""
    import sqlite_utils
    from loom_store_sqlite import _schema

    connection = sqlite3.connect(path, isolation_level=None)
    db = sqlite_utils.Database(connection)
    db["loom_meta"].create({"key": str, "value": str}, pk="key")  # type: ignore[union-attr]
    for step in range(version):
        _schema.MIGRATIONS[step](db)
    connection.execute("INSERT INTO loom_meta VALUES ('schema_version', ?)", (str(version),))
    connection.executemany(
        "INSERT INTO loom_streams (name, floor, deleted) VALUES (?, ?, ?)",
        [("ex/a", 0, 0), ("ex/trimmed", 2, 0), ("gone", 5, 1)],
    )
    connection.executemany(
        "INSERT INTO loom_records VALUES (?, ?, ?, ?, ?, ?)",
        [
            ("ex/a", 1, "STEP_COMPLETED", b'{"v":"1.21.0","d":{}}', 1.5, "t1"),
            ("ex/a", 2, "k.other", b"\x00raw", 2.5, None),
            ("ex/trimmed", 3, "STEP_COMPLETED", b"3", 3.0, "t2"),
        ],
    )
    connection.close()


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_schema_database_is_upgraded_in_place(tmp_path: Path, version: int) -> None:
    path = tmp_path / "old.db"
    _old_database(path, version)
    store = open_sqlite_store(f"sqlite://{path}")
    assert [(r.position, r.kind, r.payload, r.timestamp) for r in store.read("ex/a")] == [
        (1, "STEP_COMPLETED", b'{"v":"1.21.0","d":{}}', 1.5),
        (2, "k.other", b"\x00raw", 2.5),
    ]
    assert [r.position for r in store.read("ex/trimmed", 2)] == [3]
    with pytest.raises(TrimmedError):
        store.read("ex/trimmed", 0)
    with pytest.raises(StreamDeletedError):
        store.head("gone")
    assert store.streams("ex/") == ["ex/a", "ex/trimmed"]
    assert store.append("ex/a", 2, _records(2)) == 4
    assert store.append("new", 0, _records(1)) == 1
    tables = {
        row[0]
        for row in raw_connection(store).execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'"
        )
    }
    assert "loom_records" not in tables
    assert "loom_streams" not in tables
    version_now = (
        raw_connection(store)
        .execute("SELECT value FROM loom_meta WHERE key = 'schema_version'")
        .fetchone()[0]
    )
    assert int(version_now) == SCHEMA_VERSION


def test_a_process_of_the_older_schema_fails_loudly_after_an_upgrade(tmp_path: Path) -> None:
    """The upgraded tables have new names: an older store still attached gets "no such
    table" on its next statement, never an empty stream."""
    path = tmp_path / "old.db"
    _old_database(path, 2)
    older = sqlite3.connect(path)
    open_sqlite_store(f"sqlite://{path}").close()
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        older.execute("SELECT * FROM loom_records WHERE stream = 'ex/a'")
    older.close()


def test_unique_key_is_the_last_line_of_defence(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/u.db")
    store.append("s", 0, _records(1))
    with pytest.raises(sqlite3.IntegrityError):
        raw_connection(store).execute(
            "INSERT INTO loom_rows (stream, position, kind, payload, timestamp) "
            "VALUES (1, 1, 1, x'00', 0.0)"
        )


def test_a_failed_migration_rolls_back_and_leaves_no_write_lock_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migration that fails leaves the connection out of its transaction: another
    connection can write at once, and nothing of the half-made schema is left."""
    from loom_store_sqlite import _schema

    def broken(_db: object) -> None:
        raise sqlite3.OperationalError("disk I/O error (injected)")

    monkeypatch.setitem(_schema.MIGRATIONS, 0, broken)
    path = tmp_path / "half.db"
    connection = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError, match="injected"):
        _schema.ensure_schema(connection, str(path))
    assert not connection.in_transaction
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    other.execute("BEGIN IMMEDIATE")
    assert other.execute("SELECT name FROM sqlite_master").fetchall() == []
    other.execute("ROLLBACK")
    other.close()
    connection.close()
