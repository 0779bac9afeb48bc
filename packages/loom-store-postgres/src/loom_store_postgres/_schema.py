"""The store's tables, created in their own schema on first open (under an advisory
lock, so processes opening a new store together make them once), and the SQL each
hook runs, written once per schema name."""

# ruff: noqa: S608 - the only name put into SQL is the schema, checked by PostgresOptions
# to be lower-case letters, digits and "_"; every value goes as a parameter.

from __future__ import annotations

from typing import Final

import attrs
import psycopg
from loom_kernel.spi import StoreMisconfiguredError

__all__ = ["SCHEMA_VERSION", "Statements", "ensure_schema", "schema_exists"]

#: The version of the tables this store writes; an older store refuses a newer one.
SCHEMA_VERSION: Final = 1

_CREATE: Final = """
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.loom_meta (
    key text PRIMARY KEY,
    value text NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}.loom_streams (
    name text COLLATE "C" PRIMARY KEY,
    head bigint NOT NULL,
    floor bigint NOT NULL DEFAULT 0,
    deleted boolean NOT NULL DEFAULT false
);
CREATE TABLE IF NOT EXISTS {s}.loom_records (
    stream text COLLATE "C" NOT NULL,
    position bigint NOT NULL,
    kind text NOT NULL,
    payload bytea NOT NULL,
    ts double precision NOT NULL,
    commit_id bigint,
    PRIMARY KEY (stream, position)
);
INSERT INTO {s}.loom_meta (key, value) VALUES ('schema_version', '{version}')
    ON CONFLICT (key) DO NOTHING;
"""


def _quoted(schema: str) -> str:
    return f'"{schema}"'  # checked by PostgresOptions: lower-case letters, digits, '_'


def schema_exists(connection: psycopg.Connection[tuple[object, ...]], schema: str) -> bool:
    """Whether the store's tables are in `schema`."""
    row = connection.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f"{_quoted(schema)}.loom_meta",)
    ).fetchone()
    return bool(row and row[0])


def ensure_schema(connection: psycopg.Connection[tuple[object, ...]], schema: str) -> None:
    """Create the store's tables in `schema` if they are missing; refuse tables of a
    newer version than this store writes.

    Raises:
        StoreMisconfiguredError: the tables are of a newer version.
    """
    if not schema_exists(connection, schema):
        with connection.transaction():
            connection.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"loom:{schema}",))
            connection.execute(_CREATE.format(s=_quoted(schema), version=SCHEMA_VERSION))
    row = connection.execute(
        f"SELECT value FROM {_quoted(schema)}.loom_meta WHERE key = 'schema_version'"
    ).fetchone()
    found = int(str(row[0])) if row else 0
    if found > SCHEMA_VERSION:
        raise StoreMisconfiguredError(
            f"the store in schema {schema!r} is of version {found}, newer than this "
            f"loom-store-postgres writes ({SCHEMA_VERSION}): upgrade loom-store-postgres"
        )


_APPEND_ONE: Final = """
WITH moved AS ({move}),
written AS (
    INSERT INTO {s}.loom_records (stream, position, kind, payload, ts, commit_id)
    SELECT name, %(first)s, %(kind)s, %(payload)s, %(ts)s, %(commit)s FROM moved
    RETURNING 1
)
SELECT count(*){notify} FROM written
"""
_APPEND_MANY: Final = """
WITH moved AS ({move}),
written AS (
    INSERT INTO {s}.loom_records (stream, position, kind, payload, ts, commit_id)
    SELECT name, %(expected)s + r.ord, r.kind, r.payload, r.ts,
           CASE WHEN r.ord = 1 THEN %(commit)s END
    FROM moved, unnest(%(kinds)s::text[], %(payloads)s::bytea[], %(stamps)s::float8[])
        WITH ORDINALITY AS r(kind, payload, ts, ord)
    RETURNING 1
)
SELECT count(*){notify} FROM written
"""
_CREATE_STREAM: Final = (
    "INSERT INTO {s}.loom_streams (name, head) VALUES (%(stream)s, %(head)s) "
    "ON CONFLICT (name) DO NOTHING RETURNING name"
)
_MOVE_HEAD: Final = (
    "UPDATE {s}.loom_streams SET head = %(head)s "
    "WHERE name = %(stream)s AND head = %(expected)s AND NOT deleted RETURNING name"
)
# A notification even where the append conflicted: a wake with nothing to do costs a
# poll; one lost would cost a wait.
_NOTIFY: Final = ", pg_notify(%(channel)s, '')::text"


@attrs.frozen
class Statements:
    """The SQL of every hook, for one schema."""

    appends: dict[tuple[bool, bool, bool], str]  # (at 0, one record, notify) -> SQL
    state: str
    confirm: str
    read: str
    streams: str
    lock_for_trim: str
    trim_floor: str
    trim_records: str
    delete_stream: str
    delete_records: str

    @classmethod
    def of(cls, schema: str) -> Statements:
        """The statements for the store in `schema`."""
        s = _quoted(schema)
        appends = {}
        for at_zero in (True, False):
            move = (_CREATE_STREAM if at_zero else _MOVE_HEAD).format(s=s)
            for one in (True, False):
                for notify in (True, False):
                    template = _APPEND_ONE if one else _APPEND_MANY
                    appends[(at_zero, one, notify)] = template.format(
                        s=s, move=move, notify=_NOTIFY if notify else ""
                    )
        return cls(
            appends=appends,
            state=f"SELECT head, deleted FROM {s}.loom_streams WHERE name = %s",
            confirm=(
                f"SELECT s.head, s.deleted, s.floor, r.commit_id FROM {s}.loom_streams s "
                f"LEFT JOIN {s}.loom_records r ON r.stream = s.name AND r.position = %s "
                "WHERE s.name = %s"
            ),
            read=(
                f"SELECT s.floor, s.deleted, r.position, r.kind, r.payload, r.ts "
                f"FROM {s}.loom_streams s LEFT JOIN LATERAL ("
                f"SELECT position, kind, payload, ts FROM {s}.loom_records "
                "WHERE stream = s.name AND position > %(after)s AND %(after)s >= s.floor "
                "AND NOT s.deleted ORDER BY position LIMIT %(limit)s) r ON true "
                "WHERE s.name = %(stream)s"
            ),
            streams=(
                f"SELECT name FROM {s}.loom_streams WHERE name >= %(low)s AND name < %(high)s "
                "AND name > %(after)s AND NOT deleted ORDER BY name LIMIT %(limit)s"
            ),
            lock_for_trim=(
                f"SELECT head, floor, deleted FROM {s}.loom_streams WHERE name = %s FOR UPDATE"
            ),
            trim_floor=f"UPDATE {s}.loom_streams SET floor = %s WHERE name = %s",
            trim_records=f"DELETE FROM {s}.loom_records WHERE stream = %s AND position < %s",
            delete_stream=(
                f"INSERT INTO {s}.loom_streams (name, head, deleted) VALUES (%s, 0, true) "
                "ON CONFLICT (name) DO UPDATE SET deleted = true, "
                "floor = loom_streams.head"
            ),
            delete_records=f"DELETE FROM {s}.loom_records WHERE stream = %s",
        )
