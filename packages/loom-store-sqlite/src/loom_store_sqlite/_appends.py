"""Appends: each a head check and an insert in one transaction, the appends of
concurrent threads committed in groups (`GroupCommit`), a lone one-record append as
one statement, and an append whose outcome is not known (a lost reply, a failed
commit) confirmed by the commit id its first record carries. A group's commit,
witnessed, shares the heads it wrote with the store's other threads (`StampedHeads`)."""

from __future__ import annotations

import itertools
import os
import sqlite3
import threading
from contextlib import suppress
from time import monotonic
from typing import Final

from loom_kernel.spi import (
    AmbiguousWriteError,
    ConflictError,
    FaultInjection,
    GroupCommit,
    InvalidArgumentError,
    NewRecord,
    PendingAppend,
    StoreUnavailableError,
    StreamDeletedError,
    SyncedOrNot,
)

from loom_store_sqlite._connections import forked_error, forks
from loom_store_sqlite._failures import store_error
from loom_store_sqlite._heads import DATA_VERSION, KnownHeads, StampedHeads
from loom_store_sqlite._packing import Kinds, pack
from loom_store_sqlite._transactions import Transactions, begin_transaction, roll_back
from loom_store_sqlite._walindex import WalIndex

__all__ = ["Appends", "commit_id"]

#: Seconds after a group of several appends, or one led by another thread than the
#: last, during which groups are witnessed (`SqliteStore._witness`).
_CROWDED: Final = 0.05


_commit_ids: Final = itertools.count()
#: Commit ids are below 2**47, which SQLite keeps in six bytes.
_COMMIT_ID_BITS: Final = 47
_commit_base: Final = [int.from_bytes(os.urandom(8)) >> (64 - _COMMIT_ID_BITS)]


def _new_commit_base() -> None:
    _commit_base[0] = int.from_bytes(os.urandom(8)) >> (64 - _COMMIT_ID_BITS)


# A forked child must not reuse its parent's ids (both would count on from one value).
os.register_at_fork(after_in_child=_new_commit_base)


def commit_id() -> int:
    """An id no other append of this process has (for its first 2**47), and another
    process's only by a chance of about one in 2**47: a random base drawn once per
    process (again after a fork), then a counter (a random id per append costs a
    syscall, and so would a check of the process id). It tells an ambiguous commit's
    own record from another writer's at the same position."""
    return (_commit_base[0] + next(_commit_ids)) & ((1 << _COMMIT_ID_BITS) - 1)


_STREAM_STATE: Final = (
    "SELECT (SELECT MAX(position) FROM loom_rows WHERE stream = s.id), s.floor, s.deleted "
    "FROM loom_names AS s WHERE s.name = ?"
)
#: A row (stream name, position, kind number, payload, timestamp, commit id): the
#: stream's number is looked up by its name.
_INSERT_RECORD: Final = (
    "INSERT INTO loom_rows (stream, position, kind, payload, timestamp, txn) "
    "VALUES ((SELECT id FROM loom_names WHERE name = ?), ?, ?, ?, ?, ?)"
)
#: The first record of an append to an existing stream, inserted only if the stream is
#: live and its head (its last position, or its floor) is the expected one: the head
#: check and the insert in one statement. Parameters: the row, then the expected head.
#: Off the head (or on a stream deleted or never written) the stream's number is
#: NULL, and OR IGNORE skips the row (its NOT NULL constraint) instead of failing:
#: nothing is inserted and no error raised. A one-row VALUES, not INSERT ... SELECT: a
#: SELECT reading the table it inserts into is first copied to a temporary b-tree,
#: which cost a third of the statement.
_INSERT_AT_HEAD: Final = (
    "INSERT OR IGNORE INTO loom_rows (stream, position, kind, payload, timestamp, txn) "
    "VALUES ((SELECT s.id FROM loom_names AS s WHERE s.name = ?1 AND s.deleted = 0 "
    "AND ?7 = max(s.floor, coalesce((SELECT MAX(position) FROM loom_rows "
    "WHERE stream = s.id), 0))), ?2, ?3, ?4, ?5, ?6)"
)


