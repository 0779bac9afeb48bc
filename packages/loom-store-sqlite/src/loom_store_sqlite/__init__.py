"""Loom's embedded default store: the journal SPI on SQLite.

from loom_kernel import open_store
store = open_store("sqlite:///var/lib/app/loom.db?synchronous=full&timeout=10")
"""

from loom_store_sqlite._options import SqliteOptions
from loom_store_sqlite._schema import SCHEMA_VERSION
from loom_store_sqlite._store import SqliteStore, open_sqlite_store, sqlite_store_factory

__all__ = [
    "SCHEMA_VERSION",
    "SqliteOptions",
    "SqliteStore",
    "open_sqlite_store",
    "sqlite_store_factory",
]
