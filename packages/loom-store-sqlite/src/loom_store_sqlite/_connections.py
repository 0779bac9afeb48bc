"""A store's connections: one per thread on a file (the in-memory database's one,
shared behind a lock), each counted in use while a call of its thread runs on it, and
closed when its thread ends or the store closes. Closing never closes a connection
under a statement another thread runs on it (that crashes the interpreter): a
connection in use is left to its call, which closes it as it ends.

Connections do not cross a fork: a forked child inherits its parent's unclosed,
holding SQLite's per-process state of the file but none of its locks. So the process
counts the forks it is away from the one it started as (a store opened before a fork
refuses every call after it: `forked_error`), and the databases its stores had open
as it forked (a child's store refuses to open them); a child closes none of its
parent's connections."""

from __future__ import annotations

import os
import sqlite3
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from loom_kernel.spi import StoreMisconfiguredError, StoreUnavailableError

from loom_store_sqlite._failures import store_error
from loom_store_sqlite._heads import KnownHeads
from loom_store_sqlite._options import SqliteOptions

__all__ = [
    "ThreadConnections",
    "forked_error",
    "forks",
    "inherited",
    "open_at_fork",
    "open_here",
    "open_lock",
]

#: Forks this process is away from the one it started as: +1 in each forked child.
forks: Final = [0]
#: The databases (real paths) stores of this process have open, and how many stores.
open_here: Final[Counter[str]] = Counter()
#: The databases open in the processes this one was forked from, as they forked: their
#: connections came along, unclosed, and hold SQLite's per-process state of the file.
open_at_fork: Final[set[str]] = set()
open_lock = [threading.Lock()]
#: Stores closed in a forked child: what they hold is the parent's, never closed here.
inherited: Final[list[object]] = []


def _count_fork() -> None:
    forks[0] += 1
    open_at_fork.update(name for name, stores in open_here.items() if stores > 0)
    open_here.clear()
    open_lock[0] = threading.Lock()  # the parent's may have been held by one of its threads


os.register_at_fork(after_in_child=_count_fork)


def forked_error(path: str) -> StoreMisconfiguredError:
    return StoreMisconfiguredError(
        f"sqlite database {path!r} was open in the process this one was forked from, and "
        "SQLite's connections must not cross a fork: the parent's came along, unclosed, "
        "holding SQLite's state of the file (its locks stayed with the parent), so writes "
        "here could be lost and calls could wait for ever; open the database only in "
        "processes that did not inherit it open (multiprocessing's 'spawn' or 'forkserver' "
        "start method), or fork before opening it"
    )


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
    store: weakref.ref[ThreadConnections], connection: sqlite3.Connection, pid: int
) -> None:
    if os.getpid() != pid:  # a forked child dropping the parent's threads: not its own
        return
    owner = store()
    if owner is None:
        connection.close()
    else:
        owner._forget_connection(connection)


class ThreadConnections:
    """The connections part of `SqliteStore` (a base of it): which connection a call
    uses (`_use`, then `_done`), and closing them (`_close_connections`).

    The store's `__init__` sets the state declared here, in an order that matters (see
    it); `close()` marks the store closed (`_closed`) before it closes connections.
    """

    path: str
    _options: SqliteOptions
    _memory: bool
    _target: str
    _serial: threading.RLock | None
    _local: threading.local
    _connections: list[sqlite3.Connection]
    _connections_lock: threading.RLock
    _uses: dict[sqlite3.Connection, _Uses]
    _left_to_users: set[sqlite3.Connection]
    _closed: bool
    _keeper: sqlite3.Connection

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

    def _close_connections(self) -> None:
        """For `close()`, once the store is marked closed: close every connection no
        call uses now, and leave each other one to the call using it (`_done`)."""
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
