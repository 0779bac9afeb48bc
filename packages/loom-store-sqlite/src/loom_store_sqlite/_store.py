"""The journal SPI on SQLite: WAL, immediate transactions, appends of concurrent
threads committed in groups."""

from __future__ import annotations

import itertools
import os
import sqlite3
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import partial
from math import isfinite
from time import monotonic
from typing import Any, Final, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import attrs
from loom_kernel.spi import (
    AmbiguousWriteError,
    ConflictError,
    FaultInjection,
    InvalidArgumentError,
    JournalStore,
    NewRecord,
    Record,
    StoreFactory,
    StoreMisconfiguredError,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
)

from loom_store_sqlite._failures import store_error
from loom_store_sqlite._group import GroupCommit, PendingAppend
from loom_store_sqlite._heads import DATA_VERSION, KnownHeads, StampedHeads
from loom_store_sqlite._schema import ensure_schema
from loom_store_sqlite._walindex import WalIndex, let_go_of_unlinked

__all__ = ["SqliteOptions", "SqliteStore", "open_sqlite_store", "sqlite_store_factory"]

_SYNCHRONOUS: Final = ("off", "normal", "full", "extra")
#: Seconds after a group of several appends, or one led by another thread than the
#: last, during which groups are witnessed (`SqliteStore._witness`).
_CROWDED: Final = 0.05


@attrs.frozen
class SqliteOptions:
    """Options from the URL query.

    Attributes:
        synchronous: SQLite's `synchronous` pragma. `full` (the default) makes a
            completed step survive power loss; `normal` survives a process crash but
            may lose the last commits on power loss.
        timeout: seconds a writer waits for another writer's lock before giving up
            with StoreUnavailableError.
    """

    synchronous: str = "full"
    timeout: float = 10.0

    @classmethod
    def parse(cls, query: str) -> SqliteOptions:
        """Read `synchronous=` and `timeout=` from a URL query string.

        Raises:
            InvalidArgumentError: an unknown or repeated option, or a bad value.
        """
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False)
        values = dict(pairs)
        if len(values) != len(pairs):
            names = [name for name, _ in pairs]
            repeated = sorted({name for name in names if names.count(name) > 1})
            raise InvalidArgumentError(f"sqlite store options given more than once: {repeated}")
        unknown = set(values) - {"synchronous", "timeout"}
        if unknown:
            raise InvalidArgumentError(f"unknown sqlite store options: {sorted(unknown)}")
        synchronous = values.get("synchronous", "full").lower()
        if synchronous not in _SYNCHRONOUS:
            raise InvalidArgumentError(
                f"synchronous must be one of {_SYNCHRONOUS}, not {synchronous!r}"
            )
        try:
            timeout = float(values.get("timeout", "10"))
        except ValueError:
            raise InvalidArgumentError(
                f"timeout must be seconds, not {values['timeout']!r}"
            ) from None
        if not isfinite(timeout) or timeout < 0:
            raise InvalidArgumentError(
                f"timeout must be a finite number of seconds >= 0, not {values['timeout']!r}"
            )
        return cls(synchronous=synchronous, timeout=timeout)


_STREAM_STATE: Final = (
    "SELECT (SELECT MAX(position) FROM loom_records WHERE stream = s.name), s.floor, s.deleted "
    "FROM loom_streams AS s WHERE s.name = ?"
)
_INSERT_RECORD: Final = (
    "INSERT INTO loom_records (stream, position, kind, payload, timestamp, txn) "
    "VALUES (?, ?, ?, ?, ?, ?)"
)
#: The first record of an append to an existing stream, inserted only if the stream is
#: live and its head (its last position, or its floor) is the expected one: the head
#: check and the insert in one statement. Parameters: the row, then the expected head.
#: Off the head (or on a stream deleted or never written) the position is NULL, and
#: OR IGNORE skips the row (its NOT NULL constraint) instead of failing: nothing is
#: inserted and no error raised. A one-row VALUES, not INSERT ... SELECT: a SELECT
#: reading the table it inserts into is first copied to a temporary b-tree, which
#: cost a third of the statement.
_INSERT_AT_HEAD: Final = (
    "INSERT OR IGNORE INTO loom_records (stream, position, kind, payload, timestamp, txn) "
    "VALUES (?1, CASE WHEN ?7 = (SELECT max(s.floor, coalesce((SELECT MAX(position) "
    "FROM loom_records WHERE stream = ?1), 0)) FROM loom_streams AS s "
    "WHERE s.name = ?1 AND s.deleted = 0) THEN ?2 END, ?3, ?4, ?5, ?6)"
)

