"""SQLite specifics: URL options, the store's own schema version, locks, durability settings."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from loom_kernel import open_store
from loom_kernel.spi import InvalidArgumentError, NewRecord, SchemaError, StoreUnavailableError
from loom_store_sqlite import SCHEMA_VERSION, SqliteOptions, SqliteStore, open_sqlite_store


def _records(count: int) -> list[NewRecord]:
    return [NewRecord("k", str(i).encode(), float(i)) for i in range(count)]


def test_url_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    absolute = open_store(f"sqlite://{tmp_path}/a.db")
    assert isinstance(absolute, SqliteStore)
    assert absolute.path == f"{tmp_path}/a.db"
    monkeypatch.chdir(tmp_path)
    relative = open_sqlite_store("sqlite://sub.db")
    relative.append("s", 0, _records(1))
    assert (tmp_path / "sub.db").exists()
    memory = open_sqlite_store("sqlite:///:memory:")
    assert memory.head("s") == 0
    as_sqlalchemy_spells_it = open_sqlite_store(f"sqlite:///{tmp_path}/c.db")
    assert as_sqlalchemy_spells_it.path == f"{tmp_path}/c.db"


def test_loom_stores_checks_sqlite_in_its_scratch_directory(tmp_path: Path) -> None:
    from loom_store_sqlite._store import sqlite_store_factory

    assert sqlite_store_factory.self_check_url is not None
    url = sqlite_store_factory.self_check_url(str(tmp_path))
    store = open_store(url)
    assert isinstance(store, SqliteStore)
    store.append("s", 0, _records(1))
    assert (tmp_path / "check.db").exists()


def test_url_options() -> None:
    assert SqliteOptions.parse("") == SqliteOptions("full", 10.0)
    assert SqliteOptions.parse("synchronous=NORMAL&timeout=2.5") == SqliteOptions("normal", 2.5)
    # An option given with no value is refused, not read as the default.
    blank = ("synchronous=", "timeout=", "synchronous=&timeout=2")
    for bad in ("synchronous=sometimes", "timeout=soon", "timeout=-1", "cache=big", *blank):
        with pytest.raises(InvalidArgumentError):
            SqliteOptions.parse(bad)
    with pytest.raises(InvalidArgumentError):
        open_sqlite_store("sqlite://")


def test_pragmas_are_applied(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/p.db?synchronous=normal")
    connection = store._connection
    assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert connection.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    default = open_sqlite_store(f"sqlite://{tmp_path}/q.db")
    assert default._connection.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_a_newer_store_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    open_sqlite_store(f"sqlite://{path}").close()
    with sqlite3.connect(path) as connection:
        connection.execute(
            "UPDATE loom_meta SET value = ? WHERE key = 'schema_version'",
            (str(SCHEMA_VERSION + 1),),
        )
    with pytest.raises(SchemaError, match="newer than this loom-store-sqlite"):
        open_sqlite_store(f"sqlite://{path}")
    # Refused on a read, before any write lock: even while another writer holds it.
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(SchemaError, match="newer than this loom-store-sqlite"):
            open_sqlite_store(f"sqlite://{path}?timeout=0")
    finally:
        writer.execute("ROLLBACK")
        writer.close()


def test_the_streams_table_is_strict(tmp_path: Path) -> None:
    """A floor that is not an integer (a raw writer's mistake) is refused by SQLite,
    never read back as a head."""
    path = tmp_path / "strict.db"
    open_sqlite_store(f"sqlite://{path}").close()
    with sqlite3.connect(path) as connection, pytest.raises(sqlite3.IntegrityError):
        connection.execute("INSERT INTO loom_streams (name, floor) VALUES ('s', 'ten')")


def test_an_older_database_is_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as connection:  # a database from before the store existed
        connection.execute("CREATE TABLE unrelated (x INTEGER)")
    store = open_sqlite_store(f"sqlite://{path}")
    store.append("s", 0, _records(2))
    version = store._connection.execute(
        "SELECT value FROM loom_meta WHERE key = 'schema_version'"
    ).fetchone()[0]
    assert int(version) == SCHEMA_VERSION


def test_a_schema_one_database_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "one.db"
    first = open_sqlite_store(f"sqlite://{path}")
    first.append("s", 0, _records(2))
    first.close()
    with sqlite3.connect(path) as connection:  # as loom-store-sqlite 1 left it
        connection.execute("DROP INDEX loom_live_streams")
        connection.execute("UPDATE loom_meta SET value = '1' WHERE key = 'schema_version'")
    store = open_sqlite_store(f"sqlite://{path}")
    assert len(store.read("s")) == 2
    indexes = {row[1] for row in store._connection.execute("PRAGMA index_list(loom_streams)")}
    assert "loom_live_streams" in indexes
    version = store._connection.execute(
        "SELECT value FROM loom_meta WHERE key = 'schema_version'"
    ).fetchone()[0]
    assert int(version) == SCHEMA_VERSION


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


def test_threads_share_one_store(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/t.db?synchronous=normal")
    errors: list[BaseException] = []

    def writer(number: int) -> None:
        try:
            for index in range(20):
                store.append(f"t{number}", index, _records(1))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert [store.head(f"t{n}") for n in range(4)] == [20] * 4


def _open_connections(store: SqliteStore) -> list[sqlite3.Connection]:
    return list(store._connections)


def test_a_threads_connection_is_closed_when_the_thread_ends(tmp_path: Path) -> None:
    """Threads that come and go (a pool's that end when idle, one per request) leave no
    connection open behind them; a thread still running keeps its own."""
    store = SqliteStore(str(tmp_path / "c.db"), SqliteOptions(synchronous="normal"))
    before = len(_open_connections(store))
    stays = threading.Event()
    running: list[sqlite3.Connection] = []

    def lives_on() -> None:
        store.append("kept", 0, _records(1))
        running.append(store._connection)
        assert stays.wait(10)
        store.append("kept", 1, _records(1))  # its connection still works

    keeper = threading.Thread(target=lives_on)
    keeper.start()
    ended: list[sqlite3.Connection] = []
    for number in range(30):

        def short(n: int = number) -> None:
            store.append(f"s{n}", 0, _records(1))
            ended.append(store._connection)

        thread = threading.Thread(target=short)
        thread.start()
        thread.join()
    assert len(ended) == 30
    for connection in ended:
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            connection.execute("SELECT 1")
    assert len(_open_connections(store)) == before + 1, "the running thread's only"
    stays.set()
    keeper.join()
    assert len(_open_connections(store)) == before
    assert [store.head(f"s{n}") for n in range(30)] == [1] * 30
    assert store.head("kept") == 2
    store.close()


def _run_script(script: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_close_closes_every_connection_the_store_opened(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "closed.db"))
    store.append("s", 0, _records(1))
    opened = _open_connections(store)
    assert len(opened) >= 2, "the keeper and this thread's"
    store.close()
    for connection in opened:
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            connection.execute("SELECT 1")
    with pytest.raises(StoreUnavailableError, match="closed"):
        store.head("s")


@pytest.mark.parametrize("where", ["file", "memory"])
def test_a_store_closed_while_its_threads_use_it_refuses_them_and_leaves_none_open(
    tmp_path: Path, where: str
) -> None:
    """Closing a connection under a statement another thread runs on it crashes the
    interpreter (CPython 3.11's sqlite3): a connection in use is closed by its own
    call as it ends. Run in a process of its own, so a crash fails the test."""
    target = ":memory:" if where == "memory" else str(tmp_path / "busy.db")
    script = f"""
        import sqlite3, threading
        from loom_kernel.spi import NewRecord, StoreUnavailableError
        from loom_store_sqlite import SqliteStore
        refused = []
        for round in range(100):
            store = SqliteStore({target!r})
            going = [threading.Event() for _ in range(4)]
            def work(number):
                made = 0
                try:
                    while True:
                        name = f"r{{round}}-{{number}}-{{made}}"
                        store.append(name, 0, [NewRecord("k", b"{{}}", 1.0)])
                        if made % 2:
                            assert store.read(name)[0].position == 1
                            store.head(name)
                            store.streams(prefix=f"r{{round}}-{{number}}-", limit=3)
                        made += 1
                        if made == 3:
                            going[number].set()
                except StoreUnavailableError as exc:
                    assert "closed" in str(exc), exc
                    refused.append(number)
                    going[number].set()
            threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
            for thread in threads:
                thread.start()
            for event in going:
                event.wait(10)
            store.close()
            for thread in threads:
                thread.join()
            assert store._connections == [] and not store._left_to_users, "none left open"
        print(len(refused))
        """
    assert _run_script(script) == str(100 * 4)


def test_a_threads_connection_is_not_closed_at_exit_while_the_thread_may_use_it(
    tmp_path: Path,
) -> None:
    """A daemon thread still running at exit may be using its connection: the exit
    closes none (an exit hook that ran after the closing one read through it)."""
    script = f"""
        import atexit
        holder = {{}}
        def read_at_exit():
            print(len(holder["store"].read("s")))
        atexit.register(read_at_exit)  # runs after any exit hook registered later
        from loom_kernel.spi import NewRecord
        from loom_store_sqlite import SqliteStore
        holder["store"] = store = SqliteStore({str(tmp_path / "x.db")!r})
        store.append("s", 0, [NewRecord("k", b"1", 1.0)])
        """
    assert _run_script(script) == "1"


def test_a_forked_child_closes_none_of_its_parents_thread_connections(tmp_path: Path) -> None:
    script = f"""
        import os, threading
        from loom_kernel.spi import NewRecord
        from loom_store_sqlite import SqliteStore
        store = SqliteStore({str(tmp_path / "f.db")!r})
        made, release = threading.Event(), threading.Event()
        held = []
        def lives() -> None:
            store.append("s", 0, [NewRecord("k", b"1", 1.0)])
            held.append(store._connection)
            made.set()
            release.wait(10)
        thread = threading.Thread(target=lives)
        thread.start()
        made.wait(10)
        listed = len(store._connections)
        pid = os.fork()
        if pid == 0:  # the child has no such thread: its locals are dropped here
            import gc
            gc.collect()
            still = len(store._connections) == listed and held[0].in_transaction is False
            os._exit(0 if still else 1)
        _, status = os.waitpid(pid, 0)
        release.set()
        thread.join()
        print(os.waitstatus_to_exitcode(status), store.read("s")[0].payload.decode())
        """
    assert _run_script(script) == "0 1"


@pytest.mark.parametrize("where", ["file", "memory"])
def test_a_store_does_not_cross_a_fork_its_child_is_refused_at_each_call(
    tmp_path: Path, where: str
) -> None:
    """SQLite's connections must not cross a fork: in the child, an inherited one holds
    none of the parent's locks (writes could be lost), and a group or a lock a
    parent's thread held would wait for ever. Each call is refused, closing touches
    nothing, and the parent goes on."""
    target = ":memory:" if where == "memory" else str(tmp_path / "forked.db")
    script = f"""
        import os, threading
        from loom_kernel.spi import NewRecord, StoreMisconfiguredError
        from loom_store_sqlite import SqliteStore
        record = [NewRecord("k", b"1", 1.0)]
        inside, release = threading.Event(), threading.Event()
        class Slow(SqliteStore):
            def _commit_group(self, batch):
                if batch[0].stream == "slow":
                    inside.set()
                    release.wait(10)
                super()._commit_group(batch)
        store = Slow({target!r})
        store.append("p", 0, record)
        thread = threading.Thread(target=store.append, args=("slow", 0, record))
        thread.start()  # a parent's thread leads a group as the process forks
        inside.wait(10)
        pid = os.fork()
        if pid == 0:
            calls = [
                lambda: store.append("c", 0, record), lambda: store.read("p"),
                lambda: store.head("p"), lambda: store.streams(),
                lambda: store.trim("p", 1), lambda: store.delete("p"),
            ]
            refused = 0
            for call in calls:
                try:
                    call()
                except StoreMisconfiguredError as exc:
                    refused += "forked from" in str(exc) and "spawn" in str(exc)
            store.close()
            store.close()
            os._exit(0 if refused == len(calls) else 1)
        _, status = os.waitpid(pid, 0)
        release.set()
        thread.join()
        store.append("p", 1, record)
        print(os.waitstatus_to_exitcode(status), store.head("slow"), store.head("p"))
        """
    assert _run_script(script) == "0 1 2"


def test_a_database_open_when_the_process_forked_is_refused_to_the_childs_new_stores(
    tmp_path: Path,
) -> None:
    """The parent's connections came along unclosed, with SQLite's state of the file:
    a new connection of the child would count itself in the parent's locks and take
    none (the parent's close could then delete the WAL under the child's commits).
    Another database opens; so does one the parent had closed before forking."""
    script = f"""
        import os
        from loom_kernel.spi import NewRecord, StoreMisconfiguredError
        from loom_store_sqlite import SqliteStore
        record = [NewRecord("k", b"1", 1.0)]
        open_one = SqliteStore({str(tmp_path / "open.db")!r})
        closed_one = SqliteStore({str(tmp_path / "closed.db")!r})
        closed_one.close()
        pid = os.fork()
        if pid == 0:
            try:
                SqliteStore({str(tmp_path / "open.db")!r})
            except StoreMisconfiguredError as exc:
                assert "forked from" in str(exc)
            else:
                os._exit(1)
            other = SqliteStore({str(tmp_path / "other.db")!r})
            other.append("c", 0, record)
            again = SqliteStore({str(tmp_path / "closed.db")!r})
            again.append("c", 0, record)
            grandchild = os.fork()
            if grandchild == 0:
                try:
                    SqliteStore({str(tmp_path / "other.db")!r})  # open in its parent
                except StoreMisconfiguredError:
                    os._exit(0)
                os._exit(1)
            _, status = os.waitpid(grandchild, 0)
            os._exit(os.waitstatus_to_exitcode(status))
        _, status = os.waitpid(pid, 0)
        open_one.append("p", 0, record)
        print(os.waitstatus_to_exitcode(status), open_one.head("p"))
        """
    assert _run_script(script) == "0 1"


def test_a_forked_child_never_makes_a_commit_id_its_parent_makes() -> None:
    script = """
        import os
        from loom_store_sqlite._store import _commit_id
        before = _commit_id()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, " ".join(_commit_id() for _ in range(3)).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        child = set(os.read(read, 4096).decode().split())
        parent = {_commit_id() for _ in range(3)}
        print(len(child), len(parent), len(child & parent), before in child)
        """
    assert _run_script(script) == "3 3 0 False"


def test_unique_key_is_the_last_line_of_defence(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/u.db")
    store.append("s", 0, _records(1))
    with pytest.raises(sqlite3.IntegrityError):
        store._connection.execute(
            "INSERT INTO loom_records (stream, position, kind, payload, timestamp) "
            "VALUES ('s', 1, 'k', x'00', 0.0)"
        )


def test_a_delete_frees_the_streams_records_and_keeps_only_its_name(tmp_path: Path) -> None:
    """A deleted stream's records take no space: only its `loom_streams` row stays,
    retiring the name at its final head."""
    store = open_sqlite_store(f"sqlite://{tmp_path / 'deleted.db'}")
    store.append("gone", 0, _records(3))
    store.append("kept", 0, _records(2))
    store.delete("gone")
    rows = store._connection.execute(
        "SELECT stream, COUNT(*) FROM loom_records GROUP BY stream"
    ).fetchall()
    assert rows == [("kept", 2)]
    assert store._connection.execute(
        "SELECT floor, deleted FROM loom_streams WHERE name = 'gone'"
    ).fetchall() == [(3, 1)]


def test_a_listing_skips_deleted_streams_through_the_live_names_index(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path / 'live.db'}")
    for number in range(50):
        store.append(f"timers/{number:03d}", 0, _records(1))
        store.delete(f"timers/{number:03d}")  # handled timer buckets, as the engine leaves them
    store.append("timers/live", 0, _records(1))
    assert store.streams("timers/") == ["timers/live"]
    plan = store._connection.execute(
        "EXPLAIN QUERY PLAN SELECT name FROM loom_streams WHERE deleted = 0 AND name >= ? "
        "AND name < ? ORDER BY name LIMIT ?",
        ("timers/", "timers0", 100),
    ).fetchall()
    assert "loom_live_streams" in str(plan), "a listing walks live names only"


def test_a_failed_migration_rolls_back_and_leaves_no_write_lock_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migration that fails leaves the connection out of its transaction: another
    connection can write at once, and nothing of the half-made schema is left."""
    from loom_store_sqlite import _schema

    def broken(_db: object) -> None:
        raise sqlite3.OperationalError("disk I/O error (injected)")

    monkeypatch.setitem(_schema.MIGRATIONS, 0, broken)
    path = tmp_path / "half.db"
    connection = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError, match="injected"):
        _schema.ensure_schema(connection, str(path))
    assert not connection.in_transaction
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    other.execute("BEGIN IMMEDIATE")
    assert other.execute("SELECT name FROM sqlite_master").fetchall() == []
    other.execute("ROLLBACK")
    other.close()
    connection.close()
