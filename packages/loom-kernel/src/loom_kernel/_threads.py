"""Threads for the async API's calls: one for each call in flight, idle ones reused.

`start_async` and the other async calls run a blocking drive off the caller's loop.
On the loop's default executor (`asyncio.to_thread`) they would share its few threads
(`min(32, CPUs + 4)`) with each other and with the application: a flow that awaits a
run it starts (`start_async` in a step) while every thread held such a flow would
wait forever, and N callers at once would be driven a few at a time. Here a call never
waits for another: it takes an idle thread, or a new one; a thread idle for `linger`
seconds ends. As with `asyncio.to_thread` under `asyncio.run`, the interpreter waits
at exit for the calls still in flight (a drive whose awaiting task was cancelled goes
on to its park or end).
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any, Final, TypeVar

__all__ = ["CallThreads", "call_threads", "in_a_thread"]

T = TypeVar("T")

#: Seconds an idle thread waits for another call before it ends.
LINGER: Final = 5.0

_Call = tuple["Future[Any]", Callable[[], Any]]


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
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        # Threads waiting for a call, less the calls already handed to them (put, or
        # about to be put, in `_calls`): a thread gives up only while this is above 0.
        self._idle = 0
        self._in_flight = 0
        self._started = 0
        self._alive = 0

    def run(self, call: Callable[[], Any]) -> Future[Any]:
        """Start `call()` on a thread now; its future (cancelling it before the thread
        takes it means it never runs).

        Raises:
            RuntimeError: the system refused a new thread.
        """
        future: Future[Any] = Future()
        with self._lock:
            self._in_flight += 1
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
            self._started += spawn
            self._alive += spawn
            number = self._started
        if not spawn:
            self._calls.put((future, call))
            return future
        thread = threading.Thread(
            target=self._serve, args=((future, call),), name=f"{self._name}-{number}", daemon=True
        )
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._alive -= 1
            self._ended_one()
            raise
        return future

    def threads(self) -> int:
        """How many threads there are now, busy or idle."""
        with self._lock:
            return self._alive

    def wait_quiet(self, timeout: float | None = None) -> bool:
        """Wait until no call is in flight; whether none is."""
        with self._quiet:
            return self._quiet.wait_for(lambda: self._in_flight == 0, timeout)

    def _serve(self, first: _Call) -> None:
        call: _Call | None = first
        while call is not None:
            _settle(*call)
            call = None  # held while idle, the call would keep its arguments alive
            with self._lock:
                self._idle += 1
            self._ended_one()
            call = self._next()

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

    def _ended_one(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._quiet.notify_all()


def _settle(future: Future[Any], call: Callable[[], Any]) -> None:
    """Run `call` unless its future was cancelled first, and settle the future."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = call()
    except BaseException as exc:  # as a ThreadPoolExecutor: the awaiting caller's to see
        future.set_exception(exc)
    else:
        future.set_result(result)


_shared: CallThreads | None = None
_shared_lock = threading.Lock()


def call_threads() -> CallThreads:
    """The process's threads for the async API (made at first use; the interpreter
    waits at exit for the calls they still run)."""
    global _shared  # noqa: PLW0603 - one pool per process, made lazily
    with _shared_lock:
        if _shared is None:
            _shared = CallThreads("loom-async")
            atexit.register(_shared.wait_quiet)
        return _shared


async def in_a_thread(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`asyncio.to_thread`, on `call_threads()`: `call(*args, **kwargs)` in a copy of
    this context, on a thread that waits for no other call."""
    context = contextvars.copy_context()
    future = call_threads().run(partial(context.run, call, *args, **kwargs))
    result: T = await asyncio.wrap_future(future)
    return result