#: A row (position, kind, payload, timestamp) as a Record, without `Record._make`'s
#: Python-level wrapper (measured: a tenth of reading 10,000 records). The STRICT
#: table returns exactly int, str, bytes and float for these four columns.
_as_record: Final = cast(Callable[[tuple[Any, ...]], Record], partial(tuple.__new__, Record))


_commit_ids: Final = itertools.count()
_commit_prefix: Final = [os.urandom(8).hex()]  # this process's random prefix


def _new_commit_prefix() -> None:
    _commit_prefix[0] = os.urandom(8).hex()


# A forked child must not reuse its parent's ids (both would count on from one value).
os.register_at_fork(after_in_child=_new_commit_prefix)

#: Forks this process is away from the one it started as: +1 in each forked child.
_forks: Final = [0]
#: The databases (real paths) stores of this process have open, and how many stores.
_open_here: Final[Counter[str]] = Counter()
#: The databases open in the processes this one was forked from, as they forked: their
#: connections came along, unclosed, and hold SQLite's per-process state of the file.
_open_at_fork: Final[set[str]] = set()
_open_lock = [threading.Lock()]
#: Stores closed in a forked child: what they hold is the parent's, never closed here.
_inherited: Final[list[object]] = []


def _count_fork() -> None:
    _forks[0] += 1
    _open_at_fork.update(name for name, stores in _open_here.items() if stores > 0)
    _open_here.clear()
    _open_lock[0] = threading.Lock()  # the parent's may have been held by one of its threads


os.register_at_fork(after_in_child=_count_fork)


def _forked_error(path: str) -> StoreMisconfiguredError:
    return StoreMisconfiguredError(
        f"sqlite database {path!r} was open in the process this one was forked from, and "
        "SQLite's connections must not cross a fork: the parent's came along, unclosed, "
        "holding SQLite's state of the file (its locks stayed with the parent), so writes "
        "here could be lost and calls could wait for ever; open the database only in "
        "processes that did not inherit it open (multiprocessing's 'spawn' or 'forkserver' "
        "start method), or fork before opening it"
    )


def _commit_id() -> str:
    """An id no other append anywhere has: a random prefix made once per process
    (again after a fork), then a counter (a random id per append costs a syscall, and
    so would a check of the process id)."""
    return f"{_commit_prefix[0]}{next(_commit_ids):x}"


class _ThreadEnd:
    """Held in a thread's locals: when it is dropped, the thread has ended."""

    __slots__ = ("__weakref__",)


class _Uses:
    """How many calls of its thread are using one connection now (`_use`); only that
    thread changes it, `close()` reads it."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


def _close_thread_connection(
    store: weakref.ref[SqliteStore], connection: sqlite3.Connection, pid: int
) -> None:
    if os.getpid() != pid:  # a forked child dropping the parent's threads: not its own
        return
    owner = store()
    if owner is None:
        connection.close()
    else:
        owner._forget_connection(connection)


class _InsertRefusedError(Exception):
    """SQLite refused an insert of a group tried without savepoints."""

    def __init__(self, cause: sqlite3.Error) -> None:
        super().__init__(str(cause))
        self.cause = cause


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
        _roll_back(connection)
        raise


def _roll_back(connection: sqlite3.Connection) -> None:
    """End the connection's transaction, if one is open, without raising."""
    if connection.in_transaction:
        with suppress(sqlite3.Error):  # SQLite may have rolled it back already
            connection.execute("ROLLBACK")


