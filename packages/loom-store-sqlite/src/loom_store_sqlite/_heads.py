"""Stream heads a store has seen: one connection's, trusted while no other connection
writes, and the store's own, trusted while nobody else commits."""

from __future__ import annotations

from typing import Final

#: Asks SQLite whether another connection (in any process) has committed since the
#: last time this connection asked: the value changes exactly then.
DATA_VERSION: Final = "PRAGMA data_version"

#: The most heads one connection keeps (`KnownHeads`).
LIMIT: Final = 4096
#: The most heads a store shares between its threads (a worker drives runs by the
#: thousand, each with its own stream; the run index's partitions are a few more).
_SHARED_LIMIT: Final = 16384


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
        if len(self._heads) >= LIMIT:
            self._heads.clear()
        self._heads[stream] = head

    def forget(self, stream: str) -> None:
        """After a write to `stream` whose outcome this connection does not know."""
        self._heads.pop(stream, None)

    def size(self) -> int:
        """How many heads it holds now (never more than `LIMIT`)."""
        return len(self._heads)


class StampedHeads:
    """The heads of streams this store's commits wrote, shared by all its threads, valid
    while the database's WAL-index header (`WalIndex.stamp`) is the one they were
    stamped with: any commit by anyone changes the header, and so does every other
    change to the database this store makes (a trim, a delete).

    A commit is recorded only when witnessed: its connection's `PRAGMA data_version`
    read just before it and just after it (which changes exactly when another
    connection commits) did not change, so the one commit between the headers read
    in between was this store's. The header alone cannot tell: its transaction counter
    starts again from zero when SQLite recovers the index after a writer died in the
    middle of rewriting it.

    A group's leader records its commit once it has landed, one group at a time, the
    heads before the stamp; any thread looks up, with a header it read first. A head
    recorded after that header was read is a commit's that landed since, so it is
    still the head as it is looked up; one recorded before is trusted only while that
    header is the stamp.
    """

    __slots__ = ("_heads", "_stamp")

    def __init__(self) -> None:
        self._stamp: bytes | None = None
        self._heads: dict[str, int] = {}

    def lookup(self, stream: str, now: bytes | None) -> int | None:
        """The head of `stream`, if known and the header `now` is still the stamp."""
        stamp = self._stamp
        head = self._heads.get(stream)
        if head is None or stamp is None or now != stamp:
            return None
        return head

    def committed(self, before: bytes | None, after: bytes | None, heads: dict[str, int]) -> None:
        """Record a witnessed commit of this store (see the class): the headers read just
        before and just after it, between the two witness reads, and the heads it
        wrote. What was known before stays known if the header before is the stamp."""
        if before is None or after is None:  # read while a commit rewrote it
            self.clear()
            return
        if before != self._stamp or len(self._heads) + len(heads) > _SHARED_LIMIT:
            self.clear()
        self._heads.update(heads)
        self._stamp = after

    def forget(self, stream: str) -> None:
        """After a write to `stream` whose outcome is not known."""
        self._heads.pop(stream, None)

    def clear(self) -> None:
        """Forget everything: the database changed in a way not recorded here."""
        self._stamp = None
        self._heads.clear()
