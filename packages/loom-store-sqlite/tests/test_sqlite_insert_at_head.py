"""The head check folded into the insert (`_INSERT_AT_HEAD`) decides every append as
reading the stream first and then inserting did: the same errors, the same streams,
over trims, deletes, batches, groups with several appends to one stream, and records
SQLite refuses (which force a group's retry on savepoints)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel import InvalidArgumentError, StoreUnavailableError
from loom_kernel.spi import ConflictError, NewRecord, PendingAppend, StreamDeletedError
from loom_store_sqlite import SqliteOptions, SqliteStore, _appends
from loom_store_sqlite._failures import store_error
from loom_store_sqlite.testing import raw_connection

LIMIT = 5000  # bytes: a record above it is refused, as a full disk would refuse it


class ReadThenInsert(SqliteStore):
    """The reference: read the stream's head, then insert every row (a lone append too,
    in a transaction of its own)."""

    def _insert_alone(
        self, connection: sqlite3.Connection, append: PendingAppend
    ) -> list[PendingAppend]:
        return self._transact(connection, [append], isolated=False) or []

    def _stage(
        self,
        connection: sqlite3.Connection,
        append: PendingAppend,
        heads: dict[str, int],
        *,
        isolated: bool,
    ) -> bool:
        stream = append.stream
        if stream in heads:
            head, deleted, exists = heads[stream], False, True
        else:
            row = self._stream_row(connection, stream)
            head = 0 if row is None else row[0]
            deleted, exists = row is not None and bool(row[2]), row is not None
        if not self._at(append, head, deleted=deleted):
            return False
        if isolated:
            connection.execute("SAVEPOINT loom_append")
        try:
            if not exists:
                connection.execute(
                    "INSERT INTO loom_names (name, floor, deleted) VALUES (?, 0, 0)", (stream,)
                )
            connection.executemany(_appends._INSERT_RECORD, append.rows)
        except sqlite3.Error as exc:
            if not isolated:
                raise _appends._InsertRefusedError(exc) from exc
            connection.execute("ROLLBACK TO loom_append")
            connection.execute("RELEASE loom_append")
            append.error = store_error("refused", exc)
            return False
        if isolated:
            connection.execute("RELEASE loom_append")
        heads[stream] = append.expected + len(append.rows)
        return True


def _open(cls: type[SqliteStore], path: Path) -> SqliteStore:
    store = cls(str(path), SqliteOptions(synchronous="off"))
    raw_connection(store).setlimit(sqlite3.SQLITE_LIMIT_LENGTH, LIMIT)
    return store


def _outcome(error: BaseException | None) -> Any:
    if isinstance(error, ConflictError | StreamDeletedError):
        return type(error).__name__, str(error)
    return None if error is None else type(error).__name__


def _streams(store: SqliteStore) -> dict[str, Any]:
    seen = {}
    for name in "abc":
        row = store._stream_row(raw_connection(store), name)
        records = (
            raw_connection(store)
            .execute(
                "SELECT position, payload FROM loom_rows WHERE stream = "
                "(SELECT id FROM loom_names WHERE name = ?) ORDER BY position",
                (name,),
            )
            .fetchall()
        )
        try:  # as the store answers it: from what this connection learned, if anything
            head: int | str = store.head(name)
        except StreamDeletedError:
            head = "deleted"
        seen[name] = (row, records, head)
    return seen


appends = st.tuples(
    st.sampled_from("abc"),
    st.sampled_from([0, 0, 0, -1, 1, 2]),  # the expected head, off the true head by this
    st.lists(st.sampled_from([1, 1, LIMIT + 1]), min_size=1, max_size=3),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("delete"), st.sampled_from("abc")),
        st.tuples(st.just("trim"), st.sampled_from("abc"), st.integers(0, 3)),
        # One append alone goes through `append`, which confirms an ambiguous failure
        # (a lone append's statement refusing a record says no more than that).
        st.tuples(st.just("group"), st.lists(appends, min_size=2, max_size=4)),
        st.tuples(st.just("alone"), appends),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_the_head_checked_in_the_insert_decides_as_reading_first(
    tmp_path_factory: Any, steps: list[Any]
) -> None:
    directory = tmp_path_factory.mktemp("at-head")
    stores = [_open(ReadThenInsert, directory / "ref.db"), _open(SqliteStore, directory / "new.db")]
    for store in stores:  # streams that exist: their appends check the head in the insert
        for name in "abc":
            store._commit_group([PendingAppend(name, 0, [(name, 1, 1, b"first", 1.0, None)])])
    for number, step in enumerate(steps):
        if step[0] == "delete":
            for store in stores:
                store.delete(step[1])
        elif step[0] == "trim":
            for store in stores:
                try:
                    head = store.head(step[1])
                except StreamDeletedError:
                    continue
                store.trim(step[1], min(head + 1, step[2] + head // 2))
        elif step[0] == "alone":  # through `append`: an ambiguous failure is confirmed
            stream, off, sizes = step[1]
            try:
                expected = max(0, stores[1].head(stream) + off)
            except StreamDeletedError:
                expected = 1
            records = [NewRecord("k", b"a%d" % number * size, 1.0) for size in sizes]
            outcomes = []
            for store in stores:
                try:
                    store.append(stream, expected, records)
                except (
                    ConflictError,
                    StreamDeletedError,
                    StoreUnavailableError,
                    InvalidArgumentError,  # a record SQLite refuses as too big
                ) as exc:
                    outcomes.append(_outcome(exc))
                else:
                    outcomes.append(None)
            assert outcomes[0] == outcomes[1]
        else:
            outcomes = []
            for store in stores:
                batch = []
                for index, (stream, off, sizes) in enumerate(step[1]):
                    try:
                        head = stores[1].head(stream)
                    except StreamDeletedError:
                        head = 1
                    expected = max(0, head + off)
                    rows = [
                        (stream, expected + i, 1, b"r%d-%d" % (number, index) * size, 1.0, None)
                        for i, size in enumerate(sizes, start=1)
                    ]
                    batch.append(PendingAppend(stream, expected, rows))
                store._commit_group(batch)
                outcomes.append([_outcome(append.error) for append in batch])
            assert outcomes[0] == outcomes[1]
        assert _streams(stores[0]) == _streams(stores[1])
    for store in stores:
        store.close()


def test_a_row_the_table_refuses_at_the_head_fails_the_append_never_landing(
    tmp_path: Path,
) -> None:
    """OR IGNORE skips a row that breaks any NOT NULL constraint, not only the position
    made NULL off the head: a row skipped with the head as expected must fail its
    append (alone, and in a group beside one that lands), never be acknowledged."""
    store = _open(SqliteStore, tmp_path / "refused.db")
    store._commit_group([PendingAppend("a", 0, [("a", 1, 1, b"first", 1.0, None)])])
    store._commit_group([PendingAppend("b", 0, [("b", 1, 1, b"first", 1.0, None)])])
    alone = PendingAppend("a", 1, [("a", 2, 1, None, 1.0, 7)])
    store._commit_group([alone])
    assert isinstance(alone.error, StoreUnavailableError)
    assert "nothing was inserted at position 2 of 'a'" in str(alone.error)
    grouped = PendingAppend("a", 1, [("a", 2, 1, None, 1.0, 7)])
    beside = PendingAppend("b", 1, [("b", 2, 1, b"second", 1.0, 7)])
    store._commit_group([grouped, beside])
    assert isinstance(grouped.error, StoreUnavailableError)
    assert beside.error is None
    assert (store.head("a"), store.head("b")) == (1, 2)
    store.close()


def test_a_lone_append_whose_stream_cannot_be_read_after_inserting_nothing_fails_cleanly(
    tmp_path: Path,
) -> None:
    """The read that says why a lone append inserted nothing fails: the append raises
    the kernel's StoreUnavailableError, not sqlite3's error, and the next one works."""

    class Faulty(SqliteStore):
        armed = False

        @staticmethod
        def _stream_row(connection: sqlite3.Connection, stream: str) -> Any:
            if Faulty.armed:
                Faulty.armed = False
                raise sqlite3.OperationalError("disk I/O error (injected)")
            return SqliteStore._stream_row(connection, stream)

    store = Faulty(str(tmp_path / "faulty.db"), SqliteOptions(synchronous="off"))
    store.append("x", 0, [NewRecord("k", b"1", 1.0)])
    Faulty.armed = True
    with pytest.raises(ConflictError):  # said by the confirmation's own read
        store.append("x", 5, [NewRecord("k", b"2", 1.0)])
    assert store.append("x", 1, [NewRecord("k", b"2", 1.0)]) == 2
    store.close()
