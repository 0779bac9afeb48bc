"""How a record's row is kept small: its kind as a number (`Kinds`), its payload
deflated against a preset dictionary of the kernel's own JSON (`pack`, `unpack`).

A small record's row was mostly repeated text: the kind's name, and the payload's
envelope and field names (`{"v":"1.21.0","d":{"index":..,"name":..,"result":..`).
A row keeps the kind's number instead, negated when its payload is packed, so a
packed payload needs no marker of its own: payloads are opaque bytes, and no byte
of theirs could tell the two apart.
"""

from __future__ import annotations

import sqlite3
import threading
import zlib
from typing import Final

__all__ = ["PACK_AT_MOST", "Kinds", "pack", "unpack"]

#: The dictionary a packed payload was deflated against. It is part of the file
#: format: rows packed with it are read with it, so it never changes (a new one would
#: need a new marker). Deflate finds a match anywhere in it, and codes near ones
#: (the end) in fewer bits: the commonest text comes last.
_DICTIONARY: Final = (
    b'{"id":"","status":"failed","flow":"","by":""}{"id":"","status":"cancelled"'
    b'{"v":"1.21.0","d":{"error":{"type":"","message":""}}}'
    b'{"v":"1.21.0","d":{"gate":"","on":null,"wake_at":null}}'
    b'{"v":"1.21.0","d":{"payload":null,"key":null,"by":null}}'
    b'{"v":"1.21.0","d":{"flow":"","code_hash":"sha256:","input":null,"key":null,'
    b'"parent":null,"by":"","queue":null,"retry_of":null,"trace":null}}'
    b'{"id":"","status":"completed","flow":""}'
    b'{"v":"1.21.0","d":{"result":null}}'
    b'{"v":"1.21.0","d":{"index":0,"name":"","result":null,"attempts":1}}'
)
#: Raw deflate (no header or checksum: the row's own integrity is SQLite's) with a
#: 1 KiB window: the dictionary (519 bytes) and the payload's first 505 bytes; a
#: payload's later bytes match only the 1 KiB before them. (A wider window packs a
#: longer payload smaller, and a reader of this one reads it, the dictionary being in
#: its window; the rows this writes are kept as they have been.)
_WINDOW_BITS: Final = -10
#: Payloads longer than this are kept as they are: their row's overhead is already
#: small beside them, and deflating them costs more time than it saves room.
PACK_AT_MOST: Final = 1024
#: Shorter payloads are kept as they are: deflate cannot make them smaller.
_PACK_AT_LEAST: Final = 24


def pack(payload: bytes) -> bytes | None:
    """`payload` deflated against the dictionary, or None where that is not smaller."""
    if not _PACK_AT_LEAST <= len(payload) <= PACK_AT_MOST:
        return None
    packer = zlib.compressobj(
        6, zlib.DEFLATED, _WINDOW_BITS, 2, zlib.Z_DEFAULT_STRATEGY, _DICTIONARY
    )
    packed = packer.compress(payload) + packer.flush()
    return packed if len(packed) < len(payload) else None


def unpack(packed: bytes) -> bytes:
    """The payload `pack` deflated.

    Raises:
        zlib.error: the bytes are not a payload `pack` made (a damaged row).
    """
    unpacker = zlib.decompressobj(_WINDOW_BITS, _DICTIONARY)
    payload = unpacker.decompress(packed) + unpacker.flush()
    if not unpacker.eof:
        raise zlib.error("a packed payload ends early")
    return payload


class Kinds:
    """Record kinds and their numbers in `loom_kinds`, as far as this store has seen
    them. A kind's number never changes and is never reused, so what is known here
    stays true; a number written by another process is looked up when first met."""

    def __init__(self) -> None:
        self._numbers: dict[str, int] = {}
        self._names: dict[int, str] = {}
        #: The names by number known so far (read-only: `learn` adds to it).
        self.names: Final = self._names
        self._lock = threading.Lock()

    def number(self, kind: str) -> int | None:
        """The number of a kind known to be in the database, else None."""
        return self._numbers.get(kind)

    def name(self, connection: sqlite3.Connection, number: int) -> str:
        """The kind numbered `number`, read from the database if not known yet.

        Raises:
            sqlite3.DatabaseError: no kind has that number (a damaged row).
        """
        name = self._names.get(number)
        if name is None:
            self.learn(connection)
            name = self._names.get(number)
            if name is None:
                raise sqlite3.DatabaseError(
                    f"a record names kind number {number}, which no kind has"
                )
        return name

    def learn(self, connection: sqlite3.Connection) -> None:
        """Read every kind the database numbers (on a connection whose transaction has
        committed them, or in one that just did)."""
        rows = connection.execute("SELECT id, name FROM loom_kinds").fetchall()
        with self._lock:
            for number, name in rows:
                self._numbers[name] = number
                self._names[number] = name

    def add(self, connection: sqlite3.Connection, kinds: set[str]) -> None:
        """Number `kinds` in the database, in the caller's write transaction. What is
        learnt is kept only by `learn` after the commit: a rolled-back number must
        never be used."""
        connection.executemany(
            "INSERT OR IGNORE INTO loom_kinds (name) VALUES (?)", [(kind,) for kind in kinds]
        )