class SqliteStore(FaultInjection, JournalStore):
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
        self._forks = _forks[0]
        self._real = None if self._memory else os.path.realpath(self._target)
        self._counted = False  # in `_open_here`
        if self._real in _open_at_fork:
            raise _forked_error(path)
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
        self._uses: dict[sqlite3.Connection, _Uses] = {}
        self._left_to_users: set[sqlite3.Connection] = set()
        self._closed = False
        self._group = GroupCommit(self._commit_group)
        self._wal: WalIndex | None = None
        self._stamped = StampedHeads()
        self._last_leader = 0  # the thread that led the last group (`_witness`)
        self._crowded_until = 0.0
        self._keeper = self._connect()  # holds a shared in-memory database open
        try:
            ensure_schema(self._keeper, path)
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
            with _open_lock[0]:
                _open_here[self._real] += 1
                self._counted = True

    # -- connections -------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        try:
            connection = sqlite3.connect(
                self._target,
                timeout=self._options.timeout,
                isolation_level=None,
                check_same_thread=False,
            )
            if not self._memory:
                connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={self._options.synchronous}")
        except sqlite3.Error as exc:
            raise store_error(f"cannot open sqlite database {self.path!r}", exc) from exc
        with self._connections_lock:
            self._connections.append(connection)
        return connection

    @property
    def _connection(self) -> sqlite3.Connection:
        """This thread's connection, opened if need be (not counted in use: for a look
        from outside, as tests take)."""
        connection = self._use()
        self._done(connection)
        return connection

    def _use(self) -> sqlite3.Connection:
        """This thread's connection, counted in use until `_done` (the in-memory
        database's one connection: its users hold `_serial`, which `close()` takes).

        Raises:
            StoreUnavailableError: the store is closed.
        """
        if self._memory:
            if self._closed:
                raise StoreUnavailableError(f"sqlite store {self.path!r} is closed")
            return self._keeper
        connection: sqlite3.Connection | None = getattr(self._local, "connection", None)
        if connection is None:
            if self._closed:
                raise StoreUnavailableError(f"sqlite store {self.path!r} is closed")
            connection = self._thread_connection()
        uses: _Uses = self._local.uses
        uses.count += 1
        # Counted before the look at `_closed`, which `close()` sets before it looks at
        # the counts: either this sees it closed, or `close()` sees this in use.
        if self._closed:
            self._done(connection)
            raise StoreUnavailableError(f"sqlite store {self.path!r} is closed")
        return connection

    def _done(self, connection: sqlite3.Connection) -> None:
        """A use of this thread's connection (`_use`) has ended: once the store is
        closed, the connection's last use closes it, if `close()` left it to it."""
        if self._memory:
            return
        uses: _Uses = self._local.uses
        uses.count -= 1
        if self._closed and uses.count == 0:
            with self._connections_lock:
                left = connection in self._left_to_users
                self._left_to_users.discard(connection)
            if left:
                connection.close()

    def _thread_connection(self) -> sqlite3.Connection:
        """Open this thread's connection."""
        connection = self._connect()
        self._local.uses = uses = _Uses()
        with self._connections_lock:
            self._uses[connection] = uses
        self._local.heads = KnownHeads()
        # Dropped with the thread's other locals when it ends: its connection is closed
        # then, not kept open until the store closes (threads that come and go, a
        # pool's that end when idle, would each leave one behind).
        self._local.ends = ends = _ThreadEnd()
        closer = weakref.finalize(
            ends, _close_thread_connection, weakref.ref(self), connection, os.getpid()
        )
        closer.atexit = False  # at exit, a daemon thread may still be using it
        self._local.connection = connection  # last: an interrupt before leaves no half
        return connection

    def _forget_connection(self, connection: sqlite3.Connection) -> None:
        """Close a connection whose thread has ended."""
        with self._connections_lock:
            if connection in self._connections:
                self._connections.remove(connection)
            self._uses.pop(connection, None)
            self._left_to_users.discard(connection)
        connection.close()

    def _known_heads(self) -> KnownHeads | None:
        """This thread's known heads; None for the in-memory database, whose one
        connection every thread shares (so its data_version never sees their writes)."""
        if self._memory:
            return None
        heads: KnownHeads | None = getattr(self._local, "heads", None)
        return heads

    @contextmanager
    def _serialised(self) -> Iterator[None]:
        if self._serial is None:
            yield
        else:
            with self._serial:
                yield

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
            begin_transaction(connection, begin)
        except sqlite3.Error as exc:
            raise store_error(f"sqlite {begin} failed on {self.path!r}", exc) from exc
        try:
            yield
        except BaseException:
            _roll_back(connection)
            raise
        try:
            connection.execute("COMMIT")
        except sqlite3.Error as exc:
            _roll_back(connection)
            raise store_error(f"sqlite COMMIT failed on {self.path!r}", exc) from exc
        except BaseException:  # an interrupt: never leave the connection in a transaction
            _roll_back(connection)
            raise

    def close(self) -> None:
        """Close every connection this store opened: at once where no call of this
        store uses it; else as that call ends (calls made from now on are refused
        with StoreUnavailableError). In a process forked since the store opened, it
        touches nothing: the connections are the parent's."""
        if self._forks != _forks[0]:
            if not self._closed:
                self._closed = True
                _inherited.append(self.__dict__.copy())  # never deallocated: never closed
            return
        if self._counted and self._real is not None:
            with _open_lock[0]:
                _open_here[self._real] -= 1
                self._counted = False
        self._closed = True  # first: see `_use`
        self._stamped.clear()
        if self._wal is not None:
            self._wal.close()
        with self._serialised(), self._connections_lock:
            connections, self._connections = self._connections, []
            idle = []
            for connection in connections:
                uses = self._uses.get(connection)
                if uses is not None and uses.count > 0:
                    self._left_to_users.add(connection)
                else:
                    idle.append(connection)
        for connection in idle:
            connection.close()
        if self._wal is not None:
            let_go_of_unlinked()

    # -- the SPI hooks -------------------------------------------------------------

    @staticmethod
    def _stream_row(connection: sqlite3.Connection, stream: str) -> tuple[int, int, int] | None:
        """(head, floor, deleted) of a stream ever written, else None."""
        row = connection.execute(_STREAM_STATE, (stream,)).fetchone()
        if row is None:
            return None
        head, floor, deleted = row
        return (floor if deleted or head is None else max(head, floor)), floor, deleted

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        if self._forks != _forks[0]:
            raise _forked_error(self.path)
        lose_reply = self._next_fault(stream)
        txn = _commit_id()
        # The commit id marks the batch's first record.
        first = records[0]
        rows: list[tuple[str, int, str, bytes, float, str | None]] = [
            (stream, expected + 1, first.kind, first.payload, float(first.timestamp), txn)
        ]
        if len(records) > 1:
            rows += [
                (stream, expected + offset, r.kind, r.payload, float(r.timestamp), None)
                for offset, r in enumerate(records[1:], start=2)
            ]
        try:
            try:
                self._group.submit(PendingAppend(stream, expected, rows))
            except BaseException:
                self._forget_head(stream)
                raise
            if lose_reply:
                raise AmbiguousWriteError
        except (AmbiguousWriteError, StoreUnavailableError) as exc:
            return self._confirm(stream, expected, len(records), txn, exc)
        return expected + len(records)

    def _commit_group(self, batch: list[PendingAppend]) -> None:
        """One transaction for a group of appends (see `GroupCommit`): each append's
        head check, then its insert; an append that fails its check is left out.

        A group is first tried with no savepoints (an insert fails only on a record
        SQLite refuses: too big, a full disk); if an insert fails, the group is tried
        again with each append on a savepoint of its own, so only that append fails.

        The hot path, in raw sqlite3: the head check reads one index, and the commit
        writes only the records b-tree (and the streams row, once, on creation).
        (Measured with bench/bench_sqlite.py: sqlite-utils' insert_all, or a head
        column updated on every append, cost more than the commit they wrap.)
        """
        with self._commit_lock:
            landed: list[PendingAppend] | None = None
            connection: sqlite3.Connection | None = None
            try:
                connection = self._use()
                witness = self._witness(connection, batch)
                try:
                    # One append of one record to a stream that exists (expected above 0).
                    if len(batch) == 1 and (only := batch[0]).expected > 0 and len(only.rows) == 1:
                        landed = self._insert_alone(connection, only)
                    else:
                        landed = self._transact(connection, batch, isolated=False)
                        if landed is None:
                            landed = self._transact(connection, batch, isolated=True)
                finally:
                    self._record_commit(connection, witness, batch, landed)
            finally:
                if connection is not None:
                    self._done(connection)
        known: KnownHeads | None  # `_known_heads()`, inline: every append comes here
        if landed and not self._memory and (known := getattr(self._local, "heads", None)):
            for append in landed:
                known.learn(append.stream, append.expected + len(append.rows))

    def _witness(
        self, connection: sqlite3.Connection, batch: list[PendingAppend]
    ) -> tuple[int, bytes | None] | None:
        """Before a group commits: its connection's data version, then the WAL-index
        header (see `StampedHeads`), where worth it; else None.

        Worth it where more than one thread appends: then the engine's look at a run's
        head before each step finds it here without a call into SQLite. So a group is
        witnessed while, within the last `_CROWDED` seconds, a group held several
        appends or was led by another thread than the one before; one thread
        appending alone (the embedded case) makes no witness reads, and the heads
        its connection committed are its connection's own.
        """
        leader = threading.get_ident()
        now = monotonic()
        if len(batch) > 1 or leader != self._last_leader:
            self._crowded_until = now + _CROWDED
        self._last_leader = leader
        if self._wal is None or now >= self._crowded_until:
            return None
        if connection.in_transaction:  # left open by an interrupt: nothing in it landed
            _roll_back(connection)
        try:
            version: int = connection.execute(DATA_VERSION).fetchone()[0]
        except sqlite3.Error:
            return None
        return version, self._wal.stamp()

    def _record_commit(
        self,
        connection: sqlite3.Connection,
        witness: tuple[int, bytes | None] | None,
        batch: list[PendingAppend],
        landed: list[PendingAppend] | None,
    ) -> None:
        """After a group's commit (or its failure, or an interrupt): the heads it wrote,
        shared by the store's threads if nobody else committed meanwhile and every
        append's outcome is certain; else the shared heads are dropped."""
        if self._wal is None:
            return
        certain = landed is not None and all(
            append.error is None or isinstance(append.error, ConflictError | StreamDeletedError)
            for append in batch
        )
        if witness is None or not certain:
            self._stamped.clear()
            return
        after = self._wal.stamp()
        try:
            moved = connection.execute(DATA_VERSION).fetchone()[0] != witness[0]
        except sqlite3.Error:
            moved = True
        if moved:  # another connection committed between the two reads
            self._stamped.clear()
            return
        heads = {append.stream: append.expected + len(append.rows) for append in landed or ()}
        self._stamped.committed(witness[1], after, heads)

    def _transact(
        self, connection: sqlite3.Connection, batch: list[PendingAppend], *, isolated: bool
    ) -> list[PendingAppend] | None:
        """Commit `batch` in one transaction; the appends that landed, or None when an
        insert of a group tried without savepoints failed (nothing landed)."""
        try:
            begin_transaction(connection, "BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            for append in batch:
                append.error = store_error(f"sqlite BEGIN failed on {self.path!r}", exc)
            return []
        heads: dict[str, int] = {}
        landed: list[PendingAppend] = []
        try:
            for append in batch:
                if self._stage(connection, append, heads, isolated=isolated):
                    landed.append(append)
            connection.execute("COMMIT")
        except _InsertRefusedError as refused:
            try:
                _roll_back(connection)
            finally:  # nothing landed: what the first appends were judged against is gone
                for append in batch:
                    append.error = None
            if len(batch) > 1:
                return None
            batch[0].error = store_error(f"sqlite append failed on {self.path!r}", refused.cause)
            return []
        except sqlite3.Error as exc:
            _roll_back(connection)
            for append in self._undecided(batch, landed):
                append.error = store_error(f"sqlite append failed on {self.path!r}", exc)
            return []
        except BaseException:
            # An interrupt (KeyboardInterrupt, a signal handler raising) between BEGIN
            # and COMMIT: roll back, or this connection stays in a transaction that
            # holds the write lock and refuses its own next BEGIN.
            _roll_back(connection)
            for append in self._undecided(batch, landed):
                append.error = StoreUnavailableError("the append was interrupted")
            raise
        return landed

    def _insert_alone(
        self, connection: sqlite3.Connection, append: PendingAppend
    ) -> list[PendingAppend]:
        """Commit a lone one-record append to a stream that exists as one statement,
        which SQLite runs as a transaction of its own: the head check and the insert
        (`_INSERT_AT_HEAD`) with no BEGIN and no COMMIT around them, so a step costs
        one statement, not three. Its write lock is taken as the statement starts."""
        if connection.in_transaction:
            # Left open by something interrupted (nothing in it was acknowledged): the
            # statement would join it and commit nothing. Never here on a healthy path.
            _roll_back(connection)
        try:
            inserted = (
                connection.execute(_INSERT_AT_HEAD, (*append.rows[0], append.expected)).rowcount
                == 1
            )
        except sqlite3.Error as exc:  # a record too big, a full disk, a lock held too long
            # It may have committed before failing: the caller confirms by commit id,
            # and a head that moved says conflict there.
            append.error = store_error(f"sqlite append failed on {self.path!r}", exc)
            return []
        except BaseException:
            # An interrupt during the statement: it committed or it did not; the caller
            # confirms by commit id.
            append.error = StoreUnavailableError("the append was interrupted")
            raise
        if not inserted:
            try:
                self._not_inserted(connection, append)
            except sqlite3.Error as exc:  # nothing was written; why is not known
                append.error = store_error(
                    f"sqlite append to {append.stream!r} inserted nothing on {self.path!r}, "
                    "and the stream could not be read to say why",
                    exc,
                )
            return []
        return [append]

    @staticmethod
    def _undecided(batch: list[PendingAppend], landed: list[PendingAppend]) -> list[PendingAppend]:
        """After a group's transaction was rolled back: the appends whose outcome it
        no longer decides. That is every append with no error yet, and every conflict
        judged against the head an append of the group left (that append is gone
        now, so alone it might have landed). Their callers confirm by commit id."""
        moved = {append.stream for append in landed}
        return [
            append
            for append in batch
            if append.error is None
            or (isinstance(append.error, ConflictError) and append.stream in moved)
        ]

    def _stage(
        self,
        connection: sqlite3.Connection,
        append: PendingAppend,
        heads: dict[str, int],
        *,
        isolated: bool,
    ) -> bool:
        """Check one append's expected head and insert its rows; False (with its
        error set) when it does not belong in this transaction.

        An append to a stream that exists (expected above 0) checks its head in the
        insert of its first record (`_INSERT_AT_HEAD`); only when that inserts nothing
        is the stream read, to say why.
        """
        stream = append.stream
        at_head = stream not in heads and append.expected > 0
        exists = True
        if stream in heads:  # an append before it in this group wrote the stream
            if not self._at(append, heads[stream], deleted=False):
                return False
        elif not at_head:
            row = self._stream_row(connection, stream)
            exists = row is not None
            if not self._at(append, 0 if row is None else row[0], deleted=bool(row and row[2])):
                return False
        if isolated:  # a failed insert must not take the group's other appends with it
            connection.execute("SAVEPOINT loom_append")
        inserted = True
        unchecked = at_head  # the head not checked yet: the first row's insert checks it
        try:
            if not exists:
                connection.execute(
                    "INSERT INTO loom_streams (name, floor, deleted) VALUES (?, 0, 0)",
                    (stream,),
                )
            if at_head:
                first, *rest = append.rows
                inserted = (
                    connection.execute(_INSERT_AT_HEAD, (*first, append.expected)).rowcount == 1
                )
                unchecked = False
                if inserted and rest:
                    connection.executemany(_INSERT_RECORD, rest)
            else:
                connection.executemany(_INSERT_RECORD, append.rows)
        except sqlite3.Error as exc:  # the unique key, a record too big, a full disk...
            # SQLite refuses a record too big as it binds it, before the head check: an
            # append that would have conflicted (or met a deleted stream) says so.
            refused_by_head = (
                unchecked and connection.in_transaction and self._off_head(connection, append)
            )
            if not isolated and not refused_by_head:
                raise _InsertRefusedError(exc) from exc
            if isolated:
                try:  # only this append fails, if the transaction can go on without it
                    connection.execute("ROLLBACK TO loom_append")
                    connection.execute("RELEASE loom_append")
                except sqlite3.Error:
                    raise exc from None
            if not refused_by_head:
                append.error = store_error(f"sqlite append failed on {self.path!r}", exc)
            return False
        if isolated:
            connection.execute("RELEASE loom_append")
        if not inserted:
            self._not_inserted(connection, append)
            return False
        heads[stream] = append.expected + len(append.rows)
        return True

    def _off_head(self, connection: sqlite3.Connection, append: PendingAppend) -> bool:
        """Whether the stream's head refuses the append (its error then set)."""
        row = self._stream_row(connection, append.stream)
        return not self._at(append, 0 if row is None else row[0], deleted=bool(row and row[2]))

    def _not_inserted(self, connection: sqlite3.Connection, append: PendingAppend) -> None:
        """`_INSERT_AT_HEAD` wrote nothing: the stream says why (a conflict, a deleted
        stream). If its head is the expected one after all, the append fails, never
        acknowledged as landed: another connection moved the head there since the
        statement (a lone append outside a transaction), or OR IGNORE skipped the row
        for another constraint."""
        if not self._off_head(connection, append):
            append.error = StoreUnavailableError(
                f"sqlite append failed on {self.path!r}: nothing was inserted at position "
                f"{append.expected + 1} of {append.stream!r}, whose head is now the one "
                "expected (moved there since by another writer, or the row refused)"
            )

    @staticmethod
    def _at(append: PendingAppend, head: int, *, deleted: bool) -> bool:
        """Whether an append may go on a stream at `head`; else its error is set."""
        if deleted:
            append.error = StreamDeletedError(append.stream, head)
        elif head != append.expected:
            append.error = ConflictError(append.stream, append.expected, head)
        return append.error is None

    def _forget_head(self, stream: str) -> None:
        self._stamped.forget(stream)
        known = self._known_heads()
        if known is not None:
            known.forget(stream)

    def _confirm(
        self, stream: str, expected: int, count: int, txn: str, cause: BaseException
    ) -> int:
        """After an ambiguous commit: the batch's first record tells whose write landed."""
        self._forget_head(stream)
        try:
            with self._transaction() as connection:
                row = self._stream_row(connection, stream)
                found = connection.execute(
                    "SELECT txn FROM loom_records WHERE stream = ? AND position = ?",
                    (stream, expected + 1),
                ).fetchone()
        except sqlite3.Error as exc:
            raise store_error(f"cannot confirm an append to {stream!r}", exc) from exc
        if found is not None and found[0] == txn:
            return expected + count
        head = 0 if row is None else row[0]
        if row is not None and row[2]:
            raise StreamDeletedError(stream, head)  # whatever failed, it never will land
        if head == expected:
            why = str(cause) or "its reply was lost"
            raise StoreUnavailableError(
                f"an append to {stream!r} did not land ({why}); retry it"
            ) from cause
        raise ConflictError(stream, expected, head)

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        if self._forks != _forks[0]:
            raise _forked_error(self.path)
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
                    "SELECT position, kind, payload, timestamp FROM loom_records "
                    "WHERE stream = ? AND position > ? ORDER BY position LIMIT ?",
                    (stream, after, -1 if limit is None else limit),
                ).fetchall()
        except sqlite3.Error as exc:
            raise store_error(f"cannot read {stream!r}", exc) from exc
        return list(map(_as_record, rows))

    def _head(self, stream: str) -> int:
        """The head, without reading the stream (the engine asks before every step)
        while nobody else has committed since this store's own last commit wrote it,
        or else while no other connection has committed since this one last read or
        wrote it."""
        if self._forks != _forks[0]:
            raise _forked_error(self.path)
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
        if self._forks != _forks[0]:
            raise _forked_error(self.path)
        # A range on the primary key: [lower, upper) where upper is the first string
        # past every name with the prefix (ids are ASCII, so bumping the last
        # character works), so even the last page of a listing is an index range scan.
        lower, strict = (after, True) if after is not None and after >= prefix else (prefix, False)
        upper = prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else None
        comparison = ">" if strict else ">="
        sql = f"SELECT name FROM loom_streams WHERE deleted = 0 AND name {comparison} ?"  # noqa: S608
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
        if self._forks != _forks[0]:
            raise _forked_error(self.path)
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
                    "DELETE FROM loom_records WHERE stream = ? AND position < ?", (stream, before)
                )
                connection.execute(
                    "UPDATE loom_streams SET floor = ? WHERE name = ?", (before - 1, stream)
                )
        except sqlite3.Error as exc:
            raise store_error(f"cannot trim {stream!r}", exc) from exc

    def _delete(self, stream: str) -> None:
        if self._forks != _forks[0]:
            raise _forked_error(self.path)
        self._forget_head(stream)
        try:
            with self._transaction("BEGIN IMMEDIATE") as connection:
                row = self._stream_row(connection, stream)
                if row is not None and row[2]:
                    return
                connection.execute("DELETE FROM loom_records WHERE stream = ?", (stream,))
                head = 0 if row is None else row[0]
                connection.execute(
                    "INSERT INTO loom_streams (name, floor, deleted) VALUES (?, ?, 1) "
                    "ON CONFLICT (name) DO UPDATE SET floor = excluded.floor, deleted = 1",
                    (stream, head),
                )
        except sqlite3.Error as exc:
            raise store_error(f"cannot delete {stream!r}", exc) from exc


