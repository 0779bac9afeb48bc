"""Appends under attack: interrupts mid-append, locks held by another writer, commits
SQLite refuses, records too big, lost replies confirmed by commit id, and commit ids
no forked child makes again."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from loom_kernel.spi import (
    ConflictError,
    Fault,
    NewRecord,
    StoreMisconfiguredError,
    StoreUnavailableError,
)
from loom_store_sqlite import SqliteStore, open_sqlite_store
from loom_store_sqlite.testing import raw_connection


def _records(count: int, tag: str = "r") -> list[NewRecord]:
    return [NewRecord("k", f"{tag}{i}".encode(), float(i)) for i in range(count)]


class InterruptedStore(SqliteStore):
    """Raises KeyboardInterrupt once, inside the append's transaction (after BEGIN)."""

    interrupt = False

    def _stage(self, connection: sqlite3.Connection, append: Any, *args: Any, **kw: Any) -> bool:
        if InterruptedStore.interrupt:
            InterruptedStore.interrupt = False
            raise KeyboardInterrupt
        return super()._stage(connection, append, *args, **kw)


def test_an_interrupt_inside_an_append_leaves_no_transaction_open(tmp_path: Path) -> None:
    path = str(tmp_path / "interrupted.db")
    store = InterruptedStore(path)
    store.append("s", 0, _records(1))
    InterruptedStore.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        store.append("s", 1, _records(2, "lost"))  # two records: a transaction of its own
    assert not raw_connection(store).in_transaction
    assert store.append("s", 1, _records(1, "next")) == 2, "the store's own next append works"
    other = open_sqlite_store(f"sqlite://{path}?timeout=0")  # another process, no waiting
    assert other.append("s", 2, _records(1, "other")) == 3, "no write lock was left behind"
    assert [r.payload for r in other.read("s")] == [b"r0", b"next0", b"other0"]


def test_a_lone_append_interrupted_in_its_statement_lands_nothing_and_holds_no_lock(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "interrupted.db")
    store = open_sqlite_store(f"sqlite://{path}")
    store.append("s", 0, _records(1))
    connection = raw_connection(store)
    connection.set_progress_handler(lambda: 1, 1)  # SQLite aborts every statement
    try:
        with pytest.raises(StoreUnavailableError):
            store.append("s", 1, _records(1, "lost"))  # one statement, no BEGIN or COMMIT
    finally:
        connection.set_progress_handler(None, 1)
    assert not connection.in_transaction
    other = open_sqlite_store(f"sqlite://{path}?timeout=0")  # another process, no waiting
    assert other.append("s", 1, _records(1, "other")) == 2, "nothing landed, no lock left"
    assert store.append("s", 2, _records(1, "next")) == 3, "the store's own next append works"
    assert [r.payload for r in other.read("s")] == [b"r0", b"other0", b"next0"]


class _InterruptedStatement:
    """A connection whose next statement is interrupted (a Ctrl-C landing in it), before
    it runs or as it returns, after it committed."""

    def __init__(self, connection: sqlite3.Connection, when: str) -> None:
        self._connection = connection
        self._when = when

    def execute(self, sql: str, parameters: Any = ()) -> Any:
        if self._when == "after":
            self._connection.execute(sql, parameters)
        raise KeyboardInterrupt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)


class InterruptedLoneInsertStore(SqliteStore):
    """Interrupts the next lone append's one statement (see `_InterruptedStatement`)."""

    when: str | None = None

    def _insert_alone(self, connection: sqlite3.Connection, append: Any) -> Any:
        when, self.when = self.when, None
        if when is not None:
            connection = _InterruptedStatement(connection, when)  # type: ignore[assignment]
        return super()._insert_alone(connection, append)


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupt_in_a_lone_append_s_statement_is_raised_as_it_was(
    tmp_path: Path, when: str
) -> None:
    store = InterruptedLoneInsertStore(str(tmp_path / "interrupted.db"))
    store.append("s", 0, _records(1))
    store.when = when
    with pytest.raises(KeyboardInterrupt):
        store.append("s", 1, _records(1, "maybe"))
    assert not raw_connection(store).in_transaction
    landed = [b"r0", b"maybe0"] if when == "after" else [b"r0"]
    assert [r.payload for r in store.read("s")] == landed, "it committed or it did not"
    head = len(landed)
    assert store.head("s") == head
    assert store.append("s", head, _records(1, "next")) == head + 1


