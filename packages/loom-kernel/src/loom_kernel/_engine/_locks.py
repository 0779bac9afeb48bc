"""Per-execution locks: one lock per id, never shared between ids, reentrant per caller.

An engine serialises the drives of one execution (a start, a resume, a timer, a
recover) with one of these. Two facts shape them:

- Locks are keyed by the execution id itself, created on demand and dropped when no
  one holds or waits for them, so two unrelated runs never share a lock and no lock
  order can come from hashing. The only nesting is a drive that starts a child
  inline, which takes the child's lock while it holds the parent's: parent before
  child, a tree, so it cannot cycle.
- Reentrancy follows the caller's context (`contextvars`), not its thread. An async
  flow called from inside a running event loop runs on a helper thread with a copy
  of its caller's context, so a step there that drives its own run again finds the
  lock already held instead of waiting for a thread that waits for it.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator

import attrs

__all__ = ["KeyedLocks", "LockBusyError"]

_log = logging.getLogger("loom")


@attrs.define
class _Entry:
    lock: threading.Lock = attrs.Factory(threading.Lock)
    users: int = 0
    after: list[Callable[[], None]] = attrs.Factory(list)  # run by the next release


class LockBusyError(Exception):
    """Internal: a lock was not free within the wait asked for."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _Waiting(threading.local):
    """This thread's callbacks left to run once it holds no lock (see `_run_after`)."""

    def __init__(self) -> None:
        self.callbacks: collections.deque[tuple[Callable[[], None], str]] = collections.deque()
        self.draining = False


_waiting = _Waiting()


def _run_after(callbacks: list[Callable[[], None]], key: str, *, holds_none: bool) -> None:
    """Run what waited for the release of `key`, in this (the releasing) thread, once it
    holds no lock of its own: a callback that drives a run must not find this thread
    holding another (a parent's, say), nor nest inside another callback's release
    (each would add stack frames). So they queue while the thread holds a lock or is
    already running them, and the first release that leaves it holding none runs
    them, one after another, until none is left."""
    _waiting.callbacks.extend((callback, key) for callback in callbacks)
    if not holds_none or _waiting.draining or not _waiting.callbacks:
        return
    _waiting.draining = True
    try:
        while _waiting.callbacks:
            callback, waited_for = _waiting.callbacks.popleft()
            try:
                callback()
            except Exception:  # the holder's own work is done: it must not fail for this
                _log.exception("loom: what waited for the release of %s failed", waited_for)
    finally:
        _waiting.draining = False


class KeyedLocks:
    """A lock per key, held through `hold(key)`."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._mutex = threading.Lock()
        self._held: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
            f"loom_locks_{id(self)}", default=frozenset()
        )

    def holding_any(self) -> bool:
        """Whether this context holds a lock (it is inside a drive, say)."""
        return bool(self._held.get())

    @contextlib.contextmanager
    def hold(self, key: str, *, wait: float | None = None) -> Iterator[None]:
        """Hold `key`'s lock for the block; a no-op when this context holds it already.

        Args:
            key: whose lock.
            wait: the most seconds to wait for it (None: as long as it takes).

        Raises:
            LockBusyError: `wait` passed with the lock held elsewhere.
        """
        held = self._held.get()
        if key in held:
            yield
            return
        with self._mutex:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry()
            entry.users += 1
        acquired = False
        try:
            if not entry.lock.acquire(timeout=-1 if wait is None else wait):
                raise LockBusyError(key)
            acquired = True
            try:
                token = self._held.set(held | {key})
                try:
                    yield
                finally:
                    self._held.reset(token)
            finally:
                entry.lock.release()
        finally:
            with self._mutex:
                entry.users -= 1
                after: list[Callable[[], None]] = []
                if acquired:
                    after, entry.after = entry.after, []
                if entry.users == 0:
                    del self._entries[key]
            _run_after(after, key, holds_none=not held)

    def after_release(self, key: str, callback: Callable[[], None]) -> bool:
        """Have `callback` run once the lock of `key`, held elsewhere now, is released
        (by the thread that releases it, outside the lock, once that thread holds no
        lock: see `_run_after`).

        Returns:
            False when nobody holds the lock now: the caller acts itself.
        """
        with self._mutex:
            entry = self._entries.get(key)
            if entry is None or not entry.lock.locked():
                return False
            entry.after.append(callback)
            return True

    def __len__(self) -> int:
        """How many keys are held or waited for (tests use it to prove none leak)."""
        with self._mutex:
            return len(self._entries)
