"""Stream heads one connection has seen, trusted while no other connection writes."""

from __future__ import annotations

from typing import Final

#: Asks SQLite whether another connection (in any process) has committed since the
#: last time this connection asked: the value changes exactly then.
DATA_VERSION: Final = "PRAGMA data_version"

_LIMIT: Final = 4096


class KnownHeads:
    """The heads of streams as one connection last read or wrote them.

    They are valid at one `PRAGMA data_version` of that connection: the value only
    changes when some other connection commits, so while it stays the same the
    database is what it was plus this connection's own commits, which `learn` records
    as they land. Any other value drops everything known.
    """

    __slots__ = ("_heads", "_version")

    def __init__(self) -> None:
        self._version: int | None = None
        self._heads: dict[str, int] = {}

    def lookup(self, version: int, stream: str) -> int | None:
        """The known head of `stream` at `version` (just read), or None."""
        if version != self._version:
            self._version = version
            self._heads.clear()
            return None
        return self._heads.get(stream)

    def learn(self, stream: str, head: int) -> None:
        """Record a head read after `lookup`, or written by this connection's commit."""
        if self._version is None:
            return  # nothing anchors it yet
        if len(self._heads) >= _LIMIT:
            self._heads.clear()
        self._heads[stream] = head

    def forget(self, stream: str) -> None:
        """After a write to `stream` whose outcome this connection does not know."""
        self._heads.pop(stream, None)
