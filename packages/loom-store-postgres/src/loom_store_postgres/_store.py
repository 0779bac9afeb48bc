"""The journal SPI on PostgreSQL: an append is one statement conditional on the head
(the stream's row moved from `expected`, or made at 0, and the records inserted, in
one round trip); appends of concurrent threads share one transaction (group commit);
reads are one statement, so a read sees one snapshot of the head, floor and records."""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, ClassVar, Final

import psycopg
from loom_kernel.spi import (
    WAKE_PREFIXES,
    AmbiguousWriteError,
    ConflictError,
    FaultInjection,
    FsspecBlobs,
    GroupCommit,
    InvalidArgumentError,
    JournalStore,
    LoomError,
    NewRecord,
    PendingAppend,
    Record,
    StoreMisconfiguredError,
    StoreUnavailableError,
    StreamDeletedError,
    SyncedOrNot,
    TrimmedError,
)
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from loom_store_postgres._failures import is_connection_lost, store_error
from loom_store_postgres._listening import Listener
from loom_store_postgres._options import PostgresOptions
from loom_store_postgres._schema import Statements, ensure_schema, schema_exists

__all__ = ["PostgresStore"]

Connection = psycopg.Connection[tuple[Any, ...]]

#: The largest payload of a record: PostgreSQL's 1 GB field limit, with room for the
#: protocol's copy of it (larger ones go to blobs: `blobs=`).
_MAX_RECORD_BYTES: Final = 256 * 1024 * 1024


class _HeadArrivedError(StoreUnavailableError):
    """An append at a head the stream had not reached when it looked, and had by the
    time the store asked why: it wrote nothing, and may go again at once."""


def channel_of(schema: str) -> str:
    """The NOTIFY channel of the store in `schema`: an identifier of at most 63 bytes
    (a long schema's name is hashed)."""
    channel = f"loom_{schema}"
    if len(channel) <= 63:
        return channel
    return "loom_" + hashlib.blake2b(schema.encode(), digest_size=16).hexdigest()


def session_settings(conninfo: str, timeout: float) -> str:
    """libpq's `options` for every connection of a store: the URL's own, then a wait of
    no longer than `timeout` for a lock or a statement (at least a millisecond: 0
    would turn them off), and synchronous_commit on whatever the role or database says
    (off would lose acknowledged appends in a crash).

    Raises:
        InvalidArgumentError: libpq cannot read the URL.
    """
    try:
        theirs = conninfo_to_dict(conninfo).get("options")
    except psycopg.Error as exc:
        raise InvalidArgumentError(f"a PostgreSQL store URL libpq cannot read: {exc}") from exc
    milliseconds = max(1, round(timeout * 1000))
    ours = (
        f"-c statement_timeout={milliseconds} -c lock_timeout={milliseconds} "
        "-c synchronous_commit=on"
    )
    return f"{theirs} {ours}" if theirs else ours


def _commit_failure(append: PendingAppend, exc: BaseException, *, alone: bool) -> BaseException:
    """The error of an append whose group failed with `exc`: a lasting refusal as it
    is; anything else, an outcome its commit id tells."""
    if isinstance(exc, StoreMisconfiguredError) or (
        alone and isinstance(exc, InvalidArgumentError)
    ):
        return exc
    return _lost(append.stream)


#: The first statement of a transaction holding only unsynced appends.
_UNSYNCED: Final = "SET LOCAL synchronous_commit TO OFF"


class _RefusedError(Exception):
    """Internal: the lone append of a transaction was refused: roll it back."""


def _lost(stream: str) -> AmbiguousWriteError:
    return AmbiguousWriteError(f"the connection was lost appending to {stream!r}")


