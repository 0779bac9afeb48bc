"""Transactions: an interrupt as BEGIN returns, or at COMMIT, leaves the connection
out of its transaction, holding no lock and no read snapshot."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from loom_kernel.spi import NewRecord
from loom_store_sqlite import open_sqlite_store
from loom_store_sqlite.testing import connection_stand_in, raw_connection


def _records(count: int, tag: str = "r") -> list[NewRecord]:
    return [NewRecord("k", f"{tag}{i}".encode(), float(i)) for i in range(count)]


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
    real = raw_connection(store)
    call = (
        (lambda: store.trim("s", 1))
        if interrupted == "trim"
        else (lambda: store.append("s", 1, _records(2, "lost")))
    )
    with connection_stand_in(store, _BeginThenInterrupt(real)), pytest.raises(KeyboardInterrupt):
        call()
    assert not real.in_transaction, "the lock was given back"
    assert store.append("s", 1, _records(1, "next")) == 2
    other = open_sqlite_store(f"sqlite://{path}?timeout=0")  # another process, no waiting
    assert [r.payload for r in other.read("s")] == [b"r0", b"next0"], "committed, for real"
    assert other.append("s", 2, _records(1, "other")) == 3, "no write lock was left behind"


def test_an_interrupt_at_commit_leaves_the_connection_out_of_its_transaction(
    tmp_path: Path,
) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/i.db")
    store.append("s", 0, _records(1))
    real = raw_connection(store)

    class InterruptedAtCommit:
        def execute(self, sql: str, *args: Any) -> Any:
            if sql == "COMMIT":
                raise KeyboardInterrupt
            return real.execute(sql, *args)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    with connection_stand_in(store, InterruptedAtCommit()):
        with pytest.raises(KeyboardInterrupt):
            store.read("s")
        assert not real.in_transaction, "it would hold a read snapshot, or refuse its next BEGIN"
    assert store.append("s", 1, _records(1)) == 2
