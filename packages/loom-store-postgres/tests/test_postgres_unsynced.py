"""Unsynced appends on PostgreSQL (`append(..., sync=False)`): committed with
`synchronous_commit` off for their own transaction only, every other append synced,
a refused unsynced append writing nothing and the session left as it was."""

from __future__ import annotations

from typing import Any

import pytest
from loom_kernel.spi import ConflictError, NewRecord, PendingAppend, StreamDeletedError
from loom_store_postgres import PostgresStore
from loom_store_postgres.testing import PostgresServer


def _records(count: int, tag: str = "r") -> list[NewRecord]:
    return [NewRecord("k", f"{tag}{index}".encode(), 1.0) for index in range(count)]


def _noting(store: PostgresStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The `synchronous_commit` each group's statements ran under, as they ran."""
    seen: list[str] = []
    apply = store._apply

    def noted(connection: Any, batch: list[PendingAppend]) -> None:
        seen.append(connection.execute("SHOW synchronous_commit").fetchone()[0])
        apply(connection, batch)

    monkeypatch.setattr(store, "_apply", noted)
    return seen


def test_an_unsynced_append_commits_with_synchronous_commit_off_for_itself_only(
    postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = postgres_server.store()
    try:
        seen = _noting(store, monkeypatch)
        assert store.append("s", 0, _records(2), sync=False) == 2
        assert store.append("s", 2, _records(1)) == 3
        assert store.append("s", 3, _records(1), sync=False) == 4
        assert store.append("s", 4, _records(3)) == 7
        assert seen == ["off", "on", "off", "on"]
        assert [record.position for record in store.read("s")] == list(range(1, 8))
    finally:
        store.close()


def test_a_refused_unsynced_append_writes_nothing_and_leaves_the_session_synced(
    postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = postgres_server.store(pool_max=1)  # one connection: every call reuses it
    try:
        seen = _noting(store, monkeypatch)
        store.append("s", 0, _records(1))
        with pytest.raises(ConflictError):
            store.append("s", 0, _records(1, "stale"), sync=False)
        store.delete("s")
        with pytest.raises(StreamDeletedError):
            store.append("s", 1, _records(1, "gone"), sync=False)
        assert store.append("t", 0, _records(1)) == 1
        assert seen == ["on", "off", "off", "on"]
        with store._connection("look") as connection:
            assert connection.execute("SHOW synchronous_commit").fetchone() == ("on",)
            assert not connection.info.transaction_status  # idle: nothing left open
    finally:
        store.close()
