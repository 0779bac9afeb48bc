"""Group commit: appends from concurrent threads share one transaction and one sync.

A thread that appends while no commit is under way leads: it commits its own append
at once, in a transaction of its own, as if there were no group at all. Threads that
append while a commit is under way queue; when the leader is done it hands the lead
to the first of them, which commits everything queued meanwhile in one transaction
(at most `max_batch` appends), so N threads waiting on one disk sync pay for one.

Each append in a group keeps its own exact expected-head check (against the head the
appends before it in the group left), its own ConflictError or StreamDeletedError,
and its own error when the commit fails, which its caller resolves as it would alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from threading import Event
from typing import Any

import attrs
from loom_kernel.spi import StoreUnavailableError

__all__ = ["GroupCommit", "PendingAppend"]


@attrs.define(eq=False)
class PendingAppend:
    """One append waiting for (or being part of) a group's commit.

    Attributes:
        stream: the stream appended to.
        expected: the head the caller expects.
        rows: the records' rows.
        error: set when this append did not land (or may not have).
    """

    stream: str
    expected: int
    rows: list[Any]
    error: BaseException | None = None
    # Made only for an append that queues behind a commit (the common, lone append
    # never waits, and an Event costs a Condition and two locks).
    _done: Event | None = attrs.field(default=None, init=False)
    _lead: bool = attrs.field(default=False, init=False)


class GroupCommit:
    """Commits appends in groups (see the module's docstring).

    Args:
        commit: commits a group of appends in one transaction on the calling thread's
            connection, setting `error` on each append that did not land; it raises
            only for an interrupt (after setting `error` on every append).
        max_batch: the most appends one transaction holds.
    """

    def __init__(self, commit: Callable[[list[PendingAppend]], None], max_batch: int = 64) -> None:
        self._commit = commit
        self._max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[PendingAppend] = []
        self._leading = False

    def submit(self, append: PendingAppend) -> None:
        """Commit `append`, alone or with others; raise its own error, if any."""
        with self._lock:
            follow = self._leading
            if follow:
                append._done = done = Event()
                self._queue.append(append)
            else:
                self._leading = True
        if follow:
            try:
                done.wait()
            except BaseException:  # an interrupt while queued: leave no one waiting on it
                self._abandon(append)
                raise
            if not append._lead:
                _raise(append)
                return
        self._lead(append)
        if append.error is not None:
            raise append.error

    def _lead(self, append: PendingAppend) -> None:
        """Commit `append` with what is queued, then pass the lead on, whatever happens."""
        taken: list[PendingAppend] = []
        completed = False
        try:
            # Read first without the lock (the lone append's path): an append queued
            # after this look waits for the hand-over below, as one queued after the
            # taking would.
            if self._queue:
                with self._lock:
                    taken = self._queue[: self._max_batch - 1]
                    del self._queue[: len(taken)]
            self._commit([append, *taken] if taken else [append])
            completed = True
        finally:
            # One turn of the lock for the lone append (the common case): the cleanup
            # and the hand-over together.
            with self._lock:
                for other in taken:
                    if other in self._queue:  # interrupted while taking it: not committed
                        self._queue.remove(other)
                successor = self._next_leader()
            for other in taken:
                if not completed and other.error is None:
                    # Landed or not: the caller's confirmation (its commit id) tells.
                    other.error = StoreUnavailableError("the group's commit was interrupted")
                _wake(other)
            if successor is not None:
                _wake(successor)

    def _next_leader(self) -> PendingAppend | None:
        """Under the lock: the first append queued, made leader, or None (the leading
        ends). The caller wakes it once the lock is let go."""
        if not self._queue:
            self._leading = False
            return None
        successor = self._queue.pop(0)
        successor._lead = True
        return successor

    def _pass_lead(self) -> None:
        """Hand the lead to the first append queued, or end the leading."""
        with self._lock:
            successor = self._next_leader()
        if successor is not None:
            _wake(successor)

    def _abandon(self, append: PendingAppend) -> None:
        """An append whose caller was interrupted while it waited: take it out of the
        queue if no group took it yet (it never happens); pass the lead on if it had
        just been handed the lead; if a group took it, that group decides it."""
        with self._lock:
            if append in self._queue:
                self._queue.remove(append)
                return
            handed_the_lead = append._lead
        if handed_the_lead:
            self._pass_lead()


def _wake(append: PendingAppend) -> None:
    assert append._done is not None  # it queued, so it waits
    append._done.set()


def _raise(append: PendingAppend) -> None:
    if append.error is not None:
        raise append.error
