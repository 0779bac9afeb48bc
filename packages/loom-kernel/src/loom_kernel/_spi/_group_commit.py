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
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Final

import attrs

from loom_kernel._core import StoreUnavailableError

if TYPE_CHECKING:
    from loom_kernel._core import NewRecord

__all__ = ["LOOK_AGAIN", "GroupCommit", "PendingAppend", "SyncedOrNot", "Wake"]

#: Seconds a queued append waits before it looks whether its turn came with its wake
#: lost (an interrupt in the thread that was to wake it).
LOOK_AGAIN: Final = 0.5


@attrs.define(eq=False)
class PendingAppend:
    """One append waiting for (or being part of) a group's commit.

    Attributes:
        stream: the stream appended to.
        expected: the head the caller expects.
        rows: the records' rows.
        error: set when this append did not land (or may not have).
        sync: False for an append whose sync may wait for the next synced one
            (`JournalStore.append(..., sync=False)`): a group of such appends alone
            may commit without a sync of its own.
    """

    stream: str
    expected: int
    rows: list[Any]
    error: BaseException | None = None
    sync: bool = attrs.field(default=True, kw_only=True)
    # Made only for an append that queues behind a commit (the common, lone append
    # never waits).
    _done: Wake | None = attrs.field(default=None, init=False)
    _lead: bool = attrs.field(default=False, init=False)  # it holds the lead
    _decided: bool = attrs.field(default=False, init=False)  # a group's verdict is in
    _taken: Sequence[PendingAppend] = attrs.field(default=(), init=False)  # its group's others


class SyncedOrNot:
    """For a store (a base before `JournalStore`) whose one append path takes the
    `sync` flag its `PendingAppend` carries: `_append` and `_append_unsynced` are its
    `_append_as` with `sync` True and False."""

    def _append_as(
        self, stream: str, expected: int, records: tuple[NewRecord, ...], *, sync: bool
    ) -> int:
        raise NotImplementedError

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        return self._append_as(stream, expected, records, sync=True)

    def _append_unsynced(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        return self._append_as(stream, expected, records, sync=False)


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

    @property
    def queued(self) -> int:
        """How many appends wait in the queue now (for tests and tools)."""
        return len(self._queue)

    @property
    def leading(self) -> bool:
        """Whether an append holds the lead now (for tests and tools)."""
        return self._leading

    def submit(self, append: PendingAppend) -> None:
        """Commit `append`, alone or with others; raise its own error, if any.

        An interrupt (KeyboardInterrupt, a signal handler raising) anywhere in here
        leaves no other append waiting for good: the lead this append holds, or was
        just handed, goes on (`_let_go`), and a queued append whose wake was lost finds
        its turn, or its group's verdict, by looking every `LOOK_AGAIN` seconds.
        """
        try:
            with self._lock:
                follow = self._leading
                if follow:
                    append._done = Wake()
                    self._queue.append(append)
                else:
                    append._lead = True  # first: an interrupt between them leads nobody
                    self._leading = True
            if follow:
                self._wait_for_turn(append)
            if append._lead:
                self._lead(append)
        except BaseException:
            self._let_go(append)
            raise
        if append.error is not None:
            raise append.error

    def _wait_for_turn(self, append: PendingAppend) -> None:
        """Wait until a group decided `append` or it was handed the lead."""
        done = append._done
        assert done is not None
        while not done.wait(LOOK_AGAIN):
            with self._lock:
                if append._lead or append._decided:  # its wake was lost to an interrupt
                    return

    def _lead(self, append: PendingAppend) -> None:
        """Commit `append` with what is queued, then pass the lead on, whatever happens."""
        completed = False
        try:
            # Read first without the lock (the lone append's path): an append queued
            # after this look waits for the hand-over below, as one queued after the
            # taking would.
            if self._queue:
                with self._lock:
                    append._taken = self._queue[: self._max_batch - 1]
                    del self._queue[: len(append._taken)]
            taken = append._taken
            self._commit([append, *taken] if taken else [append])
            completed = True
        finally:
            # One turn of the lock for the lone append (the common case): the verdicts
            # and the hand-over together, the wakes after.
            with self._lock:
                woken = self._close_group(append, completed=completed)
            for other in woken:
                _wake(other)

    def _close_group(self, append: PendingAppend, *, completed: bool) -> list[PendingAppend]:
        """Under the lock, once only: the verdicts on the appends `append`'s group took,
        and, if `append` holds the lead, the lead handed to the first append queued
        (or the leading ended); the appends to wake once the lock is let go.

        An interrupt between its lines leaves at worst a second leader, and two groups
        committing one after the other are still right (each append is taken, under
        the lock, by one group only)."""
        woken: list[PendingAppend] = []
        for other in append._taken:
            if other in self._queue:  # interrupted while taking it: not committed
                self._queue.remove(other)
            if not other._decided:
                if not completed and other.error is None:
                    # Landed or not: the caller's confirmation (its commit id) tells.
                    other.error = StoreUnavailableError("the group's commit was interrupted")
                other._decided = True
                woken.append(other)
        append._taken = ()
        if append._lead:
            if self._queue:
                successor = self._queue.pop(0)
                successor._lead = True
                woken.append(successor)
            else:
                self._leading = False
            append._lead = False
        return woken

    def _let_go(self, append: PendingAppend) -> None:
        """An append whose caller was interrupted: take it out of the queue if no group
        took it yet; if it leads, close its group (its verdicts, told to retry unless
        given) and pass the lead on; if another's group took it, that group decides."""
        with self._lock:
            if append in self._queue:
                self._queue.remove(append)
                return
            woken = self._close_group(append, completed=False)
        for other in woken:
            _wake(other)


def _wake(append: PendingAppend) -> None:
    assert append._done is not None  # it queued, so it waits
    append._done.set()


class Wake:
    """A one-shot wake-up: `threading.Event`'s `wait` and `set` on one lock held until
    set. An Event is a Condition, a lock and a waiter lock, driven by Python code on
    each wait and set; under many threads every Python line on the path of a commit
    waits for the GIL."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def wait(self, timeout: float) -> bool:
        """Whether it was set, waiting up to `timeout` seconds."""
        return self._lock.acquire(timeout=timeout)

    def set(self) -> None:
        """Wake the waiter (once; again is nothing)."""
        with suppress(RuntimeError):  # set before, and not waited for since
            self._lock.release()
