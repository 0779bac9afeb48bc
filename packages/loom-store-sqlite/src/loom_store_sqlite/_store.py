"""The journal SPI on SQLite: WAL, immediate transactions, appends of concurrent
threads committed in groups. `SqliteStore` is assembled from parts, each a base class
in a module of its own: its connections (`_connections`), its transactions
(`_transactions`) and its appends (`_appends`); here are the rest of its hooks,
opening and closing it, and the `sqlite:` URL's opener."""

from __future__ import annotations

import os
import sqlite3
import threading
import urllib.request
import zlib
from collections.abc import Callable
from functools import partial
from typing import Any, Final, cast

from loom_kernel.spi import (
    FsspecBlobs,
    GroupCommit,
    JournalStore,
    Record,
    StoreFactory,
    StoreMisconfiguredError,
    StreamDeletedError,
    TrimmedError,
)

from loom_store_sqlite._appends import Appends
from loom_store_sqlite._connections import (
    forked_error,
    forks,
    inherited,
    open_at_fork,
    open_here,
    open_lock,
)
from loom_store_sqlite._failures import store_error
from loom_store_sqlite._heads import DATA_VERSION, KnownHeads, StampedHeads
from loom_store_sqlite._options import SqliteOptions, parse_store_url
from loom_store_sqlite._packing import Kinds, unpack
from loom_store_sqlite._schema import ensure_schema
from loom_store_sqlite._walindex import WalIndex, let_go_of_unlinked

__all__ = ["SqliteStore", "open_sqlite_store", "sqlite_store_factory"]

#: A row (position, kind, payload, timestamp) as a Record, without `Record._make`'s
#: Python-level wrapper (measured: a tenth of reading 10,000 records). The STRICT
#: table returns exactly int, str, bytes and float for these four columns.
_as_record: Final = cast(Callable[[tuple[Any, ...]], Record], partial(tuple.__new__, Record))