def open_sqlite_store(url: str) -> SqliteStore:
    """Open `sqlite:///absolute/path.db`, `sqlite://relative/path.db` or `sqlite:///:memory:`.

    The path is percent-decoded (`%23` for a '#' in a file name, `%3F` for a '?').
    Query options: `synchronous` (off, normal, full (default), extra) and `timeout`
    (seconds to wait for another writer's lock, default 10).
    """
    parts = urlsplit(url)
    if parts.scheme != "sqlite":
        raise InvalidArgumentError(f"not a sqlite store URL: {url!r}")
    if "#" in url:
        raise InvalidArgumentError(
            f"a sqlite store URL has no fragment: '#' in {url!r} would cut the path short; "
            "write it as %23 in a file name"
        )
    path = unquote(parts.netloc + parts.path, errors="strict")
    if parts.netloc == "" and parts.path.startswith("/:memory:"):
        path = ":memory:"
    elif path.startswith("//"):  # sqlite:////abs/path, as SQLAlchemy spells it
        path = "/" + path.lstrip("/")
    if not path or path == "/":
        raise InvalidArgumentError(
            f"a sqlite store URL names a file: sqlite:///path/to/loom.db, not {url!r}"
        )
    return SqliteStore(path, SqliteOptions.parse(parts.query))


def _self_check_url(scratch: str) -> str:
    """A database in `loom stores`' scratch directory to check the store with."""
    return "sqlite:///" + os.path.join(scratch, "check.db").lstrip("/")


#: What the `loom.stores` entry point publishes for the `sqlite` scheme.
sqlite_store_factory = StoreFactory(open_sqlite_store, self_check_url=_self_check_url)
