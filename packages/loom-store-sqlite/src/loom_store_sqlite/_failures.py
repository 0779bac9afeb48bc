"""SQLite's errors in the kernel's tree: a refusal that will last, or a fault that will pass."""

from __future__ import annotations

import sqlite3
from typing import Final

from loom_kernel import (
    InvalidArgumentError,
    LoomError,
    StoreMisconfiguredError,
    StoreUnavailableError,
)

__all__ = ["store_error"]

#: Primary result codes that no retry can change, with what to do about each.
_PERMANENT: Final = {
    3: "SQLite was denied access to the file: check its permissions",  # SQLITE_PERM
    8: "the database is read-only: open a writable file, or fix its permissions",  # READONLY
    11: "the database file is damaged: restore it from a backup",  # SQLITE_CORRUPT
    14: "SQLite cannot open the file: check that its directory exists and is writable",
    23: "SQLite refused the access (an authorizer): check how the database is opened",
    26: "the file is not a SQLite database: point the store at a Loom database",  # NOTADB
}


#: SQLITE_TOOBIG: a string or blob over the connection's length limit.
_TOOBIG: Final = 18


def store_error(what: str, exc: sqlite3.Error) -> LoomError:
    """The kernel error for a sqlite3 failure while doing `what`.

    A refusal that lasts (permissions, a read-only or damaged file, no such
    directory) is StoreMisconfiguredError, with the remedy; a value too big for
    SQLite is InvalidArgumentError; anything else (a lock held too long, an I/O
    error, a full disk) is StoreUnavailableError.
    """
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF == _TOOBIG:
        return InvalidArgumentError(
            f"{what}: {exc}: a record is over SQLite's limit on a string or blob (the "
            "store's max_record_bytes); nothing was written, and no retry can take it"
        )
    remedy = _PERMANENT.get(code & 0xFF) if isinstance(code, int) else None
    if remedy is not None:
        return StoreMisconfiguredError(f"{what}: {exc} ({remedy})")
    return StoreUnavailableError(f"{what}: {exc}")