class _RefusedCommit:
    """A connection whose COMMIT SQLite refuses: with SQLITE_READONLY_DBMOVED (the file
    was moved away: it lasts), the transaction left open; or with SQLITE_IOERR_WRITE
    (it may pass), after SQLite rolled the transaction back by itself."""

    def __init__(self, connection: sqlite3.Connection, code: int) -> None:
        self._connection = connection
        self._code = code

    def execute(self, sql: str, parameters: Any = ()) -> Any:
        if sql == "COMMIT":
            if self._code == IOERR_WRITE:
                self._connection.execute("ROLLBACK")
            refused = sqlite3.OperationalError("the commit failed")
            refused.sqlite_errorcode = self._code
            raise refused
        return self._connection.execute(sql, parameters)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)


READONLY_DBMOVED, IOERR_WRITE = 1032, 778


class RefusedCommitStore(SqliteStore):
    refuse: int | None = None

    def _transact(self, connection: sqlite3.Connection, batch: Any, *, isolated: bool) -> Any:
        if self.refuse is not None:
            connection = _RefusedCommit(connection, self.refuse)  # type: ignore[assignment]
        return super()._transact(connection, batch, isolated=isolated)


@pytest.mark.parametrize(
    ("code", "failure"),
    [(READONLY_DBMOVED, StoreMisconfiguredError), (IOERR_WRITE, StoreUnavailableError)],
)
def test_a_group_whose_commit_fails_keeps_the_conflicts_it_decided_before(
    tmp_path: Path, code: int, failure: type[Exception]
) -> None:
    from loom_kernel.spi import PendingAppend

    store = RefusedCommitStore(str(tmp_path / "refused.db"))
    for stream in "ab":
        store._commit_group([PendingAppend(stream, 0, [(stream, 1, 1, b"first", 1.0, None)])])
    lands = PendingAppend("a", 1, [("a", 2, 1, b"x", 1.0, None)])
    after_it = PendingAppend("a", 1, [("a", 2, 1, b"y", 1.0, None)])  # judged against `lands`
    stale = PendingAppend("b", 0, [("b", 1, 1, b"z", 1.0, None)])  # judged against the file
    store.refuse = code
    store._commit_group([lands, after_it, stale])
    assert isinstance(lands.error, failure)
    assert isinstance(after_it.error, failure), "alone it might have landed"
    assert isinstance(stale.error, ConflictError), "no rollback changes the head it met"
    store.refuse = None
    assert not raw_connection(store).in_transaction
    assert [store.head(stream) for stream in "ab"] == [1, 1]


def test_a_writer_stuck_behind_a_lock_gets_store_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    store = open_sqlite_store(f"sqlite://{path}?timeout=0.2")
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreUnavailableError):
            store.append("s", 0, _records(1))
    finally:
        blocker.execute("ROLLBACK")
    assert store.append("s", 0, _records(1)) == 1, "nothing landed while it was locked"


class CountingConfirmStore(SqliteStore):
    """Counts how often the ambiguous-commit confirmation runs."""

    confirmations = 0

    def _confirm(
        self, stream: str, expected: int, count: int, txn: int, cause: BaseException
    ) -> int:
        CountingConfirmStore.confirmations += 1
        return super()._confirm(stream, expected, count, txn, cause)


def test_a_lost_reply_really_takes_the_confirmation_path(tmp_path: Path) -> None:
    store = CountingConfirmStore(str(tmp_path / "lost.db"))
    store.append("s", 0, _records(1))
    assert CountingConfirmStore.confirmations == 0
    store.inject_fault(Fault.LOST_REPLY)
    assert store.append("s", 1, _records(2, "x")) == 3
    assert CountingConfirmStore.confirmations == 1, "the landed write was confirmed by its id"
    store.inject_fault(Fault.LOST_REPLY)
    with pytest.raises(ConflictError):
        store.append("s", 1, _records(1, "stale"))  # refused inside: nothing to confirm
    assert CountingConfirmStore.confirmations == 1


