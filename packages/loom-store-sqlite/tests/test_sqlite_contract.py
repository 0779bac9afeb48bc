"""The SQLite store keeps the journal contract: the conformance kit, on a file and in memory."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import settings
from loom_kernel import open_store
from loom_kernel.spi import JournalStore
from loom_kernel.testing import DEFAULT_SETTINGS, StoreContract
from loom_store_sqlite import SqliteStore


class TestSqliteFileStore(StoreContract):
    # Every example opens a fresh file; fewer examples keep the suite quick.
    hypothesis_settings = settings(DEFAULT_SETTINGS, max_examples=30)

    def make_store(self) -> JournalStore:
        self.path = Path(tempfile.mkdtemp(dir=self.scratch)) / "loom.db"
        return open_store(f"sqlite://{self.path}?synchronous=normal")

    def reopen_store(self, store: JournalStore) -> JournalStore:
        store.close()
        return open_store(f"sqlite://{self.path}?synchronous=normal")

    def twin_store(self, store: JournalStore) -> JournalStore:
        assert isinstance(store, SqliteStore)
        return open_store(f"sqlite://{store.path}?synchronous=normal")


class TestSqliteMemoryStore(StoreContract):
    def make_store(self) -> JournalStore:
        return open_store("sqlite:///:memory:")