class PostgresStore(FaultInjection, SyncedOrNot, JournalStore):
    """Streams in one PostgreSQL schema, shared by threads, processes and machines.

    Args:
        conninfo: libpq's connection URI (`postgresql://user@host:port/database`).
        options: the schema, the pool's size, timeouts, blobs and notifications.
        create: False to open only a store whose tables exist (StoreMisconfiguredError
            otherwise): a command that reads never creates a store.

    Raises:
        StoreMisconfiguredError: the server refused the login, the database is
            missing, the user may not create the schema, or the tables are newer.
        StoreUnavailableError: the server could not be reached.
    """

    head_is_cheap: ClassVar[bool] = True
    max_record_bytes = _MAX_RECORD_BYTES

    def __init__(
        self, conninfo: str, options: PostgresOptions | None = None, *, create: bool = True
    ) -> None:
        self.options = options = options or PostgresOptions()
        self._pid = os.getpid()
        self._statements = Statements.of(options.schema)
        self._channel = channel_of(options.schema)
        self._conninfo = conninfo
        connect_options: dict[str, Any] = {
            "options": session_settings(conninfo, options.timeout),
            "connect_timeout": max(1, round(options.timeout)),
        }
        self._closed = False
        try:
            with psycopg.connect(conninfo, autocommit=True, **connect_options) as connection:
                if create:
                    ensure_schema(connection, options.schema)
                elif not schema_exists(connection, options.schema):
                    raise StoreMisconfiguredError(
                        f"no Loom store in schema {options.schema!r} of the database: check "
                        "the store URL; this command reads an existing store and creates none"
                    )
                else:
                    ensure_schema(connection, options.schema)  # checks its version
        except psycopg.Error as exc:
            raise store_error("cannot open the PostgreSQL store", exc) from exc
        self._pool: ConnectionPool[Connection] = ConnectionPool(
            conninfo,
            min_size=options.pool_min,
            max_size=options.pool_max,
            kwargs={"autocommit": True, "prepare_threshold": 0, **connect_options},
            timeout=options.timeout,
            name=f"loom-{options.schema}",
            open=True,
        )
        self._group = GroupCommit(self._commit_group)
        self._listener: Listener | None = None
        if options.blobs is not None:
            self.use_blobs(FsspecBlobs(options.blobs), options.blob_threshold)

    @property
    def conninfo(self) -> str:
        """libpq's connection URI the store was opened with (with any password in it)."""
        return self._conninfo

    # -- connections --------------------------------------------------------------

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:
            raise StoreMisconfiguredError(
                "a PostgreSQL store does not cross a fork: this process was forked from "
                "the one that opened it, whose pooled connections and group commit it "
                "cannot share; open the store again in the child (or start it by spawn)"
            )

    @contextmanager
    def _connection(self, what: str) -> Iterator[Connection]:
        """A pooled connection; psycopg's errors in the kernel's tree."""
        self._check_fork()
        try:
            with self._pool.connection() as connection:
                yield connection
        except PoolTimeout as exc:
            raise StoreUnavailableError(
                f"{what}: no connection to PostgreSQL within {self.options.timeout} s ({exc})"
            ) from exc
        except PoolClosed as exc:
            raise StoreUnavailableError(f"{what}: the store is closed") from exc
        except psycopg.Error as exc:
            if is_connection_lost(exc):
                self._drop_dead_connections()
            raise store_error(what, exc) from exc

    def _drop_dead_connections(self) -> None:
        """After a connection was lost (a server restart drops them all), have the pool
        try each idle one and replace the dead, so the next call gets a live one."""
        with suppress(psycopg.Error, PoolClosed, PoolTimeout):
            self._pool.check()

    def _query(self, what: str, query: str, params: Any) -> list[tuple[Any, ...]]:
        """The rows of a read-only `query`, tried twice: a pooled connection the server
        dropped meanwhile (a restart) fails the first try only."""
        for attempt in (1, 2):
            try:
                with self._connection(what) as connection:
                    return connection.execute(query, params, binary=True).fetchall()
            except StoreUnavailableError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    # -- appends ------------------------------------------------------------------

    def _append_as(
        self, stream: str, expected: int, records: tuple[NewRecord, ...], *, sync: bool
    ) -> int:
        # Before the group: a parent's thread leading a group as the process forked
        # would leave this child's append queued behind a leader that is not here.
        self._check_fork()
        lose_reply = self._next_fault(stream)
        params: dict[str, Any] = {
            "stream": stream,
            "expected": expected,
            "head": expected + len(records),
            "first": expected + 1,
            "commit": secrets.randbits(63),
            "channel": self._channel,
        }
        if len(records) == 1:
            record = records[0]
            params.update(kind=record.kind, payload=record.payload, ts=float(record.timestamp))
        else:
            params.update(
                kinds=[record.kind for record in records],
                payloads=[record.payload for record in records],
                stamps=[float(record.timestamp) for record in records],
            )
        notify = self.options.notify and stream.startswith(WAKE_PREFIXES)
        sql = self._statements.appends[(expected == 0, len(records) == 1, notify)]
        pending = PendingAppend(stream, expected, [sql, params], sync=sync)
        try:
            self._group.submit(pending)
            if lose_reply:
                raise _lost(stream)
        except (AmbiguousWriteError, StoreUnavailableError) as exc:
            return self._confirm(stream, expected, len(records), params["commit"], exc)
        return expected + len(records)

    def _confirm(
        self, stream: str, expected: int, count: int, commit: int, cause: BaseException
    ) -> int:
        """Whether an append whose outcome is unknown landed: the commit id of the record
        after `expected` tells (docs/spi.md, *Ambiguous failures*)."""
        try:
            rows = self._query(
                f"cannot confirm an append to {stream!r}",
                self._statements.confirm,
                (expected + 1, stream),
            )
        except StoreUnavailableError as exc:
            raise StoreUnavailableError(
                f"an append to {stream!r} may or may not have landed ({cause}), and the "
                f"store cannot tell now ({exc}): re-read the stream before retrying"
            ) from exc
        if not rows:
            raise StoreUnavailableError(f"an append to {stream!r} did not land ({cause})")
        head, deleted, floor, found = rows[0]
        if found == commit:
            return expected + count
        if deleted:
            raise StreamDeletedError(stream, head)
        if found is None and floor > expected:  # trimmed off since: whose was it?
            raise StoreUnavailableError(
                f"an append to {stream!r} may or may not have landed ({cause}), and the "
                "record that would tell was trimmed meanwhile: re-read the stream"
            )
        if head == expected:
            raise StoreUnavailableError(
                f"an append to {stream!r} did not land, or has not yet ({cause}): re-read "
                "the stream before retrying"
            )
        raise ConflictError(stream, expected, head)

    def _commit_group(self, batch: list[PendingAppend]) -> None:
        """Commit a group's appends: one alone in a statement of its own, several in one
        transaction sent as a pipeline; each gets its own verdict."""
        # A group of unsynced appends alone commits with synchronous_commit off, for
        # its transaction only: the WAL is flushed in order, so the next synced commit
        # (or the WAL writer, within three wal_writer_delay) makes it durable too.
        unsynced = not any(append.sync for append in batch)
        try:
            with self._connection("cannot append") as connection:
                if len(batch) == 1 and not unsynced:
                    self._apply(connection, batch)
                    return
                # Row locks taken in one order by every group of every process: two
                # groups holding streams the other wants would deadlock (a second's
                # stall, then one rolled back). A stable sort keeps one stream's
                # appends in the order their heads chain.
                ordered = sorted(batch, key=lambda append: append.stream)
                try:
                    with connection.transaction():
                        if unsynced:
                            connection.execute(_UNSYNCED)
                        self._apply(connection, ordered)
                        if len(batch) == 1 and batch[0].error is not None:
                            raise _RefusedError  # its statement may have aborted the transaction
                except _RefusedError:
                    pass
                except psycopg.Error as exc:
                    if is_connection_lost(exc) or connection.closed:
                        raise
                    # One append's error (a value too large, say) rolled back the
                    # others: each goes again alone, for its own verdict.
                    for append in batch:
                        append.error = None
                        self._apply(connection, [append])
        except (psycopg.Error, LoomError) as exc:
            # What reaches here is a lost connection (the connection's context turned
            # it into StoreUnavailableError), a fork or a lasting refusal: a statement's
            # own errors are caught where it runs.
            for append in batch:
                # A group's verdicts were read inside its transaction: a conflict with an
                # earlier append of the group is void if the group did not commit. So
                # every append of a failed group confirms by its commit id.
                if append.error is None or len(batch) > 1:
                    append.error = _commit_failure(append, exc, alone=len(batch) == 1)

    def _apply(self, connection: Connection, batch: list[PendingAppend]) -> None:
        """Run each append's statement (in a pipeline when several), and set the error of
        each that found the head elsewhere."""
        if len(batch) == 1:
            append = batch[0]
            sql, params = append.rows
            try:
                row = connection.execute(sql, params).fetchone()
            except psycopg.Error as exc:
                if is_connection_lost(exc):
                    raise
                append.error = store_error(f"cannot append to {append.stream!r}", exc)
                return
            if row is None or row[0] == 0:
                append.error = self._refusal(connection, append)
                if isinstance(append.error, _HeadArrivedError):  # it wrote nothing: once more
                    append.error = None
                    row = connection.execute(sql, params).fetchone()
                    if row is None or row[0] == 0:
                        append.error = self._refusal(connection, append)
            if isinstance(append.error, _HeadArrivedError):
                append.error = StoreUnavailableError(
                    f"an append to {append.stream!r} did not land: retry it"
                )
            return
        with connection.pipeline() as pipeline:
            cursors = [connection.execute(*append.rows) for append in batch]
            pipeline.sync()
            counts = [cursor.fetchone() for cursor in cursors]
        for append, row in zip(batch, counts, strict=True):
            if row is None or row[0] == 0:
                append.error = self._refusal(connection, append)

    def _refusal(self, connection: Connection, append: PendingAppend) -> BaseException:
        """Why an append wrote nothing: the stream is deleted, or its head is elsewhere."""
        row = connection.execute(self._statements.state, (append.stream,)).fetchone()
        head, deleted = (0, False) if row is None else row
        if deleted:
            return StreamDeletedError(append.stream, head)
        if head == append.expected:  # others brought the head there since it looked
            return _HeadArrivedError(f"an append to {append.stream!r} did not land: retry it")
        return ConflictError(append.stream, append.expected, head)

    # -- reads --------------------------------------------------------------------

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        rows = self._query(
            f"cannot read {stream!r}",
            self._statements.read,
            {"stream": stream, "after": after, "limit": limit},
        )
        if not rows:
            return []
        floor, deleted = rows[0][0], rows[0][1]
        if deleted:
            raise StreamDeletedError(stream, floor)
        if after < floor:
            raise TrimmedError(stream, after, floor)
        if rows[0][2] is None:
            return []
        return [Record(row[2], row[3], row[4], row[5]) for row in rows]

    def _head(self, stream: str) -> int:
        rows = self._query(f"cannot read the head of {stream!r}", self._statements.state, (stream,))
        if not rows:
            return 0
        head, deleted = rows[0]
        if deleted:
            raise StreamDeletedError(stream, head)
        return int(head)

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        # Every id character sorts below \x7f, so the names starting with `prefix` are
        # exactly those from `prefix` up to `prefix` + \x7f (COLLATE "C": byte order).
        rows = self._query(
            f"cannot list streams under {prefix!r}",
            self._statements.streams,
            {"low": prefix, "high": prefix + "\x7f", "after": after or "", "limit": limit},
        )
        return [row[0] for row in rows]

    # -- trims and deletions -------------------------------------------------------

    def _trim(self, stream: str, before: int) -> None:
        statements = self._statements
        with self._connection(f"cannot trim {stream!r}") as connection, connection.transaction():
            row = connection.execute(statements.lock_for_trim, (stream,)).fetchone()
            if row is None:
                self._check_trim(stream, before, 0)
                return
            head, floor, deleted = row
            if deleted:
                raise StreamDeletedError(stream, head)
            self._check_trim(stream, before, head)
            if before - 1 <= floor:
                return
            connection.execute(statements.trim_floor, (before - 1, stream))
            connection.execute(statements.trim_records, (stream, before))

    def _delete(self, stream: str) -> None:
        statements = self._statements
        with self._connection(f"cannot delete {stream!r}") as connection, connection.transaction():
            connection.execute(statements.delete_stream, (stream,))
            connection.execute(statements.delete_records, (stream,))

    # -- wake-ups and closing --------------------------------------------------------

    def subscribe_wakes(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake()` when an append that has work for workers lands, from any
        process (LISTEN/NOTIFY); returns the function that stops it. With
        `notify=off`, never (workers poll)."""
        self._check_fork()
        if self._closed:
            raise StoreUnavailableError("the PostgreSQL store is closed: no wake-ups from it")
        if not self.options.notify:
            return lambda: None
        if self._listener is None:
            self._listener = Listener(self._conninfo, self._channel)
        return self._listener.subscribe(wake)

    def close(self) -> None:
        """Close the pool and stop listening."""
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        if os.getpid() == self._pid:
            self._pool.close()