class SqliteStore(Appends, JournalStore):
    """Streams in one SQLite database, shared safely by threads and processes.

    Each thread gets its own connection. An append is a `BEGIN IMMEDIATE`
    transaction holding the head check and the insert, with the unique key
    (stream, position) as the last line of defence; appends of threads that
    arrive while another commits share the next transaction (group commit).

    Args:
        path: the database file, or ":memory:" for a private in-memory database.
        options: synchronous level and lock timeout.
    """

    def __init__(self, path: str, options: SqliteOptions | None = None) -> None:
        self._options = options or SqliteOptions()
        # An in-memory database lives in one connection that every thread shares
        # behind a lock (SQLite's shared cache would fail racing writers with
        # "table is locked" instead of waiting). A file gets a connection per thread.
        self._memory = path == ":memory:"
        self._target = path if self._memory else os.path.abspath(path)
        self._forks = forks[0]
        self._real = None if self._memory else os.path.realpath(self._target)
        self._counted = False  # in `open_here`
        if self._real in open_at_fork:
            raise forked_error(path)
        self._serial = threading.RLock() if self._memory else None
        # What a group's commit holds: `_serial` where threads share one connection;
        # else a lock nobody contends (one group commits at a time), which costs less
        # than `_serialised()`'s generator on the path of every append.
        self._commit_lock = self._serial or threading.Lock()
        self.path = path
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.RLock()  # a thread's end closes its own
        # Each thread connection's uses in progress; those `close()` found in use,
        # which their thread closes as its call ends (closing a connection under a
        # statement another thread runs on it crashes the interpreter).
        self._uses = {}
        self._left_to_users: set[sqlite3.Connection] = set()
        self._closed = False
        self._group = GroupCommit(self._commit_group)
        self._syncs_each_commit = False  # until the database is known to be in WAL mode
        self._wal: WalIndex | None = None
        self._stamped = StampedHeads()
        self._last_leader = 0  # the thread that led the last group (`_witness`)
        self._crowded_until = 0.0
        self._kinds = Kinds()
        self._keeper = self._connect()  # holds a shared in-memory database open
        # SQLite's limit on a string or a blob, and on a row: room is kept for the
        # row's other columns (the stream, the kind, the commit id).
        limit = self._keeper.getlimit(sqlite3.SQLITE_LIMIT_LENGTH) - _ROW_ROOM
        self.max_record_bytes = max(limit, 0)
        try:
            ensure_schema(self._keeper, path)
            self._kinds.learn(self._keeper)
            # An unsynced commit relies on the WAL's order (see `_synced_as`): in a
            # rollback journal (WAL refused: no shared memory on the file system, say),
            # NORMAL could even corrupt the database on a power loss: every commit syncs.
            self._syncs_each_commit = (
                not self._memory
                and self._options.synchronous in ("full", "extra")
                and self._keeper.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            )
        except sqlite3.Error as exc:
            self.close()
            raise store_error(f"cannot prepare sqlite database {path!r}", exc) from exc
        except BaseException:
            self.close()
            raise
        if not self._memory:
            # The keeper holds the database open, so SQLite keeps this file as it is.
            self._wal = WalIndex.open(self._target)
        if self._real is not None:
            with open_lock[0]:
                open_here[self._real] += 1
                self._counted = True

    def close(self) -> None:
        """Close every connection this store opened: at once where no call of this
        store uses it; else as that call ends (calls made from now on are refused
        with StoreUnavailableError). In a process forked since the store opened, it
        touches nothing: the connections are the parent's."""
        if self._forks != forks[0]:
            if not self._closed:
                self._closed = True
                inherited.append(self.__dict__.copy())  # never deallocated: never closed
            return
        if self._counted and self._real is not None:
            with open_lock[0]:
                open_here[self._real] -= 1
                self._counted = False
        self._closed = True  # first: see `_use`
        self._stamped.clear()
        if self._wal is not None:
            self._wal.close()
        self._close_connections()
        if self._wal is not None:
            let_go_of_unlinked()

    # -- the SPI hooks (`_append` is in `Appends`) ----------------------------------

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        if self._forks != forks[0]:
            raise forked_error(self.path)
        try:
            with self._transaction() as connection:
                row = self._stream_row(connection, stream)
                if row is None:
                    return []
                head, floor, deleted = row
                if deleted:
                    raise StreamDeletedError(stream, head)
                if after < floor:
                    raise TrimmedError(stream, after, floor)
                rows = connection.execute(
                    "SELECT position, kind, payload, timestamp FROM loom_rows "
                    "WHERE stream = (SELECT id FROM loom_names WHERE name = ?) "
                    "AND position > ? ORDER BY position LIMIT ?",
                    (stream, after, -1 if limit is None else limit),
                ).fetchall()
                return self._records(connection, stream, rows)
        except sqlite3.Error as exc:
            raise store_error(f"cannot read {stream!r}", exc) from exc

    def _records(
        self, connection: sqlite3.Connection, stream: str, rows: list[tuple[Any, ...]]
    ) -> list[Record]:
        """Rows as records: each kind's name for its number, each packed payload
        unpacked."""
        kinds = self._kinds
        names = kinds.names
        records: list[Record] = []
        for position, signed, stored, timestamp in rows:
            number, payload = signed, stored
            if signed < 0:
                number = -signed
                try:
                    payload = unpack(stored)
                except zlib.error as exc:
                    raise StoreMisconfiguredError(
                        f"cannot read {stream!r}: the packed payload at position {position} "
                        f"is damaged ({exc}; restore the database from a backup)"
                    ) from exc
            kind = names.get(number) or kinds.name(connection, number)
            records.append(_as_record((position, kind, payload, timestamp)))
        return records

    def _head(self, stream: str) -> int:
        """The head, without reading the stream (the engine asks before every step)
        while nobody else has committed since this store's own last commit wrote it,
        or else while no other connection has committed since this one last read or
        wrote it."""
        if self._forks != forks[0]:
            raise forked_error(self.path)
        try:
            if self._serial is not None:
                with self._serial:
                    row = self._stream_row(self._use(), stream)
            else:
                if self._wal is not None:  # read-only, and nothing once closed
                    head = self._stamped.lookup(stream, self._wal.stamp())
                    if head is not None:
                        return head
                connection = None
                try:
                    connection = self._use()
                    known: KnownHeads = self._local.heads
                    head = known.lookup(connection.execute(DATA_VERSION).fetchone()[0], stream)
                    if head is not None:
                        return head
                    row = self._stream_row(connection, stream)
                    if row is not None and not row[2]:
                        known.learn(stream, row[0])
                finally:
                    if connection is not None:
                        self._done(connection)
        except sqlite3.Error as exc:
            raise store_error(f"cannot read the head of {stream!r}", exc) from exc
        if row is None:
            return 0
        if row[2]:
            raise StreamDeletedError(stream, row[0])
        return row[0]

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        if self._forks != forks[0]:
            raise forked_error(self.path)
        # A range on the primary key: [lower, upper) where upper is the first string
        # past every name with the prefix (ids are ASCII, so bumping the last
        # character works), so even the last page of a listing is an index range scan.
        lower, strict = (after, True) if after is not None and after >= prefix else (prefix, False)
        upper = prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else None
        comparison = ">" if strict else ">="
        sql = f"SELECT name FROM loom_names WHERE deleted = 0 AND name {comparison} ?"  # noqa: S608
        parameters: list[object] = [lower]
        if upper is not None:
            sql += " AND name < ?"
            parameters.append(upper)
        sql += " ORDER BY name LIMIT ?"
        parameters.append(-1 if limit is None else limit)
        try:
            with self._serialised():
                connection = None
                try:
                    connection = self._use()
                    rows = connection.execute(sql, parameters).fetchall()
                finally:
                    if connection is not None:
                        self._done(connection)
        except sqlite3.Error as exc:
            raise store_error("cannot list streams", exc) from exc
        return [str(row[0]) for row in rows]

    def _trim(self, stream: str, before: int) -> None:
        if self._forks != forks[0]:
            raise forked_error(self.path)
        self._forget_head(stream)
        try:
            with self._transaction("BEGIN IMMEDIATE") as connection:
                row = self._stream_row(connection, stream)
                head, floor, deleted = row if row is not None else (0, 0, 0)
                if deleted:
                    raise StreamDeletedError(stream, head)
                self._check_trim(stream, before, head)
                if row is None or before - 1 <= floor:
                    return
                connection.execute(
                    "DELETE FROM loom_rows WHERE stream = "
                    "(SELECT id FROM loom_names WHERE name = ?) AND position < ?",
                    (stream, before),
                )
                connection.execute(
                    "UPDATE loom_names SET floor = ? WHERE name = ?", (before - 1, stream)
                )
        except sqlite3.Error as exc:
            raise store_error(f"cannot trim {stream!r}", exc) from exc

    def _delete(self, stream: str) -> None:
        if self._forks != forks[0]:
            raise forked_error(self.path)
        self._forget_head(stream)
        try:
            with self._transaction("BEGIN IMMEDIATE") as connection:
                row = self._stream_row(connection, stream)
                if row is not None and row[2]:
                    return
                connection.execute(
                    "DELETE FROM loom_rows WHERE stream = "
                    "(SELECT id FROM loom_names WHERE name = ?)",
                    (stream,),
                )
                head = 0 if row is None else row[0]
                connection.execute(
                    "INSERT INTO loom_names (name, floor, deleted) VALUES (?, ?, 1) "
                    "ON CONFLICT (name) DO UPDATE SET floor = excluded.floor, deleted = 1",
                    (stream, head),
                )
        except sqlite3.Error as exc:
            raise store_error(f"cannot delete {stream!r}", exc) from exc


