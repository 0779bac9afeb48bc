"""The memory store keeps the journal contract (the kit, run on the reference store)."""

from __future__ import annotations

import uuid

from loom_kernel import MemoryStore, open_store
from loom_kernel.spi import JournalStore
from loom_kernel.testing import StoreContract


class TestPrivateMemoryStore(StoreContract):
    def make_store(self) -> JournalStore:
        return MemoryStore()


class TestNamedMemoryStore(StoreContract):
    """memory://NAME is shared by name, so it can be closed and reopened."""

    def make_store(self) -> JournalStore:
        self.url = f"memory://kit-{uuid.uuid4().hex}"
        return open_store(self.url)

    def reopen_store(self, store: JournalStore) -> JournalStore:
        store.close()
        return open_store(self.url)

    def twin_store(self, store: JournalStore) -> JournalStore:
        assert isinstance(store, MemoryStore)
        return open_store(f"memory://{store.name}")
