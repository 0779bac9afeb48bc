"""Group commit on PostgreSQL: appends of concurrent threads share a transaction sent as
one pipeline, each keeping its own head check and verdict; an append the server
refuses inside a group fails alone, the others landing."""

from __future__ import annotations

import secrets
import threading
from typing import Any

import pytest
from loom_kernel.spi import ConflictError, NewRecord, PendingAppend
from loom_store_postgres import PostgresStore
from loom_store_postgres.testing import PostgresServer

THREADS = 24
ROUNDS = 30


def _record(text: str) -> list[NewRecord]:
    return [NewRecord("n", text.encode(), 1.0)]


def _pending(store: PostgresStore, stream: str, expected: int, **overrides: Any) -> PendingAppend:
    """A one-record append as the store hands it to its group commit (for calling
    `_commit_group` directly), with any statement parameter overridden."""
    params = {
        "stream": stream,
        "expected": expected,
        "head": expected + 1,
        "first": expected + 1,
        "commit": 1000 + expected,
        "channel": "unused",
        "kind": "n",
        "payload": b"p",
        "ts": 1.0,
        **overrides,
    }
    sql = store._statements.appends[(expected == 0, True, False)]
    return PendingAppend(stream, expected, [sql, params])


def test_racing_appends_share_transactions_and_each_keeps_its_verdict(
    postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = postgres_server.store(pool_max=THREADS)
    groups: list[int] = []
    apply = store._apply

    def noted(connection: Any, batch: list[PendingAppend]) -> None:
        groups.append(len(batch))
        apply(connection, batch)

    monkeypatch.setattr(store, "_apply", noted)
    won: dict[int, str] = {}  # position in "shared" -> the payload acknowledged there
    lock = threading.Lock()
    start = threading.Barrier(THREADS)

    def writer(number: int) -> None:
        start.wait()
        for round_ in range(ROUNDS):
            store.append(f"own/{number}", round_, _record(f"{number}.{round_}"))
            head = store.head("shared")
            text = f"{number}.{round_}"
            try:
                landed = store.append("shared", head, _record(text))
            except ConflictError:
                continue
            with lock:
                assert landed not in won, "two appends acknowledged at one position"
                won[landed] = text

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert max(groups) > 1, "no group formed: the test did not exercise group commit"
    for number in range(THREADS):
        records = store.read(f"own/{number}")
        assert [r.payload.decode() for r in records] == [
            f"{number}.{round_}" for round_ in range(ROUNDS)
        ]
    shared = store.read("shared")
    assert [r.position for r in shared] == list(range(1, len(shared) + 1))
    assert {r.position: r.payload.decode() for r in shared} == won
    store.close()


def test_an_append_the_server_refuses_inside_a_group_fails_alone(
    postgres_server: PostgresServer,
) -> None:
    store = postgres_server.store()
    store.append("a", 0, _record("a1"))

    good, refused, also_good = (
        _pending(store, "a", 1),
        _pending(store, "b", 0, head=2**70),  # over bigint: the server refuses it
        _pending(store, "c", 0),
    )
    store._commit_group([good, refused, also_good])
    assert good.error is None
    assert also_good.error is None
    assert refused.error is not None
    assert store.head("a") == 2
    assert store.head("c") == 1
    assert store.head("b") == 0
    store.close()


def test_appends_to_one_stream_in_one_group_chain_their_heads(
    postgres_server: PostgresServer,
) -> None:
    store: PostgresStore = postgres_server.store()
    batch = [
        _pending(store, stream, expected, payload=f"{stream}{expected}".encode())
        for stream, expected in (("z", 0), ("y", 0), ("z", 1), ("z", 1), ("y", 1))
    ]
    store._commit_group(batch)
    assert [type(a.error).__name__ if a.error else None for a in batch] == [
        None,
        None,
        None,
        "ConflictError",
        None,
    ]
    assert [r.payload for r in store.read("z")] == [b"z0", b"z1"]
    assert [r.payload for r in store.read("y")] == [b"y0", b"y1"]
    store.close()


def test_a_conflict_within_a_group_that_never_committed_is_not_reported(
    tmp_path: Any,
) -> None:
    """Two appends at 0 to one stream share a group: inside its transaction the second
    sees the first's row and conflicts. The server crashes before the group's COMMIT
    returns: nothing landed, so the second must not report a ConflictError (a head of
    1 that never was); both confirm by commit id and fail as may-have-landed."""
    import time

    import psycopg
    from loom_kernel.spi import StoreUnavailableError

    with PostgresServer() as server:
        url = server.store_url(schema="fc", pool_max=4, timeout=5)
        from loom_kernel import open_store

        store = open_store(url)
        with psycopg.connect(server.url, autocommit=True) as admin:
            # Test scaffolding: a COMMIT that takes 1.5 s when it holds a "slow/" record,
            # a window the server's crash falls into.
            admin.execute(
                "CREATE FUNCTION fc.slow_commit() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END $$; "
                "CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON fc.loom_records "
                "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
                "WHEN (NEW.stream LIKE 'slow%') EXECUTE FUNCTION fc.slow_commit()"
            )
        results: dict[str, str] = {}

        def append(name: str, stream: str) -> None:
            try:
                store.append(stream, 0, _record(name))
                results[name] = "landed"
            except ConflictError:
                results[name] = "ConflictError"
            except StoreUnavailableError:
                results[name] = "unavailable"

        lead = threading.Thread(target=append, args=("lead", "slow/first"))
        lead.start()  # alone, slow to commit: the three below queue into one group
        time.sleep(0.3)
        group = [
            threading.Thread(target=append, args=(name, stream))
            for name, stream in (("one", "pair"), ("two", "pair"), ("three", "slow/second"))
        ]
        for thread in group:
            thread.start()
            time.sleep(0.05)
        lead.join()
        time.sleep(0.5)  # the group now waits in its COMMIT
        server.stop_immediately()
        for thread in group:
            thread.join()
        server.start()
        check = open_store(url)
        assert check.head("pair") == 0, "the group landed after all: the test missed"
        assert results["one"] == "unavailable"
        assert results["two"] == "unavailable", "a conflict with a write that never landed"
        store.close()
        check.close()


def test_a_row_lock_held_elsewhere_fails_only_its_own_append_of_a_group(
    postgres_server: PostgresServer,
) -> None:
    """Another session holds stream x's row past the store's lock timeout: the group's
    transaction fails on it (a lock timeout, not a lost connection), so each append
    goes again alone, and y lands while x alone fails."""
    import psycopg
    from loom_kernel.spi import StoreUnavailableError

    store: PostgresStore = postgres_server.store(timeout=1)
    store.append("x", 0, _record("x1"))
    with psycopg.connect(store.conninfo) as holder:
        holder.execute(
            f"SELECT 1 FROM {store.options.schema}.loom_streams WHERE name = 'x' FOR UPDATE"
        )
        batch = [_pending(store, "x", 1), _pending(store, "y", 0)]
        store._commit_group(batch)
        holder.rollback()
    assert isinstance(batch[0].error, StoreUnavailableError)
    assert batch[1].error is None
    assert store.head("y") == 1
    assert store.head("x") == 1
    store.close()


def test_a_group_whose_commit_fails_as_lost_is_never_applied_again_on_its_connection(
    postgres_server: PostgresServer,
) -> None:
    """A group's COMMIT fails with a lost-connection error while the connection still
    reads as open: the connection cannot be trusted, so no append of the group goes
    again alone on it (as after an append's own error); each confirms by its commit id,
    and none landed."""
    import psycopg
    from loom_kernel.spi import AmbiguousWriteError

    schema = f"lost_{secrets.token_hex(4)}"
    store = postgres_server.store(schema)
    with psycopg.connect(postgres_server.url, autocommit=True) as admin:
        # Test scaffolding: a COMMIT holding a "zz-lost" record fails as a server shut
        # down does (SQLSTATE 57P01), the connection left open.
        admin.execute(
            f"CREATE FUNCTION {schema}.lost_commit() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'as if shut down' USING ERRCODE = '57P01'; END $$; "
            f"CREATE CONSTRAINT TRIGGER lost AFTER INSERT ON {schema}.loom_records "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
            f"WHEN (NEW.stream = 'zz-lost') EXECUTE FUNCTION {schema}.lost_commit()"
        )
    group = [_pending(store, "pair", 0), _pending(store, "pair", 1), _pending(store, "zz-lost", 0)]
    store._commit_group(group)
    assert [type(append.error) for append in group] == [AmbiguousWriteError] * 3
    assert (store.head("pair"), store.head("zz-lost")) == (0, 0), "applied again alone"
    store.append("pair", 0, _record("after"))  # the store goes on
    assert store.head("pair") == 1
    store.close()
