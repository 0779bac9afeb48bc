"""The PostgreSQL store keeps the journal contract: the conformance kit in full (examples,
a second instance, the fault seam, the state machine) against a real server."""

from __future__ import annotations

import pytest
from hypothesis import settings
from loom_kernel.spi import JournalStore
from loom_kernel.testing import DEFAULT_SETTINGS, StoreContract
from loom_store_postgres import PostgresStore
from loom_store_postgres.testing import PostgresServer


class TestPostgresStore(StoreContract):
    hypothesis_settings = settings(DEFAULT_SETTINGS, max_examples=30)

    @pytest.fixture(autouse=True)
    def _server(self, postgres_server: PostgresServer) -> None:
        self.server = postgres_server

    def make_store(self) -> JournalStore:
        return self.server.store()

    def reopen_store(self, store: JournalStore) -> JournalStore:
        assert isinstance(store, PostgresStore)
        store.close()
        return PostgresStore(store.conninfo, store.options)

    def twin_store(self, store: JournalStore) -> JournalStore:
        assert isinstance(store, PostgresStore)
        return PostgresStore(store.conninfo, store.options)

    @pytest.mark.slow
    def test_state_machine(self) -> None:
        super().test_state_machine()
