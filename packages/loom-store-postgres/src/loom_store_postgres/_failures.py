"""PostgreSQL's errors in the kernel's tree: a refusal that will last, a value no retry
can take, or a fault that will pass (the default: when in doubt, it is transient)."""

from __future__ import annotations

from typing import Final

import psycopg
from loom_kernel.spi import (
    InvalidArgumentError,
    LoomError,
    StoreMisconfiguredError,
    StoreUnavailableError,
)

__all__ = ["is_connection_lost", "store_error"]

#: SQLSTATE classes and codes that no retry changes, with what to do about each.
_PERMANENT: Final = {
    "28": "the server refused the login: check the user, the password and pg_hba.conf",
    "3D": "the database does not exist: create it, or fix the store URL",
    "3F": "the schema does not exist or cannot be made: check the store URL's schema",
    "42501": "the user lacks a privilege on the store's schema: GRANT it (docs/stores/postgres.md)",
    "25006": "the server is read-only (a standby): point the store at the primary",
    "0A000": "the server lacks a feature the store needs (PostgreSQL 13 or newer)",
    "55000": "the database does not accept connections (ALLOW_CONNECTIONS false): use another",
}
#: A value over one of PostgreSQL's limits (a row or a field too large).
_TOO_LARGE: Final = frozenset({"54000", "54001", "22001"})


#: A refusal at login carries no SQLSTATE in psycopg's error, only the server's words.
_LOGIN_REFUSALS: Final = (
    ('role "', "28"),  # role "x" does not exist
    ("does not exist", "3D"),  # database "x" does not exist
    ("password authentication failed", "28"),
    ("no pg_hba.conf entry", "28"),
    ("pg_hba.conf rejects connection", "28"),
    ("is not currently accepting connections", "55000"),
    ("permission denied for database", "42501"),
)


def store_error(what: str, exc: psycopg.Error) -> LoomError:
    """The kernel's error for a psycopg failure while doing `what`."""
    state = exc.sqlstate or ""
    if not state and isinstance(exc, psycopg.OperationalError):
        text = str(exc)
        state = next((code for words, code in _LOGIN_REFUSALS if words in text), "")
    if state in _TOO_LARGE:
        return InvalidArgumentError(
            f"{what}: {exc}: a record is over PostgreSQL's limits (the store's "
            "max_record_bytes); nothing was written, and no retry can take it"
        )
    remedy = _PERMANENT.get(state) or _PERMANENT.get(state[:2])
    if remedy is not None:
        return StoreMisconfiguredError(f"{what}: {_first_line(exc)} ({remedy})")
    return StoreUnavailableError(f"{what}: {_first_line(exc)}")


def is_connection_lost(exc: psycopg.Error) -> bool:
    """Whether `exc` lost the connection (its statement may have been applied, or be
    still in flight): the server went away, was shut down, or the link broke."""
    state = exc.sqlstate or ""
    return isinstance(exc, psycopg.OperationalError) and (
        not state or state.startswith(("08", "57P"))
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
