"""Seams for tests and tools: what they may look at, or stand in for, inside a
`SqliteStore` without reaching into its private members. Not the journal API (use
`loom_kernel.open_store` and `JournalStore` for that): a seam changes with the store's
inside. Each names what a test asks of the store, and this module alone knows where
it lives: a thread's raw connection, the connections still open, the WAL-index view,
the appends queued for a group's commit, and whether the next group is witnessed.

    from loom_store_sqlite.testing import raw_connection

    raw_connection(store).execute("PRAGMA journal_mode").fetchone()
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from loom_store_sqlite._store import SqliteStore
from loom_store_sqlite._walindex import WalIndex

__all__ = [
    "connection_stand_in",
    "lone_leader",
    "open_connections",
    "queued_appends",
    "raw_connection",
    "wal_index",
    "witnessed",
]


def raw_connection(store: SqliteStore) -> sqlite3.Connection:
    """The calling thread's connection to the store's database (the in-memory
    database's one), opened if need be, to look through or to set up (a trace
    callback, a progress handler, a limit). Not counted in use: once the store is
    closed, it may be closed under a statement run on it.

    Raises:
        StoreUnavailableError: the store is closed.
    """
    connection = store._use()
    store._done(connection)
    return connection


def open_connections(store: SqliteStore) -> list[sqlite3.Connection]:
    """Every connection the store has open: those it lists (its keeper, each live
    thread's), and those `close()` left to the calls using them."""
    with store._connections_lock:
        return [*store._connections, *store._left_to_users]


@contextmanager
def connection_stand_in(store: SqliteStore, stand_in: object) -> Iterator[None]:
    """Within the block, the calling thread's calls of a store on a file run on
    `stand_in` instead of its connection (a wrapper of `raw_connection(store)` that
    fails on cue, say); the connection is back after the block, however it ends."""
    real = raw_connection(store)
    store._local.connection = stand_in
    try:
        yield
    finally:
        store._local.connection = real


def wal_index(store: SqliteStore) -> WalIndex | None:
    """The store's view of its database's WAL-index header; None for the in-memory
    database, or where it cannot be mapped (then every head is read from SQLite)."""
    return store._wal


def queued_appends(store: SqliteStore) -> int:
    """How many appends wait now for the group commit under way to end."""
    return store._group.queued


def witnessed(store: SqliteStore) -> SqliteStore:
    """Make the store's next group witnessed (its heads shared with the store's
    other threads), as when another thread led the last; the store, to call on."""
    store._last_leader = -1
    return store


def lone_leader(store: SqliteStore) -> SqliteStore:
    """Make the store's next lone group unwitnessed, as when the calling thread has
    been the lone leader of its groups for a while (a group of several appends is
    witnessed all the same); the store, to call on."""
    store._last_leader = threading.get_ident()
    store._crowded_until = 0.0
    return store
