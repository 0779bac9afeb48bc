"""A call's transaction on its thread's connection: begun, committed, and rolled back
on any failure or interrupt (KeyboardInterrupt, a signal handler raising), so no
connection is ever left in a transaction holding a lock or a read snapshot."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from loom_store_sqlite._connections import ThreadConnections
from loom_store_sqlite._failures import store_error

__all__ = ["Transactions", "begin_transaction", "roll_back"]


def begin_transaction(connection: sqlite3.Connection, begin: str) -> None:
    """Run `begin`; an interrupt (KeyboardInterrupt, a signal handler raising) that
    arrives as it returns, after SQLite granted the lock, rolls it back, or the
    connection would stay in a transaction holding the write lock.

    Raises:
        sqlite3.Error: SQLite refused to begin.
    """
    try:
        connection.execute(begin)
    except sqlite3.Error:
        raise
    except BaseException:
        roll_back(connection)
        raise


def roll_back(connection: sqlite3.Connection) -> None:
    """End the connection's transaction, if one is open, without raising."""
    if connection.in_transaction:
        with suppress(sqlite3.Error):  # SQLite may have rolled it back already
            connection.execute("ROLLBACK")


class Transactions(ThreadConnections):
    """The transactions part of `SqliteStore` (a base of it): `_transaction()` holds a
    call's statements in one transaction on its thread's connection."""

    #: Whether a commit syncs (`synchronous` full or extra, on a file): only then does
    #: an unsynced append (`JournalStore.append(..., sync=False)`) commit otherwise.
    _syncs_each_commit: bool

    def _restore_sync(self, connection: sqlite3.Connection) -> None:
        """Set the store's own `synchronous` level back on this thread's connection if
        an unsynced append left it below (see `Appends._synced_as`).

        Raises:
            sqlite3.Error: SQLite refused it (the connection stays marked).
        """
        if getattr(self._local, "unsynced", None) is connection:
            roll_back(connection)  # the level cannot change inside a transaction
            connection.execute(f"PRAGMA synchronous={self._options.synchronous}")
            self._local.unsynced = None

    @contextmanager
    def _transaction(self, begin: str = "BEGIN") -> Iterator[sqlite3.Connection]:
        with self._serialised(), self._open_transaction(begin) as connection:
            yield connection

    @contextmanager
    def _open_transaction(self, begin: str) -> Iterator[sqlite3.Connection]:
        connection: sqlite3.Connection | None = None
        try:
            connection = self._use()
            with self._in_transaction(connection, begin):
                yield connection
        finally:
            if connection is not None:
                self._done(connection)

    @contextmanager
    def _in_transaction(self, connection: sqlite3.Connection, begin: str) -> Iterator[None]:
        try:
            self._restore_sync(connection)
            begin_transaction(connection, begin)
        except sqlite3.Error as exc:
            raise store_error(f"sqlite {begin} failed on {self.path!r}", exc) from exc
        try:
            yield
        except BaseException:
            roll_back(connection)
            raise
        try:
            connection.execute("COMMIT")
        except sqlite3.Error as exc:
            roll_back(connection)
            raise store_error(f"sqlite COMMIT failed on {self.path!r}", exc) from exc
        except BaseException:  # an interrupt: never leave the connection in a transaction
            roll_back(connection)
            raise