class _InsertRefusedError(Exception):
    """SQLite refused an insert of a group tried without savepoints."""

    def __init__(self, cause: sqlite3.Error) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Appends(Transactions, FaultInjection, SyncedOrNot):
    """The appends part of `SqliteStore` (a base of it): `_append` and the group
    commit behind it, and what the store's other hooks share with them (`_stream_row`,
    `_at`, `_forget_head`). The store's `__init__` sets the state declared here."""

    _forks: int
    _group: GroupCommit
    _commit_lock: threading.RLock | threading.Lock
    _wal: WalIndex | None
    _stamped: StampedHeads
    _last_leader: int
    _crowded_until: float
    _kinds: Kinds

    def _row(
        self, stream: str, position: int, record: NewRecord, txn: int | None
    ) -> tuple[str, int, int, bytes, float, int | None]:
        """A record's row: its kind's number, negated when its payload is packed."""
        number = self._kinds.number(record.kind)
        if number is None:
            self._number_kind(record.kind)
            number = self._kinds.number(record.kind)
            assert number is not None
        packed = pack(record.payload)
        if packed is None:
            return (stream, position, number, record.payload, float(record.timestamp), txn)
        return (stream, position, -number, packed, float(record.timestamp), txn)

    def _number_kind(self, kind: str) -> None:
        """Give a kind this store has not met a number in the database, in a
        transaction of its own (committed before any row names it)."""
        try:
            with self._transaction("BEGIN IMMEDIATE") as connection:
                self._kinds.add(connection, {kind})
            with self._transaction() as connection:
                self._kinds.learn(connection)
        except sqlite3.Error as exc:
            raise store_error(f"cannot number the record kind {kind!r}", exc) from exc

    @staticmethod
    def _stream_row(connection: sqlite3.Connection, stream: str) -> tuple[int, int, int] | None:
        """(head, floor, deleted) of a stream ever written, else None."""
        row = connection.execute(_STREAM_STATE, (stream,)).fetchone()
        if row is None:
            return None
        head, floor, deleted = row
        return (floor if deleted or head is None else max(head, floor)), floor, deleted

    def _append_as(
        self, stream: str, expected: int, records: tuple[NewRecord, ...], *, sync: bool
    ) -> int:
        if self._forks != forks[0]:
            raise forked_error(self.path)
        lose_reply = self._next_fault(stream)
        txn = commit_id()
        # The commit id marks the batch's first record.
        rows = [self._row(stream, expected + 1, records[0], txn)]
        if len(records) > 1:
            rows += [
                self._row(stream, position, record, None)
                for position, record in enumerate(records[1:], start=expected + 2)
            ]
        try:
            try:
                self._group.submit(PendingAppend(stream, expected, rows, sync=sync))
            except BaseException:
                self._forget_head(stream)
                raise
            if lose_reply:
                raise AmbiguousWriteError
        except (AmbiguousWriteError, StoreUnavailableError) as exc:
            return self._confirm(stream, expected, len(records), txn, exc)
        except InvalidArgumentError:  # a record SQLite refused as too big: nothing landed
            self._refuse_as_read_first(stream, expected)
            raise
        return expected + len(records)

    def _refuse_as_read_first(self, stream: str, expected: int) -> None:
        """Raise what an append meets before its records are looked at: a deleted
        stream (StreamDeletedError) or a head elsewhere (ConflictError). SQLite refuses
        a record too big as it binds it, before the insert checks the head."""
        try:
            with self._transaction() as connection:
                row = self._stream_row(connection, stream)
        except sqlite3.Error as exc:
            raise store_error(f"cannot read the state of {stream!r}", exc) from exc
        head = 0 if row is None else row[0]
        if row is not None and row[2]:
            raise StreamDeletedError(stream, head)
        if head != expected:
            raise ConflictError(stream, expected, head)

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
        # Unsynced only if every append in it is (and the store syncs commits at all).
        unsynced = self._syncs_each_commit and not any(append.sync for append in batch)
        with self._commit_lock:
            landed: list[PendingAppend] | None = None
            connection: sqlite3.Connection | None = None
            try:
                connection = self._use()
                if not self._synced_as(connection, batch, synced=not unsynced):
                    return
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
                if unsynced:  # its commit is over: the connection syncs again
                    with suppress(sqlite3.Error):  # else its next write sets it
                        self._restore_sync(connection)
            finally:
                if connection is not None:
                    self._done(connection)
        known: KnownHeads | None  # `_known_heads()`, inline: every append comes here
        if landed and not self._memory and (known := getattr(self._local, "heads", None)):
            for append in landed:
                known.learn(append.stream, append.expected + len(append.rows))

    def _synced_as(
        self, connection: sqlite3.Connection, batch: list[PendingAppend], *, synced: bool
    ) -> bool:
        """Before a group commits: the connection set to sync its commit, or not (a
        group of unsynced appends alone, see `JournalStore.append`); False, with an
        error on every append of the group, when SQLite refused the setting.

        An unsynced commit is SQLite's `synchronous=NORMAL` for that one commit: in
        WAL mode it lands in the WAL after every commit before it and before every
        commit after it, and the WAL is synced whole, so the next synced commit of any
        connection makes it durable too; a checkpoint syncs the WAL first, as at FULL.
        The connection is marked unsynced (`_local.unsynced`) before its level goes
        down and unmarked only once it is back, so an interrupt between them leaves
        it marked, and the next write of its thread (here, or `_in_transaction`) sets
        it back first (`_restore_sync`).
        """
        try:
            if synced:
                self._restore_sync(connection)
            else:
                roll_back(connection)  # the level cannot change inside a transaction
                self._local.unsynced = connection
                connection.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.Error as exc:
            for append in batch:
                append.error = store_error(f"sqlite cannot set synchronous on {self.path!r}", exc)
            return False
        return True

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
            roll_back(connection)
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
                roll_back(connection)
            finally:  # nothing landed: what the first appends were judged against is gone
                for append in batch:
                    append.error = None
            if len(batch) > 1:
                return None
            batch[0].error = store_error(f"sqlite append failed on {self.path!r}", refused.cause)
            return []
        except sqlite3.Error as exc:
            roll_back(connection)
            for append in self._undecided(batch, landed):
                append.error = store_error(f"sqlite append failed on {self.path!r}", exc)
            return []
        except BaseException:
            # An interrupt (KeyboardInterrupt, a signal handler raising) between BEGIN
            # and COMMIT: roll back, or this connection stays in a transaction that
            # holds the write lock and refuses its own next BEGIN.
            roll_back(connection)
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
            roll_back(connection)
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
                    "INSERT INTO loom_names (name, floor, deleted) VALUES (?, 0, 0)",
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
        self, stream: str, expected: int, count: int, txn: int, cause: BaseException
    ) -> int:
        """After an ambiguous commit: the batch's first record tells whose write landed."""
        self._forget_head(stream)
        try:
            with self._transaction() as connection:
                row = self._stream_row(connection, stream)
                found = connection.execute(
                    "SELECT txn FROM loom_rows WHERE stream = "
                    "(SELECT id FROM loom_names WHERE name = ?) AND position = ?",
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