#: Bytes of a row kept for its columns besides the payload, under SQLite's length limit.
_ROW_ROOM: Final = 4096


def open_sqlite_store(url: str) -> SqliteStore:
    """Open `sqlite:///absolute/path.db`, `sqlite://relative/path.db` or `sqlite:///:memory:`.

    The path is percent-decoded (`%23` for a '#' in a file name, `%3F` for a '?').
    Query options: `synchronous` (off, normal, full (default), extra) and `timeout`
    (seconds to wait for another writer's lock, default 10); `blobs` (an fsspec URL
    where payloads over `blob_threshold` bytes, default 65536, go: by default the
    folder `<path>.blobs` beside the database, `none` for no blobs).
    """
    path, options = parse_store_url(url)
    return _with_blobs(SqliteStore(path, options), path, options)


def _with_blobs(store: SqliteStore, path: str, options: SqliteOptions) -> SqliteStore:
    """The store with the blob store its options name."""
    where = options.blobs
    if where is None and path != ":memory:":
        where = os.path.abspath(path) + ".blobs"  # a path: fsspec takes it as it is
    if where is not None and where.lower() != "none":
        store.use_blobs(FsspecBlobs(where), options.blob_threshold)
    return store


def open_existing_sqlite_store(url: str) -> SqliteStore:
    """`open_sqlite_store`, for a database that exists: a missing file is refused with
    StoreMisconfiguredError, never created (a mistyped path in a command that reads)."""
    path, options = parse_store_url(url)
    if path != ":memory:" and not os.path.isfile(path):
        raise StoreMisconfiguredError(
            f"no SQLite database at {os.path.abspath(path)!r}: check the store URL "
            f"({url!r}); this command reads an existing store and creates none"
        )
    if path != ":memory:":
        _refuse_a_foreign_database(path, url)
    return _with_blobs(SqliteStore(path, options), path, options)


def _refuse_a_foreign_database(path: str, url: str) -> None:
    """Look, read-only, for the store's own table before anything writes: opening a
    store creates its schema and turns on WAL, which must not happen to an app's
    own database named by a mistyped URL."""
    location = "file:" + urllib.request.pathname2url(os.path.abspath(path)) + "?mode=ro"
    try:
        probe = sqlite3.connect(location, uri=True)
    except sqlite3.Error:
        return  # cannot even look: the real open reports why
    try:
        found = probe.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'loom_meta'"
        ).fetchone()
    except sqlite3.DatabaseError as exc:
        if "not a database" not in str(exc):
            return
        found = None
    finally:
        probe.close()
    if not found:
        raise StoreMisconfiguredError(
            f"{os.path.abspath(path)!r} is not a Loom store (no loom_meta table): check the "
            f"store URL ({url!r}); this command reads an existing store and changes no other "
            "database"
        )


def _self_check_url(scratch: str) -> str:
    """A database in `loom stores`' scratch directory to check the store with."""
    return "sqlite:///" + os.path.join(scratch, "check.db").lstrip("/")


#: What the `loom.stores` entry point publishes for the `sqlite` scheme.
sqlite_store_factory = StoreFactory(
    open_sqlite_store, self_check_url=_self_check_url, open_existing=open_existing_sqlite_store
)
