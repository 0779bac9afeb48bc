"""Unsynced appends (`append(..., sync=False)`): committed at `synchronous=NORMAL`
when the store syncs its commits, the connection synced again for every other
write, even after an interrupt between the two."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from loom_kernel.spi import NewRecord, PendingAppend
from loom_store_sqlite import SqliteOptions, SqliteStore
from loom_store_sqlite.testing import queued_appends, raw_connection

NORMAL, FULL, EXTRA = 1, 2, 3


def _records(count: int, tag: str = "r") -> list[NewRecord]:
    return [NewRecord("k", f"{tag}{index}".encode(), 1.0) for index in range(count)]


class SeenStore(SqliteStore):
    """Notes the `synchronous` level each commit runs at (read on its connection just
    before its statements), and can interrupt the next one."""

    def __init__(self, path: str, synchronous: str = "full") -> None:
        super().__init__(path, SqliteOptions(synchronous=synchronous))
        self.levels: list[int] = []
        self.interrupt_next = False
        self.gate: threading.Event | None = None

    def _look(self, connection: sqlite3.Connection) -> None:
        self.levels.append(connection.execute("PRAGMA synchronous").fetchone()[0])
        if self.gate is not None:
            gate, self.gate = self.gate, None
            assert gate.wait(10)
        if self.interrupt_next:
            self.interrupt_next = False
            raise KeyboardInterrupt

    def _insert_alone(
        self, connection: sqlite3.Connection, append: PendingAppend
    ) -> list[PendingAppend]:
        self._look(connection)
        return super()._insert_alone(connection, append)

    def _transact(
        self, connection: sqlite3.Connection, batch: list[PendingAppend], *, isolated: bool
    ) -> list[PendingAppend] | None:
        self._look(connection)
        return super()._transact(connection, batch, isolated=isolated)


def _level(store: SqliteStore) -> int:
    level: int = raw_connection(store).execute("PRAGMA synchronous").fetchone()[0]
    return level


@pytest.mark.parametrize(("synchronous", "synced"), [("full", FULL), ("extra", EXTRA)])
def test_an_unsynced_append_commits_at_normal_and_the_next_append_syncs(
    tmp_path: Path, synchronous: str, synced: int
) -> None:
    store = SeenStore(str(tmp_path / "u.db"), synchronous)
    try:
        store.append("s", 0, _records(2), sync=False)  # a new stream: a transaction
        store.append("s", 2, _records(1))  # one record to a stream that exists: alone
        store.append("s", 3, _records(1), sync=False)
        store.append("s", 4, _records(3))
        assert store.levels == [NORMAL, synced, NORMAL, synced]
        assert _level(store) == synced, "the connection must be left syncing"
        assert store.read("s")[-1].position == 7
    finally:
        store.close()


@pytest.mark.parametrize("synchronous", ["normal", "off"])
def test_a_store_that_does_not_sync_commits_leaves_its_level_alone(
    tmp_path: Path, synchronous: str
) -> None:
    store = SeenStore(str(tmp_path / "u.db"), synchronous)
    try:
        store.append("s", 0, _records(1), sync=False)
        store.append("s", 1, _records(1))
        own = {"normal": NORMAL, "off": 0}[synchronous]
        assert store.levels == [own, own]
    finally:
        store.close()


def test_an_interrupted_unsynced_append_leaves_no_later_write_unsynced(tmp_path: Path) -> None:
    store = SeenStore(str(tmp_path / "u.db"))
    try:
        store.append("s", 0, _records(1))
        store.interrupt_next = True
        with pytest.raises(KeyboardInterrupt):
            store.append("s", 1, _records(1), sync=False)
        assert _level(store) == NORMAL, "the interrupt came between the level and its restore"
        store.append("s", 1, _records(1))  # lands: the interrupted one never committed
        assert store.levels[-1] == FULL, "the next append must sync"
        store.interrupt_next = True
        with pytest.raises(KeyboardInterrupt):
            store.append("s", 2, _records(1), sync=False)
        store.trim("s", 2)  # a write that is not an append: back to syncing first
        assert _level(store) == FULL
        assert store.head("s") == 2
    finally:
        store.close()


@pytest.mark.parametrize(("sync", "level"), [(True, FULL), (False, NORMAL)])
def test_a_group_syncs_unless_every_append_in_it_is_unsynced(
    tmp_path: Path, sync: bool, level: int
) -> None:
    store = SeenStore(str(tmp_path / "u.db"))
    try:
        store.append("a", 0, _records(1))
        store.append("b", 0, _records(1))
        store.levels.clear()
        gate = store.gate = threading.Event()
        heads: dict[str, int] = {}

        def append(stream: str, expected: int, sync: bool) -> None:
            heads[stream] = store.append(stream, expected, _records(1, stream), sync=sync)

        first = threading.Thread(target=append, args=("a", 1, False))
        first.start()
        deadline = time.monotonic() + 10
        while not store.levels:  # the first group holds the lead at the gate
            assert time.monotonic() < deadline, "the first append never committed"
            time.sleep(0.001)
        others = [
            threading.Thread(target=append, args=("b", 1, False)),
            threading.Thread(target=append, args=("c", 0, sync)),
        ]
        for thread in others:
            thread.start()
        while queued_appends(store) < 2:
            assert time.monotonic() < deadline, "the appends never queued"
            time.sleep(0.001)
        gate.set()
        for thread in [first, *others]:
            thread.join(10)
        assert heads == {"a": 2, "b": 2, "c": 1}
        assert store.levels == [NORMAL, level], "the second group commits b and c together"
    finally:
        store.close()


class _NoWal(sqlite3.Connection):
    """A connection on which turning WAL on does nothing (as on a file system with
    no shared memory): the database stays in its rollback journal."""

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql == "PRAGMA journal_mode=WAL":
            sql = "PRAGMA journal_mode"
        return super().execute(sql, *args)


def test_in_a_rollback_journal_every_commit_syncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    connect = sqlite3.connect

    def without_wal(*args: Any, **options: Any) -> sqlite3.Connection:
        return connect(*args, factory=_NoWal, **options)

    monkeypatch.setattr(sqlite3, "connect", without_wal)
    store = SeenStore(str(tmp_path / "u.db"))
    try:
        assert raw_connection(store).execute("PRAGMA journal_mode").fetchone() == ("delete",)
        store.append("s", 0, _records(1), sync=False)
        store.append("s", 1, _records(1), sync=False)
        assert store.levels == [FULL, FULL], "NORMAL in a rollback journal risks the file"
    finally:
        store.close()
