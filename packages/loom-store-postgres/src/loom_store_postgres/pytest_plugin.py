"""pytest fixtures for a throwaway PostgreSQL cluster: `postgres_server`.

Enable with ``pytest_plugins = ["loom_store_postgres.pytest_plugin"]`` in a
conftest.py. One cluster per test process (each pytest-xdist worker starts its own),
each test's store in a schema of its own. Where PostgreSQL is not installed
(scripts/install-postgres installs it), the tests that need it skip and say why.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loom_store_postgres.testing import PostgresServer, find_programs

__all__ = ["postgres_server"]


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL cluster on 127.0.0.1 for the session."""
    if find_programs() is None:
        pytest.skip(
            "SKIPPED LOUDLY: PostgreSQL is not installed (no initdb/pg_ctl); run "
            "scripts/install-postgres (as root) to test the PostgreSQL store"
        )
    with PostgresServer() as server:
        yield server
