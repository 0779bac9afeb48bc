"""A store that dies at its n-th call, as a process killed there would leave it: the
crash tests of chains and of retention run it at every call of what they test."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from loom_kernel.spi import JournalStore, NewRecord, Record


class Crash(BaseException):
    """The victim's process dies here."""


class DyingStore(JournalStore):
    """`inner` until call `at`, which dies before it reaches the store or after it
    landed (`after`); every call after a death dies too."""

    def __init__(
        self, inner: JournalStore, at: int, *, after: bool, as_it_dies: Callable[[], None]
    ) -> None:
        self.inner, self.at, self.after, self.as_it_dies = inner, at, after, as_it_dies
        self.head_is_cheap = inner.head_is_cheap  # type: ignore[misc]
        self.max_record_bytes = inner.max_record_bytes
        self.calls = 0
        self.dead = False
        self._lock = threading.Lock()

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            if self.dead:
                raise Crash
            self.calls += 1
            dies = self.calls == self.at
        if dies and not self.after:
            self._die()
        result = method(*args)
        if dies:
            self._die()
        return result

    def _die(self) -> None:
        with self._lock:
            self.dead = True
        self.as_it_dies()
        raise Crash

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        return int(self._call(self.inner.append, stream, expected, list(records)))

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        found: list[Record] = self._call(self.inner.read, stream, after, limit)
        return found

    def _head(self, stream: str) -> int:
        return int(self._call(self.inner.head, stream))

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        found: list[str] = self._call(self.inner.streams, prefix, after, limit)
        return found

    def _trim(self, stream: str, before: int) -> None:
        self._call(self.inner.trim, stream, before)

    def _delete(self, stream: str) -> None:
        self._call(self.inner.delete, stream)
