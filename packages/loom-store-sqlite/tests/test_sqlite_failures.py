"""SQLite under attack: interrupts mid-append, locks at open, damaged files, bad URLs."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from loom_kernel import Context, Engine, flow, open_store
from loom_kernel.spi import (
    ConflictError,
    Fault,
    InvalidArgumentError,
    NewRecord,
    SchemaError,
    StoreMisconfiguredError,
    StoreUnavailableError,
)
from loom_store_sqlite import SqliteOptions, SqliteStore, open_sqlite_store


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
    assert not store._connection.in_transaction
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
    connection = store._connection
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
    assert not store._connection.in_transaction
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
    from loom_store_sqlite._group import PendingAppend

    store = RefusedCommitStore(str(tmp_path / "refused.db"))
    for stream in "ab":
        store._commit_group([PendingAppend(stream, 0, [(stream, 1, "k", b"first", 1.0, None)])])
    lands = PendingAppend("a", 1, [("a", 2, "k", b"x", 1.0, None)])
    after_it = PendingAppend("a", 1, [("a", 2, "k", b"y", 1.0, None)])  # judged against `lands`
    stale = PendingAppend("b", 0, [("b", 1, "k", b"z", 1.0, None)])  # judged against the file
    store.refuse = code
    store._commit_group([lands, after_it, stale])
    assert isinstance(lands.error, failure)
    assert isinstance(after_it.error, failure), "alone it might have landed"
    assert isinstance(stale.error, ConflictError), "no rollback changes the head it met"
    store.refuse = None
    assert not store._connection.in_transaction
    assert [store.head(stream) for stream in "ab"] == [1, 1]


def test_open_and_append_on_a_write_locked_database_raise_the_same_error(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.db"
    existing = tmp_path / "existing.db"
    open_sqlite_store(f"sqlite://{existing}").close()
    blockers = []
    for path in (fresh, existing):
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("PRAGMA journal_mode=WAL")
        blocker.execute("BEGIN EXCLUSIVE")
        blockers.append(blocker)
    try:
        with pytest.raises(StoreUnavailableError, match="locked"):
            open_store(f"sqlite://{fresh}?timeout=0")  # a new database needs the write lock
        store = open_store(f"sqlite://{existing}?timeout=0")  # an existing one only reads
        with pytest.raises(StoreUnavailableError, match="locked"):
            store.append("s", 0, _records(1))
    finally:
        for blocker in blockers:
            blocker.execute("ROLLBACK")
    assert open_store(f"sqlite://{fresh}?timeout=0").append("s", 0, _records(1)) == 1


def test_a_file_that_is_not_a_database_is_a_misconfiguration(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"these are my notes, not a database" * 100)
    with pytest.raises(StoreMisconfiguredError, match="not a SQLite database"):
        open_store(f"sqlite://{path}")


def test_a_schema_that_cannot_be_prepared_closes_what_the_store_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "other.db"
    other = sqlite3.connect(path)
    other.execute("CREATE TABLE loom_streams (name TEXT PRIMARY KEY)")  # not Loom's
    other.commit()
    other.close()
    closed: list[SqliteStore] = []
    close = SqliteStore.close

    def recording_close(self: SqliteStore) -> None:
        closed.append(self)
        close(self)

    monkeypatch.setattr(SqliteStore, "close", recording_close)
    with pytest.raises(StoreUnavailableError, match="cannot prepare sqlite database"):
        open_store(f"sqlite://{path}")
    assert len(closed) == 1, "the connection it opened is closed"
    assert closed[0]._connections == []


def test_a_missing_directory_is_a_misconfiguration(tmp_path: Path) -> None:
    with pytest.raises(StoreMisconfiguredError, match="directory exists"):
        open_store(f"sqlite://{tmp_path}/no/such/dir/loom.db")


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///tmp/h#frag.db",
        "sqlite:///tmp/x.db?timeout=nan",
        "sqlite:///tmp/x.db?timeout=inf",
        "sqlite:///tmp/x.db?timeout=1&timeout=2",
        "sqlite:///tmp/x.db?synchronous=full&synchronous=off",
    ],
)
def test_a_url_that_would_be_misread_is_refused(url: str) -> None:
    with pytest.raises(InvalidArgumentError):
        open_store(url)


def test_a_percent_encoded_path_is_decoded(tmp_path: Path) -> None:
    store = open_store(f"sqlite://{tmp_path}/h%23frag.db")
    store.append("s", 0, _records(1))
    assert (tmp_path / "h#frag.db").exists()


def test_timeout_zero_is_valid() -> None:
    assert SqliteOptions.parse("timeout=0") == SqliteOptions("full", 0.0)


@flow
def charge(ctx: Context, _input: Any) -> Any:
    first = ctx.step("quote", lambda: 10)
    second = ctx.step("charge", lambda: first * 2)
    return [first, second, ctx.suspend("ship")]


@pytest.mark.parametrize("missing", [2, 3])
def test_a_row_lost_from_the_database_is_a_schema_error(tmp_path: Path, missing: int) -> None:
    path = tmp_path / "lost.db"
    store = open_store(f"sqlite://{path}")
    Engine(store, [charge], listeners=[]).start("charge", key="order-1")
    with sqlite3.connect(path) as connection:
        connection.execute(
            "DELETE FROM loom_records WHERE stream = 'ex/order-1' AND position = ?", (missing,)
        )
    fresh = Engine(open_store(f"sqlite://{path}"), [charge], listeners=[])
    with pytest.raises(SchemaError, match=f"record {missing} is missing"):
        fresh.resume("order-1", "go")


class CountingConfirmStore(SqliteStore):
    """Counts how often the ambiguous-commit confirmation runs."""

    confirmations = 0

    def _confirm(
        self, stream: str, expected: int, count: int, txn: str, cause: BaseException
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


class _BeginThenInterrupt:
    """A connection whose next BEGIN is granted and then interrupted (a Ctrl-C that
    lands as the busy wait for the lock ends)."""

    def __init__(self, real: sqlite3.Connection) -> None:
        self._real = real
        self.armed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def execute(self, sql: str, *parameters: Any) -> Any:
        result = self._real.execute(sql, *parameters)
        if self.armed and sql.startswith("BEGIN"):
            self.armed = False
            raise KeyboardInterrupt
        return result


@pytest.mark.parametrize("interrupted", ["trim", "a two-record append"])
def test_an_interrupt_as_begin_returns_leaves_no_transaction_and_loses_no_later_append(
    tmp_path: Path, interrupted: str
) -> None:
    path = str(tmp_path / "begin.db")
    store = open_sqlite_store(f"sqlite://{path}")
    store.append("s", 0, _records(1))
    real = store._connection
    store._local.connection = _BeginThenInterrupt(real)
    call = (
        (lambda: store.trim("s", 1))
        if interrupted == "trim"
        else (lambda: store.append("s", 1, _records(2, "lost")))
    )
    with pytest.raises(KeyboardInterrupt):
        call()
    store._local.connection = real
    assert not real.in_transaction, "the lock was given back"
    assert store.append("s", 1, _records(1, "next")) == 2
    other = open_sqlite_store(f"sqlite://{path}?timeout=0")  # another process, no waiting
    assert [r.payload for r in other.read("s")] == [b"r0", b"next0"], "committed, for real"
    assert other.append("s", 2, _records(1, "other")) == 3, "no write lock was left behind"


def test_a_lone_append_on_a_connection_left_in_a_transaction_commits_for_real(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "left.db")
    store = open_sqlite_store(f"sqlite://{path}")
    store.append("s", 0, _records(1))
    store._connection.execute("BEGIN IMMEDIATE")  # left open by something interrupted
    assert store.append("s", 1, _records(1, "next")) == 2
    other = open_sqlite_store(f"sqlite://{path}?timeout=0")
    assert [r.payload for r in other.read("s")] == [b"r0", b"next0"]


def test_a_record_too_big_for_a_deleted_stream_says_deleted(tmp_path: Path) -> None:
    from loom_kernel.spi import StreamDeletedError

    store = open_sqlite_store(f"sqlite://{tmp_path}/big.db")
    store.append("s", 0, _records(1))
    store.delete("s")
    connection = store._connection
    connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 100)
    with pytest.raises(StreamDeletedError):
        store.append("s", 1, [NewRecord("k", b"x" * 1000, 1.0)])


def test_a_closed_store_refuses_every_call(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/closed.db")
    store.append("s", 0, _records(1))
    store.close()
    for call in (
        lambda: store.append("s", 1, _records(1)),
        lambda: store.read("s"),
        lambda: store.head("s"),
    ):
        with pytest.raises(StoreUnavailableError, match="closed"):
            call()


@pytest.mark.parametrize("url", ["memory://x", "s3://bucket/p", "sqlitex:///a.db"])
def test_a_url_of_another_scheme_is_refused_by_the_sqlite_opener(url: str) -> None:
    with pytest.raises(InvalidArgumentError, match="not a sqlite store URL"):
        open_sqlite_store(url)


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda store: store.read("s"), "cannot read 's'"),
        (lambda store: store.head("s"), "cannot read the head of 's'"),
        (lambda store: store.streams(""), "cannot list streams"),
        (lambda store: store.trim("s", 2), "cannot trim 's'"),
        (lambda store: store.delete("s"), "cannot delete 's'"),
        (lambda store: store.append("s", 2, _records(1)), "cannot confirm an append to 's'"),
    ],
)
def test_a_database_whose_tables_are_gone_fails_each_call_with_the_stores_error(
    tmp_path: Path, call: Any, says: str
) -> None:
    store = open_sqlite_store(f"sqlite:///{tmp_path / 'gone.db'}")
    store.append("s", 0, _records(2))
    vandal = sqlite3.connect(tmp_path / "gone.db", isolation_level=None)
    vandal.execute("DROP TABLE loom_records")
    vandal.execute("DROP TABLE loom_streams")
    vandal.close()
    with pytest.raises(StoreUnavailableError, match=f"{says}: no such table"):
        call(store)
    store.close()


def test_an_interrupt_at_commit_leaves_the_connection_out_of_its_transaction(
    tmp_path: Path,
) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/i.db")
    store.append("s", 0, _records(1))
    real = store._connection

    class InterruptedAtCommit:
        def execute(self, sql: str, *args: Any) -> Any:
            if sql == "COMMIT":
                raise KeyboardInterrupt
            return real.execute(sql, *args)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    store._local.connection = InterruptedAtCommit()
    with pytest.raises(KeyboardInterrupt):
        store.read("s")
    assert not real.in_transaction, "it would hold a read snapshot, or refuse its next BEGIN"
    store._local.connection = real
    assert store.append("s", 1, _records(1)) == 2
