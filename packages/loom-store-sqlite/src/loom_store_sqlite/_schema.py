"""The store's own schema: created and upgraded with sqlite-utils, versioned in loom_meta."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from loom_kernel import SchemaError

if TYPE_CHECKING:  # imported where a database is created or upgraded: see `ensure_schema`
    import sqlite_utils

__all__ = ["SCHEMA_VERSION", "ensure_schema"]

SCHEMA_VERSION: Final = 3


def _create_v1(db: sqlite_utils.Database) -> None:
    # One row per stream ever written: where its records start (floor) and whether
    # it was deleted (then floor holds its final head). The head of a live stream is
    # the largest position among its records, or the floor when none are left.
    db["loom_streams"].create(  # type: ignore[union-attr]
        {"name": str, "floor": int, "deleted": int},
        pk="name",
        not_null={"name", "floor", "deleted"},
        defaults={"floor": 0, "deleted": 0},
        strict=True,
        if_not_exists=True,
    )
    # Records are clustered on (stream, position): WITHOUT ROWID keeps one b-tree
    # instead of a table plus a primary-key index, so an append writes one b-tree.
    # sqlite-utils cannot declare WITHOUT ROWID, so this table is plain SQL.
    db.execute(
        """
        CREATE TABLE IF NOT EXISTS loom_records (
            stream TEXT NOT NULL,
            position INTEGER NOT NULL,
            kind TEXT NOT NULL,
            payload BLOB NOT NULL,
            timestamp REAL NOT NULL,
            txn TEXT,
            PRIMARY KEY (stream, position)
        ) STRICT, WITHOUT ROWID
        """
    )


def _add_live_names_v2(db: sqlite_utils.Database) -> None:
    # Listings skip deleted streams. Without this index a listing walks every deleted
    # name in its range, so an idle timer poll grew with the handled (deleted) timer
    # buckets; with it, it costs what is live.
    db.execute(
        "CREATE INDEX IF NOT EXISTS loom_live_streams ON loom_streams (name) WHERE deleted = 0"
    )


def _number_names_and_kinds_v3(db: sqlite_utils.Database) -> None:
    # A row named its stream and its kind in full, so a small record's row was
    # mostly repeated names. Streams and kinds get numbers; a row keeps those, its
    # payload packed where that is smaller (`_packing`). The tables get new names,
    # so a process of an older store still attached fails loudly on its next
    # statement instead of reading the old, emptied tables.
    db["loom_names"].create(  # type: ignore[union-attr]
        {"id": int, "name": str, "floor": int, "deleted": int},
        pk="id",
        not_null={"id", "name", "floor", "deleted"},
        defaults={"floor": 0, "deleted": 0},
        strict=True,
    )
    db.execute("CREATE UNIQUE INDEX loom_names_by_name ON loom_names (name)")
    db.execute("CREATE INDEX loom_live_names ON loom_names (name) WHERE deleted = 0")
    db["loom_kinds"].create(  # type: ignore[union-attr]
        {"id": int, "name": str}, pk="id", not_null={"id", "name"}, strict=True
    )
    db.execute("CREATE UNIQUE INDEX loom_kinds_by_name ON loom_kinds (name)")
    # Plain SQL: sqlite-utils cannot declare WITHOUT ROWID (see `_create_v1`).
    db.execute(
        """
        CREATE TABLE loom_rows (
            stream INTEGER NOT NULL,
            position INTEGER NOT NULL,
            kind INTEGER NOT NULL,
            payload BLOB NOT NULL,
            timestamp REAL NOT NULL,
            txn INTEGER,
            PRIMARY KEY (stream, position)
        ) STRICT, WITHOUT ROWID
        """
    )
    db.execute(
        "INSERT INTO loom_names (name, floor, deleted) "
        "SELECT name, floor, deleted FROM loom_streams ORDER BY rowid"
    )
    db.execute("INSERT INTO loom_kinds (name) SELECT DISTINCT kind FROM loom_records ORDER BY kind")
    # An old commit id is no longer needed: no append of the old schema can still be
    # waiting to confirm itself (the old tables are gone).
    db.execute(
        "INSERT INTO loom_rows (stream, position, kind, payload, timestamp, txn) "
        "SELECT n.id, r.position, k.id, r.payload, r.timestamp, NULL FROM loom_records AS r "
        "JOIN loom_names AS n ON n.name = r.stream JOIN loom_kinds AS k ON k.name = r.kind"
    )
    db.execute("DROP TABLE loom_records")
    db.execute("DROP TABLE loom_streams")


# MIGRATIONS[n] takes a database at schema n to schema n + 1.
MIGRATIONS: Final[dict[int, Callable[[sqlite_utils.Database], None]]] = {
    0: _create_v1,
    1: _add_live_names_v2,
    2: _number_names_and_kinds_v3,
}


def _found_version(connection: sqlite3.Connection) -> int:
    """The store schema a database holds: 0 for a new one."""
    if not connection.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'loom_meta'"
    ).fetchone():
        return 0
    row = connection.execute("SELECT value FROM loom_meta WHERE key = 'schema_version'").fetchone()
    return int(row[0]) if row else 0


def _refuse_newer(found: int, location: str) -> None:
    if found > SCHEMA_VERSION:
        raise SchemaError(
            f"{location} holds store schema {found}, newer than this loom-store-sqlite's "
            f"{SCHEMA_VERSION}; upgrade loom-store-sqlite to open it"
        )


def ensure_schema(connection: sqlite3.Connection, location: str) -> None:
    """Create or upgrade the store's tables; refuse a database from a newer store.

    A database already at this schema is only read, so opening it never waits for
    another connection's write lock.

    Raises:
        SchemaError: the database was written by a newer loom-store-sqlite.
        sqlite3.Error: SQLite failed (the store turns it into a kernel error).
    """
    found = _found_version(connection)
    _refuse_newer(found, location)
    if found == SCHEMA_VERSION:
        return
    # Only here: sqlite-utils imports click and pluggy (about 0.2 s), which a process
    # opening a database already at this schema never needs.
    import sqlite_utils  # noqa: PLC0415

    db = sqlite_utils.Database(connection)
    try:
        connection.execute("BEGIN IMMEDIATE")
    except sqlite3.Error:
        raise
    except BaseException:  # an interrupt as SQLite granted the lock: give it back
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        raise
    try:
        db["loom_meta"].create(  # type: ignore[union-attr]
            {"key": str, "value": str}, pk="key", not_null={"key", "value"}, if_not_exists=True
        )
        found = _found_version(connection)  # another opener may have created it meanwhile
        _refuse_newer(found, location)
        for version in range(found, SCHEMA_VERSION):
            MIGRATIONS[version](db)
        if found != SCHEMA_VERSION:
            connection.execute(
                "INSERT OR REPLACE INTO loom_meta (key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )
        connection.execute("COMMIT")
    except BaseException:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        raise
