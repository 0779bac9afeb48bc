"""Connections: one per thread, with the pragmas the URL asks for, closed as their
thread ends or the store closes (never under another thread's statement, never at
exit under a daemon thread), and none crossing a fork."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from loom_kernel.spi import NewRecord, StoreUnavailableError
from loom_store_sqlite import SqliteOptions, SqliteStore, open_sqlite_store
from loom_store_sqlite.testing import open_connections, raw_connection


def _records(count: int) -> list[NewRecord]:
    return [NewRecord("k", str(i).encode(), float(i)) for i in range(count)]


def test_pragmas_are_applied(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/p.db?synchronous=normal")
    connection = raw_connection(store)
    assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert connection.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    default = open_sqlite_store(f"sqlite://{tmp_path}/q.db")
    assert raw_connection(default).execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


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


def test_a_threads_connection_is_closed_when_the_thread_ends(tmp_path: Path) -> None:
    """Threads that come and go (a pool's that end when idle, one per request) leave no
    connection open behind them; a thread still running keeps its own."""
    store = SqliteStore(str(tmp_path / "c.db"), SqliteOptions(synchronous="normal"))
    before = len(open_connections(store))
    stays = threading.Event()
    running: list[sqlite3.Connection] = []

    def lives_on() -> None:
        store.append("kept", 0, _records(1))
        running.append(raw_connection(store))
        assert stays.wait(10)
        store.append("kept", 1, _records(1))  # its connection still works

    keeper = threading.Thread(target=lives_on)
    keeper.start()
    ended: list[sqlite3.Connection] = []
    for number in range(30):

        def short(n: int = number) -> None:
            store.append(f"s{n}", 0, _records(1))
            ended.append(raw_connection(store))

        thread = threading.Thread(target=short)
        thread.start()
        thread.join()
    assert len(ended) == 30
    for connection in ended:
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            connection.execute("SELECT 1")
    assert len(open_connections(store)) == before + 1, "the running thread's only"
    stays.set()
    keeper.join()
    assert len(open_connections(store)) == before
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
    opened = open_connections(store)
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
        from loom_store_sqlite.testing import open_connections
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
            assert open_connections(store) == [], "none left open"
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


def test_a_forked_child_closes_none_of_its_parents_thread_connections(tmp_path: Path) -> None:
    script = f"""
        import os, threading
        from loom_kernel.spi import NewRecord
        from loom_store_sqlite import SqliteStore
        from loom_store_sqlite.testing import open_connections, raw_connection
        store = SqliteStore({str(tmp_path / "f.db")!r})
        made, release = threading.Event(), threading.Event()
        held = []
        def lives() -> None:
            store.append("s", 0, [NewRecord("k", b"1", 1.0)])
            held.append(raw_connection(store))
            made.set()
            release.wait(10)
        thread = threading.Thread(target=lives)
        thread.start()
        made.wait(10)
        listed = len(open_connections(store))
        pid = os.fork()
        if pid == 0:  # the child has no such thread: its locals are dropped here
            import gc
            gc.collect()
            still = len(open_connections(store)) == listed and held[0].in_transaction is False
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


def test_a_store_closed_in_a_forked_child_never_frees_its_parents_connections(
    tmp_path: Path,
) -> None:
    """A connection freed in the child would run SQLite's close there, on the parent's
    file and its shared WAL index: the child's close keeps every inherited connection
    alive (never freed, so never closed), however the store is dropped."""
    script = f"""
        import gc, os, sqlite3
        from loom_kernel.spi import NewRecord
        from loom_store_sqlite import SqliteStore
        store = SqliteStore({str(tmp_path / "kept.db")!r})
        store.append("p", 0, [NewRecord("k", b"1", 1.0)])
        def connections():
            gc.collect()
            return sum(isinstance(o, sqlite3.Connection) for o in gc.get_objects())
        pid = os.fork()
        if pid == 0:
            before = connections()
            store.close()
            store.close()
            del store
            os._exit(0 if connections() == before > 0 else 1)
        _, status = os.waitpid(pid, 0)
        store.append("p", 1, [NewRecord("k", b"2", 1.0)])
        print(os.waitstatus_to_exitcode(status), store.head("p"))
        """
    assert _run_script(script) == "0 2"


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
