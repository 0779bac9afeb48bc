"""head() answers from what its connection knows only while no other connection wrote.

The engine asks for the head before every step; the store answers from the heads its
connection last read or wrote while `PRAGMA data_version` shows that no other
connection (another store object, another thread's connection, another process) has
committed since. These tests hold every head() to the database's truth.
"""

from __future__ import annotations

import sqlite3
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel.spi import (
    ConflictError,
    Fault,
    LoomError,
    NewRecord,
    PendingAppend,
    StoreUnavailableError,
    StreamDeletedError,
)
from loom_store_sqlite import SqliteStore, _walindex, open_sqlite_store
from loom_store_sqlite._heads import StampedHeads
from loom_store_sqlite.testing import (
    connection_stand_in,
    lone_leader,
    raw_connection,
    wal_index,
    witnessed,
)

STREAMS = ("ex/a", "ex/b")


def _record() -> list[NewRecord]:
    return [NewRecord("k", b"{}", 1.0)]


def _truth(path: Path, stream: str) -> int | str:
    """The head as the database holds it, read by a connection of its own."""
    with sqlite3.connect(path) as connection:
        row = connection.execute(
            "SELECT (SELECT MAX(position) FROM loom_rows WHERE stream = s.id), "
            "s.floor, s.deleted FROM loom_names AS s WHERE s.name = ?",
            (stream,),
        ).fetchone()
    if row is None:
        return 0
    head, floor, deleted = row
    if deleted:
        return "deleted"
    return int(floor if head is None else max(head, floor))


def _head(store: SqliteStore, stream: str) -> int | str:
    try:
        return store.head(stream)
    except StreamDeletedError:
        return "deleted"


def _apply(store: SqliteStore, op: str, stream: str) -> None:
    """One write by `store`; refusals are part of the game, not failures."""
    try:
        head = store.head(stream)
        if op == "append":
            store.append(stream, head, _record())
        elif op == "trim":
            store.trim(stream, head + 1)
        elif op == "delete":
            store.delete(stream)
        elif op == "lost":
            store.inject_fault(Fault.LOST_REPLY)
            store.append(stream, head, _record())
    except (ConflictError, StreamDeletedError):
        pass


def _in_thread(func: Any, *args: Any) -> None:
    worker = threading.Thread(target=func, args=args)
    worker.start()
    worker.join()


writes = st.sampled_from(["append", "append", "append", "trim", "delete", "lost"])
writers = st.sampled_from(["one", "other store", "one, another thread", "raw"])


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(script=st.lists(st.tuples(writers, writes, st.sampled_from(STREAMS)), max_size=25))
def test_every_head_is_the_databases_head(
    tmp_path_factory: pytest.TempPathFactory, script: list[tuple[str, str, str]]
) -> None:
    path = tmp_path_factory.mktemp("heads") / "h.db"
    one = open_sqlite_store(f"sqlite://{path}?synchronous=off")
    other = open_sqlite_store(f"sqlite://{path}?synchronous=off")
    try:
        for writer, op, stream in script:
            if writer == "one":
                _apply(one, op, stream)
            elif writer == "other store":
                _apply(other, op, stream)
            elif writer == "one, another thread":
                _in_thread(_apply, one, op, stream)
            elif op == "append":  # "raw": a writer that is not a Loom store at all
                head = _truth(path, stream)
                if isinstance(head, int):
                    with sqlite3.connect(path) as connection:
                        if head == 0:
                            connection.execute(
                                "INSERT OR IGNORE INTO loom_names (name, floor, deleted) "
                                "VALUES (?, 0, 0)",
                                (stream,),
                            )
                        connection.execute(
                            "INSERT INTO loom_rows (stream, position, kind, payload, "
                            "timestamp, txn) VALUES ((SELECT id FROM loom_names "
                            "WHERE name = ?), ?, 1, x'7b7d', 1.0, NULL)",
                            (stream, head + 1),
                        )
            for checked in STREAMS:
                truth = _truth(path, checked)
                assert _head(one, checked) == truth, (writer, op, stream, checked)
                assert _head(other, checked) == truth, (writer, op, stream, checked)
    finally:
        one.close()
        other.close()