def test_a_lone_append_on_a_connection_left_in_a_transaction_commits_for_real(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "left.db")
    store = open_sqlite_store(f"sqlite://{path}")
    store.append("s", 0, _records(1))
    raw_connection(store).execute("BEGIN IMMEDIATE")  # left open by something interrupted
    assert store.append("s", 1, _records(1, "next")) == 2
    other = open_sqlite_store(f"sqlite://{path}?timeout=0")
    assert [r.payload for r in other.read("s")] == [b"r0", b"next0"]


def test_a_record_too_big_for_a_deleted_stream_says_deleted(tmp_path: Path) -> None:
    from loom_kernel.spi import StreamDeletedError

    store = open_sqlite_store(f"sqlite://{tmp_path}/big.db")
    store.append("s", 0, _records(1))
    store.delete("s")
    connection = raw_connection(store)
    connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 100)
    with pytest.raises(StreamDeletedError):
        store.append("s", 1, [NewRecord("k", b"x" * 1000, 1.0)])


def test_a_forked_child_never_makes_a_commit_id_its_parent_makes() -> None:
    script = """
        import os
        from loom_store_sqlite._appends import commit_id
        before = commit_id()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, " ".join(str(commit_id()) for _ in range(3)).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        child = set(os.read(read, 4096).decode().split())
        parent = {str(commit_id()) for _ in range(3)}
        print(len(child), len(parent), len(child & parent), str(before) in child)
        """
    child = [sys.executable, "-c", textwrap.dedent(script)]  # a fork of its own, not pytest's
    done = subprocess.run(child, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3 3 0 False"


def test_a_record_over_sqlites_limit_is_refused_as_bad_input_not_a_fault(
    tmp_path: Path,
) -> None:
    """A payload over SQLite's length limit was reported as StoreUnavailableError, 'retry
    it', though no retry can take it. The store states the limit, the SPI refuses a
    larger record first, and SQLite's own refusal (SQLITE_TOOBIG) is InvalidArgumentError
    too, with nothing written."""
    from loom_kernel.spi import InvalidArgumentError
    from loom_store_sqlite.testing import raw_connection

    store = open_sqlite_store(f"sqlite:///{tmp_path}/big.db")
    try:
        assert store.max_record_bytes == 1_000_000_000 - 4096, "SQLite's limit, less a row's room"
        raw_connection(store).setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1000)  # this thread's
        with pytest.raises(InvalidArgumentError, match="over SQLite's limit"):
            store.append("s", 0, [NewRecord("k", b"x" * 2000, 1.0)])
        assert store.head("s") == 0, "nothing written"
        assert store.append("s", 0, [NewRecord("k", b"x" * 100, 1.0)]) == 1, "the store goes on"
    finally:
        store.close()


def test_a_lone_append_after_an_interrupt_left_a_transaction_open_lands_for_real(
    tmp_path: Path,
) -> None:
    """A transaction an interrupt left open on the store's connection is rolled back
    before the next append, which lands for every other connection to see."""
    path = str(tmp_path / "left-open.db")
    store = open_sqlite_store(f"sqlite://{path}")
    for position in range(3):  # one thread, one record at a time: the uncrowded path
        store.append("s", position, _records(1, f"r{position}-"))
    real = raw_connection(store)
    real.execute("BEGIN")  # what an interrupt between BEGIN and COMMIT leaves behind
    real.execute("SELECT count(*) FROM loom_rows").fetchone()
    assert real.in_transaction
    assert store.append("s", 3, _records(1, "after")) == 4
    assert not real.in_transaction
    other = open_sqlite_store(f"sqlite://{path}?timeout=0")  # another process
    assert [r.payload for r in other.read("s", 3)] == [b"after0"], "committed, for real"
    assert other.append("s", 4, _records(1, "other")) == 5, "no lock was left behind"


def test_a_lone_append_to_the_in_memory_database_rolls_back_what_an_interrupt_left_open() -> None:
    """The in-memory database takes no WAL witness, so its lone append itself must roll
    back a transaction an interrupt left open (mutation run gap, #46): else its one
    statement joins that transaction and commits nothing."""
    store = open_sqlite_store("sqlite://:memory:")
    store.append("s", 0, _records(1))
    real = raw_connection(store)
    real.execute("BEGIN")
    real.execute("SELECT count(*) FROM loom_rows").fetchone()
    assert store.append("s", 1, _records(1, "after")) == 2
    assert not real.in_transaction, "rolled back, then committed on its own"
    assert [r.payload for r in store.read("s")] == [b"r0", b"after0"]
