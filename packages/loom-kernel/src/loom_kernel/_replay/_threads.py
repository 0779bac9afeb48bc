"""Threads for the async API's calls: one for each call in flight, idle ones reused.

`start_async` and the other async calls run a blocking drive off the caller's loop.
On the loop's default executor (`asyncio.to_thread`) they would share its few threads
(`min(32, CPUs + 4)`) with each other and with the application: a flow that awaits a
run it starts (`start_async` in a step) while every thread held such a flow would
wait forever, and N callers at once would be driven a few at a time. Here a call never
waits for another: it takes an idle thread, or a new one; a thread idle for `linger`
seconds ends.

A call whose caller stops awaiting it (a timeout, a teardown) goes on, as with
`asyncio.to_thread`, and a task of the caller's loop, made with the call, awaits it to
its end: so `asyncio.run`, which cancels the tasks left when its main coroutine returns
and waits for them, returns only once the drive has parked or ended (as it waited for
its default executor's threads), and a store closed after it is not closed under a
drive. A call still running when the interpreter exits otherwise is cut short there,
its thread a daemon's: for a drive, as by a crash. A worker's loop lets go of those tasks
when it closes (`let_go`); its stop then waits for the calls, for a bounded time
(`CallThreads.wait_quiet` with the loop as tag).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import queue
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any, Final, TypeVar

__all__ = ["CallThreads", "call_threads", "in_a_thread", "let_go"]

T = TypeVar("T")
_log = logging.getLogger("loom")

#: Seconds an idle thread waits for another call before it ends.
LINGER: Final = 30.0

_Call = tuple["Future[Any]", Callable[[], Any], object]


class CallThreads:
    """Runs each call on an idle thread of its own, or on a new one; never queues a
    call behind another.

    Args:
        name: the threads' name prefix.
        linger: seconds an idle thread waits for a call before it ends.
    """

    def __init__(self, name: str, linger: float = LINGER) -> None:
        self._name = name
        self._linger = linger
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)
        # Not a SimpleQueue: on CPython 3.11 its get(timeout) can block forever when
        # another getter takes the item it was woken for after its deadline passed
        # (seen here as an idle thread that never ended).
        self._calls: queue.Queue[_Call] = queue.Queue()
        # Threads waiting for a call, less the calls already handed to them (put, or
        # about to be put, in `_calls`): a thread gives up only while this is above 0.
        self._idle = 0
        self._in_flight: Counter[object] = Counter()  # by tag; None counts them all
        self._started = 0
        self._alive = 0

    def run(self, call: Callable[[], Any], tag: object = None) -> Future[Any]:
        """Start `call()` on a thread now; its future (cancelling it before the thread
        takes it means it never runs).

        Args:
            call: what to run.
            tag: what `wait_quiet` may wait for the calls of (the caller's loop).

        Raises:
            RuntimeError: the system refused a new thread.
        """
        future: Future[Any] = Future()
        with self._lock:
            self._in_flight[None] += 1
            if tag is not None:
                self._in_flight[tag] += 1
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
            self._started += spawn
            self._alive += spawn
            number = self._started
        if not spawn:
            self._calls.put((future, call, tag))
            return future
        thread = threading.Thread(
            target=self._serve,
            args=([(future, call, tag)],),
            name=f"{self._name}-{number}",
            daemon=True,
        )
        try:
            thread.start()
        except RuntimeError:  # refused: no thread runs it (an interrupt after the start
            with self._lock:  # lands once the thread runs, which counts it down itself)
                self._alive -= 1
            self._ended_one(tag)
            raise
        return future

    def threads(self) -> int:
        """How many threads there are now, busy or idle."""
        with self._lock:
            return self._alive

    def wait_quiet(self, timeout: float | None = None, tag: object = None) -> bool:
        """Wait until no call (with `tag`, no call of that tag) is in flight; whether
        none is."""
        with self._quiet:
            return self._quiet.wait_for(lambda: self._in_flight[tag] == 0, timeout)

    def _serve(self, first: list[_Call]) -> None:
        call: _Call | None = first.pop()  # not held by the frame once it is done
        while call is not None:
            future, fn, tag = call
            call = None  # held while idle, the call would keep its arguments alive
            self._settle(future, fn)
            del future, fn
            self._ended_one(tag)
            call = self._next()

    def _settle(self, future: Future[Any], call: Callable[[], Any]) -> None:
        """Run `call` unless its future was cancelled first, and settle the future,
        this thread counted idle first (the caller woken may call again at once)."""
        if not future.set_running_or_notify_cancel():
            with self._lock:
                self._idle += 1
            return
        result: Any = None
        error: BaseException | None = None
        try:
            result = call()
        except BaseException as exc:  # as a ThreadPoolExecutor: the awaiting caller's to see
            error = exc
        with self._lock:
            self._idle += 1
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _next(self) -> _Call | None:
        """The next call handed to this thread, or None once it may end."""
        while True:
            try:
                return self._calls.get(timeout=self._linger)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:
                        self._idle -= 1
                        self._alive -= 1
                        return None
                # A call was handed to this thread as it gave up: it is on its way.

    def _ended_one(self, tag: object) -> None:
        with self._lock:
            for key in (None, tag) if tag is not None else (None,):
                self._in_flight[key] -= 1
                if self._in_flight[key] <= 0:
                    del self._in_flight[key]
            self._quiet.notify_all()


_shared: CallThreads | None = None
_shared_lock = threading.Lock()
#: Loops whose tasks awaiting abandoned calls stop awaiting them (see `let_go`).
_let_go: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
#: The tasks awaiting calls to their end (a loop keeps only weak references to its tasks).
_awaiting: set[asyncio.Task[None]] = set()


def call_threads() -> CallThreads:
    """The process's threads for the async API (made at first use)."""
    global _shared  # noqa: PLW0603 - one pool per process, made lazily
    with _shared_lock:
        if _shared is None:
            _shared = CallThreads("loom-async")
        return _shared


def _forget_after_fork() -> None:
    """In a forked child: the parent's threads are not there; start afresh."""
    global _shared  # noqa: PLW0603
    _shared = None
    _awaiting.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def let_go(loop: asyncio.AbstractEventLoop) -> None:
    """Have `loop`'s tasks that await abandoned calls stop at their next cancel (a
    worker's loop, closing: its stop waits for those calls, for a bounded time)."""
    _let_go.add(loop)


async def in_a_thread(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`asyncio.to_thread`, on `call_threads()`: `call(*args, **kwargs)` in a copy of
    this context, on a thread that waits for no other call. Cancelled, it raises at
    once and the call goes on, awaited by a task of the loop (see the module)."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    future = call_threads().run(partial(context.run, call, *args, **kwargs), tag=loop)
    waiting = asyncio.wrap_future(future, loop=loop)
    # Made now, not once the caller gives up: a teardown cancels (and waits for) the
    # tasks it finds as it starts, and may be what cancels the caller.
    gave_up: list[bool] = []
    keeper = loop.create_task(_await_to_the_end(loop, waiting, gave_up))
    _awaiting.add(keeper)
    keeper.add_done_callback(_awaiting.discard)
    # A loop closed before the call ends never runs its keeper again: let it go then.
    future.add_done_callback(lambda _: _awaiting.discard(keeper) if loop.is_closed() else None)
    try:
        result: T = await asyncio.shield(waiting)
    except asyncio.CancelledError:
        gave_up.append(True)
        raise
    return result


async def _await_to_the_end(
    loop: asyncio.AbstractEventLoop, waiting: asyncio.Future[Any], gave_up: list[bool]
) -> None:
    """Await a call to its end, through cancels (unless the loop lets go), and log how
    it failed, if it did once its caller had stopped awaiting it."""
    while not waiting.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([waiting])  # raises none of the call's errors here
        if loop in _let_go:
            break
    if gave_up and waiting.done() and not waiting.cancelled() and waiting.exception() is not None:
        error = waiting.exception()
        _log.warning(
            "loom: a call its caller stopped awaiting failed: %s: %s", type(error).__name__, error
        )
