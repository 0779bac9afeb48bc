"""Loom's PostgreSQL store: the journal SPI on PostgreSQL, through psycopg 3.

    from loom_kernel import open_store
    store = open_store("postgresql://loom@db.internal/app?schema=loom&pool_max=20")

docs/stores/postgres.md covers the schema, the options, costs and failures.
"""

from __future__ import annotations

from loom_kernel.spi import StoreFactory

from loom_store_postgres._options import PostgresOptions, parse_postgres_url
from loom_store_postgres._schema import SCHEMA_VERSION
from loom_store_postgres._store import PostgresStore

__all__ = [
    "SCHEMA_VERSION",
    "PostgresOptions",
    "PostgresStore",
    "open_postgres_store",
    "postgres_store_factory",
]


def open_postgres_store(url: str) -> PostgresStore:
    """Open `postgresql://user:password@host:port/database?option=value&...`.

    The store's options (`schema`, `pool_min`, `pool_max`, `timeout`, `blobs`,
    `blob_threshold`, `notify`: see PostgresOptions) are taken out of the query; the
    rest of it (`sslmode`, `application_name`, ...) goes to libpq as it is. The
    schema and its tables are created if missing.
    """
    conninfo, options = parse_postgres_url(url)
    return PostgresStore(conninfo, options)


def open_existing_postgres_store(url: str) -> PostgresStore:
    """`open_postgres_store`, for a store whose tables exist: a mistyped schema or
    database is refused with StoreMisconfiguredError, never created."""
    conninfo, options = parse_postgres_url(url)
    return PostgresStore(conninfo, options, create=False)


#: What the `loom.stores` entry points publish for `postgresql` and `postgres`.
postgres_store_factory = StoreFactory(
    open_postgres_store, open_existing=open_existing_postgres_store
)
