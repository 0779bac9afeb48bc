"""The PostgreSQL store's URL, its opening (a schema made once, a newer one refused, a
missing one not made by a command that reads), its errors in the kernel's tree, and
its refusal to cross a fork."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import psycopg
import pytest
from loom_kernel import open_store
from loom_kernel.spi import (
    ConflictError,
    InvalidArgumentError,
    NewRecord,
    StoreMisconfiguredError,
    StoreUnavailableError,
    StreamDeletedError,
)
from loom_store_postgres import PostgresOptions, PostgresStore
from loom_store_postgres._options import parse_postgres_url
from loom_store_postgres._store import session_settings
from loom_store_postgres.testing import PostgresServer

RECORD = [NewRecord("k", b"1", 1.0)]


def test_the_url_gives_the_store_its_options_and_libpq_the_rest() -> None:
    conninfo, options = parse_postgres_url(
        "postgresql://u:p@h:5433/db?schema=app_1&pool_max=20&sslmode=require&timeout=2.5"
        "&notify=off&application_name=billing"
    )
    assert conninfo == "postgresql://u:p@h:5433/db?sslmode=require&application_name=billing"
    assert options == PostgresOptions(schema="app_1", pool_max=20, timeout=2.5, notify=False)
    assert parse_postgres_url("postgres://h/db")[1] == PostgresOptions()


@pytest.mark.parametrize(
    "query",
    [
        "schema=Bad-Name",
        "schema=1abc",
        "schema=",
        "pool_max=0",
        "pool_min=5&pool_max=2",
        "timeout=nan",
        "timeout=0",
        "timeout=soon",
        "notify=maybe",
        "blobs=",
        "schema=a&schema=b",
        "blob_threshold=-1",
    ],
)
def test_a_bad_option_is_refused_before_any_connection(query: str) -> None:
    with pytest.raises(InvalidArgumentError):
        open_store(f"postgresql://loom@127.0.0.1:1/none?{query}")


def test_a_url_of_another_scheme_or_with_a_fragment_is_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        parse_postgres_url("mysql://h/db")
    with pytest.raises(InvalidArgumentError):
        parse_postgres_url("postgresql://h/db#frag")


def test_a_server_that_is_not_there_is_unavailable() -> None:
    with pytest.raises(StoreUnavailableError):
        open_store("postgresql://loom@127.0.0.1:1/postgres?timeout=1")


def test_a_missing_database_or_a_command_that_reads_a_missing_schema_is_misconfigured(
    postgres_server: PostgresServer,
) -> None:
    base = f"postgresql://loom@127.0.0.1:{postgres_server.port}"
    with pytest.raises(StoreMisconfiguredError, match="database does not exist"):
        open_store(f"{base}/no_such_database")
    with pytest.raises(StoreMisconfiguredError, match="no Loom store in schema"):
        open_store(postgres_server.store_url(schema="never_made"), create=False)
    with psycopg.connect(f"{base}/postgres") as admin:
        made = admin.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'never_made'"
        ).fetchone()
    assert made == (0,), "a command that reads made the schema"


def test_a_store_of_a_newer_version_is_refused(postgres_server: PostgresServer) -> None:
    store = postgres_server.store(schema="newer")
    store.append("s", 0, RECORD)
    with psycopg.connect(store.conninfo, autocommit=True) as admin:
        admin.execute("UPDATE newer.loom_meta SET value = '99' WHERE key = 'schema_version'")
    store.close()
    with pytest.raises(StoreMisconfiguredError, match="upgrade loom-store-postgres"):
        postgres_server.store(schema="newer")


def test_processes_opening_a_new_store_together_make_its_tables_once(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.store_url(schema="together")
    errors: list[BaseException] = []
    stores: list[PostgresStore] = []
    start = threading.Barrier(8)

    def opener() -> None:
        start.wait()
        try:
            store = open_store(url)
            assert isinstance(store, PostgresStore)
            stores.append(store)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=opener) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stores[0].append("s", 0, RECORD)
    assert all(store.head("s") == 1 for store in stores)
    for store in stores:
        store.close()


def test_a_store_does_not_cross_a_fork_its_child_is_refused_at_each_call(
    postgres_server: PostgresServer,
) -> None:
    """In a forked child every call is refused, even while a parent's thread led a
    group commit as the process forked (the child would wait for ever behind it);
    closing touches nothing of the parent's, and the parent goes on."""
    url = postgres_server.store_url()
    script = f"""
        import os, threading
        from loom_kernel import open_store
        from loom_kernel.spi import NewRecord, StoreMisconfiguredError
        record = [NewRecord("k", b"1", 1.0)]
        store = open_store({url!r})
        inside, release = threading.Event(), threading.Event()
        commit = store._commit_group
        def slow(batch):
            if batch[0].stream == "slow":
                inside.set()
                release.wait(10)
            commit(batch)
        store._commit_group = slow
        store._group._commit = slow
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
                    refused += "does not cross a fork" in str(exc)
            store.close()
            os._exit(0 if refused == len(calls) else 1)
        _, status = os.waitpid(pid, 0)
        release.set()
        thread.join()
        store.append("p", 1, record)
        print(os.waitstatus_to_exitcode(status), store.head("slow"), store.head("p"))
        store.close()
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1", "2"], done.stderr


def test_a_login_the_server_refuses_is_misconfigured(postgres_server: PostgresServer) -> None:
    with pytest.raises(StoreMisconfiguredError, match="refused the login"):
        open_store(f"postgresql://nobody@127.0.0.1:{postgres_server.port}/postgres")


def test_a_user_without_privileges_on_the_schema_is_told_to_grant_them(
    postgres_server: PostgresServer,
) -> None:
    owner = postgres_server.store(schema="owned")
    with psycopg.connect(owner.conninfo, autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS stranger")
        admin.execute("CREATE ROLE stranger LOGIN")
    with pytest.raises(StoreMisconfiguredError, match="GRANT"):
        open_store(f"postgresql://stranger@127.0.0.1:{postgres_server.port}/postgres?schema=owned")
    owner.close()


def test_every_connection_flushes_its_commits_and_keeps_the_urls_own_options(
    postgres_server: PostgresServer,
) -> None:
    """synchronous_commit is on for the store's sessions whatever the role says (off
    would lose acknowledged appends in a crash); libpq `options` of the URL are kept."""
    with psycopg.connect(postgres_server.url, autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS careless")
        admin.execute("CREATE ROLE careless LOGIN SUPERUSER")
        admin.execute("ALTER ROLE careless SET synchronous_commit = off")
    base = f"postgresql://careless@127.0.0.1:{postgres_server.port}/postgres?schema=careful"
    store = open_store(f"{base}&options=-c%20work_mem%3D7MB&timeout=2")
    assert isinstance(store, PostgresStore)
    with store._pool.connection() as connection:
        shown = [
            connection.execute(f"SHOW {name}").fetchone()
            for name in ("synchronous_commit", "work_mem", "statement_timeout")
        ]
    assert shown == [("on",), ("7MB",), ("2s",)]
    store.close()


def test_a_timeout_under_a_millisecond_is_one_never_zero_which_is_off() -> None:
    settings = session_settings("postgresql://h/db", 0.0004)
    assert "statement_timeout=1 " in settings
    assert "lock_timeout=1 " in settings


def test_reads_after_a_server_restart_get_live_connections(
    tmp_path: object,
) -> None:
    with PostgresServer() as server:
        store = server.store(pool_min=4, pool_max=4, timeout=3)
        store.append("s", 0, RECORD)
        for _ in range(8):
            store.head("s")  # every pooled connection used
        server.stop_immediately()
        server.start()
        assert [store.head("s") for _ in range(12)] == [1] * 12
        store.close()


def test_a_lost_reply_confirmed_after_another_trimmed_the_record_is_not_a_conflict(
    postgres_server: PostgresServer,
) -> None:
    """The record that would tell whose append landed was trimmed meanwhile: the store
    cannot tell, so it says so (never ConflictError for what may be its own write)."""
    store = postgres_server.store()
    store.append("t", 0, RECORD * 3)
    store.trim("t", 3)
    with pytest.raises(StoreUnavailableError, match="trimmed meanwhile"):
        store._confirm("t", 0, 1, commit=12345, cause=RuntimeError("lost"))
    store.close()


def test_a_schema_name_of_63_characters_gets_a_notification_channel(
    postgres_server: PostgresServer,
) -> None:
    schema = "s" * 63
    store = postgres_server.store(schema=schema)
    woken = threading.Event()
    store.subscribe_wakes(woken.set)
    store.append("runs/open/0", 0, RECORD)
    assert woken.wait(5)
    store.close()
    with pytest.raises(StoreUnavailableError, match="closed"):
        store.subscribe_wakes(woken.set)
    with pytest.raises(StoreUnavailableError, match="closed"):
        store.head("runs/open/0")


def test_the_largest_record_is_256_mib_as_documented(postgres_server: PostgresServer) -> None:
    store = postgres_server.store()
    assert store.max_record_bytes == 256 * 1024 * 1024
    store.close()


def test_an_append_whose_connection_died_is_never_reported_landed(
    postgres_server: PostgresServer,
) -> None:
    """The server ends the pooled connection under a lone append: it wrote nothing,
    so it fails as may-have-landed (confirmed by its commit id), and the next lands."""
    store = postgres_server.store(pool_min=1, pool_max=1)
    store.append("s", 0, RECORD)
    with store._pool.connection() as connection:
        row = connection.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    with psycopg.connect(postgres_server.url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", row)
    with pytest.raises(StoreUnavailableError):
        store.append("s", 1, RECORD)
    assert store.head("s") == 1
    assert store.append("s", 1, RECORD) == 2
    store.close()


def test_a_confirmation_reads_whose_record_follows_the_expected_head(
    postgres_server: PostgresServer,
) -> None:
    store = postgres_server.store()
    lost = RuntimeError("the reply was lost")
    store.append("mine", 0, RECORD)
    with pytest.raises(StoreUnavailableError, match="did not land"):
        store._confirm("mine", 1, 1, commit=1, cause=lost)  # head still 1: not landed
    store.append("theirs", 0, RECORD * 2)
    with pytest.raises(ConflictError) as conflict:
        store._confirm("theirs", 1, 1, commit=1, cause=lost)  # another's record at 2
    assert conflict.value.actual == 2
    store.delete("theirs")
    with pytest.raises(StreamDeletedError):
        store._confirm("theirs", 1, 1, commit=1, cause=lost)
    with pytest.raises(StoreUnavailableError, match="did not land"):
        store._confirm("never", 0, 1, commit=1, cause=lost)
    store.close()


def test_an_append_refused_at_a_head_that_others_reach_meanwhile_goes_once_more(
    postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The append at 2 finds the stream at 1 and writes nothing; before the store reads
    why, another writer brings the head to 2: the append goes again and lands."""
    store = postgres_server.store()
    other = PostgresStore(store.conninfo, store.options)
    store.append("s", 0, RECORD)
    refusal = store._refusal
    calls: list[int] = []

    def racing(connection: Any, append: Any) -> BaseException:
        if not calls:
            other.append("s", 1, [NewRecord("k", b"other", 1.0)])
        calls.append(1)
        return refusal(connection, append)

    monkeypatch.setattr(store, "_refusal", racing)
    assert store.append("s", 2, [NewRecord("k", b"mine", 1.0)]) == 3
    assert [r.payload for r in store.read("s")] == [b"1", b"other", b"mine"]
    assert calls == [1]
    other.close()
    store.close()