def test_another_process_writing_is_seen(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    store = open_sqlite_store(f"sqlite://{path}")
    store.append("ex/a", 0, _record())
    assert store.head("ex/a") == 1
    code = (
        "from loom_kernel import open_store\nfrom loom_kernel.spi import NewRecord\n"
        f"s = open_store('sqlite://{path}')\n"
        "s.append('ex/a', 1, [NewRecord('k', b'{}', 1.0)])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert store.head("ex/a") == 2
    with pytest.raises(ConflictError):
        store.append("ex/a", 1, _record())


def test_after_its_own_append_a_head_reads_no_records(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/q.db")
    store.append("ex/a", 0, _record())
    lone_leader(store).append("ex/a", 1, _record())
    assert store.head("ex/a") == 2  # as the engine does before a step
    statements: list[str] = []
    raw_connection(store).set_trace_callback(statements.append)
    store.append("ex/a", 2, _record())
    assert len(statements) == 1, "one thread appending: no witness reads"
    statements.clear()
    assert store.head("ex/a") == 3
    assert statements == ["PRAGMA data_version"]
    other = open_sqlite_store(f"sqlite://{tmp_path}/q.db")
    other.append("ex/b", 0, _record())  # any commit by another connection
    statements.clear()
    assert store.head("ex/a") == 3
    assert len(statements) == 2  # the version moved: the head is read again


def test_a_head_another_thread_of_the_store_wrote_makes_no_statement(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/t.db")
    store.append("ex/a", 0, _record())
    _in_thread(witnessed(store).append, "ex/a", 1, _record())  # another leader
    statements: list[str] = []
    raw_connection(store).set_trace_callback(statements.append)
    assert store.head("ex/a") == 2
    assert statements == [], "the heads the store's commits wrote are shared by its threads"
    _in_thread(witnessed(store).append, "ex/b", 0, _record())
    assert store.head("ex/a") == 2
    assert statements == [], "what was known stays known across the store's own commits"
    lone_leader(store).append("ex/a", 2, _record())  # this thread alone for a while: unwitnessed
    statements.clear()
    assert store.head("ex/b") == 1
    assert statements, "an unwitnessed commit of its own: what was shared is dropped"


def test_without_a_wal_index_every_head_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patched:
        patched.setattr(_walindex, "MOST_FILES", 0)  # as where the -shm file cannot be mapped
        store = witnessed(open_sqlite_store(f"sqlite://{tmp_path}/n.db"))
    assert wal_index(store) is None
    store.append("ex/a", 0, _record())
    other = open_sqlite_store(f"sqlite://{tmp_path}/n.db")
    other.append("ex/a", 1, _record())
    assert store.head("ex/a") == 2


def _foreign_append(path: Path, stream: str, position: int) -> None:
    with sqlite3.connect(path) as connection:
        connection.execute(
            "INSERT INTO loom_rows (stream, position, kind, payload, timestamp, txn) "
            "VALUES ((SELECT id FROM loom_names WHERE name = ?), ?, 1, x'7b7d', 1.0, NULL)",
            (stream, position),
        )


@pytest.mark.parametrize("records", [1, 2], ids=["lone statement", "transaction"])
def test_a_commit_by_another_writer_during_the_stores_own_is_not_taken_for_it(
    tmp_path: Path, records: int
) -> None:
    path = tmp_path / "r.db"
    store = witnessed(open_sqlite_store(f"sqlite://{path}"))
    store.append("ex/f", 0, _record())
    witnessed(store).append("ex/g", 0, _record())
    assert store.head("ex/f") == 1  # known, and stamped
    transact, alone = store._transact, store._insert_alone

    def transact_after_another(connection: Any, batch: Any, *, isolated: bool) -> Any:
        _foreign_append(path, "ex/f", 2)  # between the witness reads: the header moves twice
        return transact(connection, batch, isolated=isolated)

    def alone_after_another(connection: Any, append: Any) -> Any:
        _foreign_append(path, "ex/f", 2)
        return alone(connection, append)

    store._transact = transact_after_another  # type: ignore[method-assign]
    store._insert_alone = alone_after_another  # type: ignore[method-assign]
    assert witnessed(store).append("ex/g", 1, _record() * records) == 1 + records
    assert store.head("ex/f") == 2, "the other writer's record"
    assert store.head("ex/g") == 1 + records


def test_a_commit_by_another_writer_before_the_stores_own_drops_what_was_known(
    tmp_path: Path,
) -> None:
    path = tmp_path / "b.db"
    store = witnessed(open_sqlite_store(f"sqlite://{path}"))
    store.append("ex/f", 0, _record())
    witnessed(store).append("ex/g", 0, _record())
    assert store.head("ex/f") == 1
    _foreign_append(path, "ex/f", 2)  # then the store's own, witnessed, commit
    assert witnessed(store).append("ex/g", 1, _record()) == 2
    assert store.head("ex/f") == 2, "the header before it was not the stamp"
    statements: list[str] = []
    raw_connection(store).set_trace_callback(statements.append)
    assert store.head("ex/g") == 2
    assert statements == [], "the witnessed commit's own head is shared"


def test_a_commit_whose_outcome_is_not_certain_drops_what_was_known(tmp_path: Path) -> None:
    store = witnessed(open_sqlite_store(f"sqlite://{tmp_path}/u.db"))
    store.append("ex/a", 0, _record())
    witnessed(store).append("ex/b", 0, _record())
    assert store.head("ex/a") == 1
    real = raw_connection(store)
    with connection_stand_in(store, _CommitLandsThenFails(real)), pytest.raises(LoomError):
        witnessed(store).append("ex/a", 1, _record() * 2)  # landed, then said it failed
    assert store.head("ex/a") == 3, "the commit landed: the head is read again"


def test_a_group_whose_outcome_is_not_certain_leaves_nothing_for_other_threads(
    tmp_path: Path,
) -> None:
    # Its appends' callers forget their streams once woken; until then another
    # thread must not find the old heads stamped with the new header.
    store = witnessed(open_sqlite_store(f"sqlite://{tmp_path}/g.db"))
    store.append("ex/a", 0, _record())
    witnessed(store).append("ex/b", 0, _record())
    real = raw_connection(store)
    statements: list[str] = []
    real.set_trace_callback(statements.append)
    assert store.head("ex/a") == 1
    assert statements == [], "the store's threads share it: no statement reads it"
    rows = [("ex/a", 2, 1, b"{}", 1.0, 7)]
    uncertain = PendingAppend("ex/a", 1, rows)
    other = PendingAppend("ex/b", 1, [("ex/b", 2, 1, b"{}", 1.0, 7)])
    with connection_stand_in(store, _CommitLandsThenFails(real)):
        witnessed(store)._commit_group([uncertain, other])
    assert isinstance(uncertain.error, StoreUnavailableError)
    statements.clear()
    assert store.head("ex/a") == 2, "the commit landed"
    assert statements, "nothing shared: the head is read from the database"


def test_a_group_of_several_appends_is_witnessed_whoever_led_the_last(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/s.db")
    store.append("ex/a", 0, _record())
    for stream in ("ex/b", "ex/c"):  # the same leader twice, each a group of two
        lone_leader(store)._commit_group(
            [
                PendingAppend(stream, 0, [(stream, 1, 1, b"{}", 1.0, 7)]),
                PendingAppend(stream + "2", 0, [(stream + "2", 1, 1, b"{}", 1.0, 7)]),
            ]
        )
    statements: list[str] = []
    raw_connection(store).set_trace_callback(statements.append)
    assert store.head("ex/c2") == 1
    assert statements == []


def test_stamped_heads_keep_what_they_knew_only_from_the_stamp_on() -> None:
    def header(change: int) -> bytes:
        return struct.pack("=IIIB", 3007000, 0, change, 1).ljust(48, b"\0")

    heads = StampedHeads()
    heads.committed(header(1), header(2), {"a": 1})
    assert heads.lookup("a", header(2)) == 1
    assert heads.lookup("a", header(3)) is None, "someone committed since"
    heads.committed(header(2), header(3), {"b": 1})
    assert heads.lookup("a", header(3)) == 1, "nothing else came between"
    heads.committed(header(4), header(5), {"c": 1})
    assert heads.lookup("a", header(5)) is None, "header 4 is not the stamp: dropped"
    assert heads.lookup("c", header(5)) == 1
    heads.committed(header(5), header(5), {})
    assert heads.lookup("c", header(5)) == 1, "nothing landed, nothing moved"
    heads.committed(None, header(6), {"d": 1})
    assert heads.lookup("d", header(6)) is None, "a header read mid-write is no stamp"
    assert heads.lookup("c", header(6)) is None
    heads.committed(header(6), None, {"e": 1})
    assert heads.lookup("e", header(6)) is None
    heads.committed(header(7), header(8), {"f": 1})
    heads.forget("f")
    assert heads.lookup("f", header(8)) is None


def test_an_append_that_failed_on_the_way_is_forgotten(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/f.db")
    store.append("ex/a", 0, _record())
    assert store.head("ex/a") == 1
    store.inject_fault(Fault.UNAVAILABLE)
    with pytest.raises(StoreUnavailableError):
        store.append("ex/a", 1, _record())
    assert store.head("ex/a") == 1
    store.inject_fault(Fault.LOST_REPLY)
    assert store.append("ex/a", 1, _record()) == 2
    assert store.head("ex/a") == 2


def test_a_head_read_again_after_another_writer_is_known_until_the_next(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/k.db")
    store.append("ex/a", 0, _record())
    open_sqlite_store(f"sqlite://{tmp_path}/k.db").append("ex/b", 0, _record())
    assert store.head("ex/a") == 1  # read from the table: the version moved
    statements: list[str] = []
    raw_connection(store).set_trace_callback(statements.append)
    assert store.head("ex/a") == 1
    assert statements == ["PRAGMA data_version"], "the head read is remembered"


class _CommitLandsThenFails:
    """A connection whose COMMIT lands and then reports an error (a lost reply)."""

    def __init__(self, real: sqlite3.Connection) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def execute(self, sql: str, *parameters: Any) -> Any:
        result = self._real.execute(sql, *parameters)
        if sql == "COMMIT":
            raise sqlite3.OperationalError("disk I/O error")
        return result


def test_an_append_whose_commit_landed_but_failed_is_not_remembered_at_the_old_head(
    tmp_path: Path,
) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/c.db")
    store.append("ex/a", 0, _record())
    assert store.head("ex/a") == 1
    real = raw_connection(store)
    with connection_stand_in(store, _CommitLandsThenFails(real)), pytest.raises(LoomError):
        store.append("ex/a", 1, _record() * 2)  # two records: BEGIN, inserts, COMMIT
    assert store.head("ex/a") == 3, "the commit landed: the head is read again"


class _StatementLandsThenFails(_CommitLandsThenFails):
    """A connection whose one-statement append lands and then reports an error."""

    def execute(self, sql: str, *parameters: Any) -> Any:
        result = self._real.execute(sql, *parameters)
        if sql.startswith("INSERT INTO loom_rows"):
            raise sqlite3.OperationalError("disk I/O error")
        return result


def test_a_lone_append_that_landed_but_failed_is_confirmed_by_its_commit_id(
    tmp_path: Path,
) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/c.db")
    store.append("ex/a", 0, _record())
    with connection_stand_in(store, _StatementLandsThenFails(raw_connection(store))):
        assert store.append("ex/a", 1, _record()) == 2, "its commit id says it landed"
    assert store.head("ex/a") == 2
    assert len(store.read("ex/a")) == 2, "written once"


def test_a_lost_reply_whose_position_another_writer_took_is_a_conflict(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/l.db")
    store.append("ex/a", 0, _record())  # another writer's, at the position ours aimed at
    with pytest.raises(ConflictError):
        store._confirm("ex/a", 0, 1, -1, StoreUnavailableError("lost"))  # no id of ours


def test_the_heads_a_connection_remembers_are_bounded() -> None:
    from loom_store_sqlite._heads import LIMIT, KnownHeads

    known = KnownHeads()
    assert known.lookup(7, "s0") is None  # anchors it at data_version 7
    for number in range(LIMIT * 2 + 5):
        known.learn(f"s{number}", number)
        assert known.size() <= LIMIT
    last = LIMIT * 2 + 4
    assert known.lookup(7, f"s{last}") == last
    assert known.lookup(7, "s1") is None, "the oldest were let go, and are read again"
