"""Who makes the blocking calls of an async flow whose code runs on an event loop.

A drive made on a thread for another thread's loop (the async API's) waits while its
flow's code runs there. Instead of idling, its thread makes the flow's blocking calls:
the journal writes and reads of each ctx call, and sync step functions (`serve`). A
worker's drive holds no thread while its flow's code runs: its calls are made on the
worker's pool, one after another (`Servant(loop, executor)`). Either way the loop
never waits on a disk sync, so the writes of many runs sharing one loop reach the
store side by side (and share the SQLite store's group commits) instead of one after
another.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

from loom_kernel._replay._threads import call_threads, let_go

__all__ = [
    "FLOW_LOOP",
    "LOOP_CHECK",
    "LoopStoppedError",
    "LoopThread",
    "Outcome",
    "Servant",
    "unwrap",
]

T = TypeVar("T")
_log = logging.getLogger("loom")
#: Seconds between looks at whether the loop running the flow still runs.
LOOP_CHECK = 0.5

#: Set around a drive made on a thread for an event loop: the async API caller's loop,
#: or a worker's, where an async flow's code runs (its blocking calls are made by the
#: drive's thread, see `Servant`).
FLOW_LOOP: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "loom_flow_loop", default=None
)

#: How a call made on the drive's thread ended: (its value, None) or (None, the error).
Outcome = tuple[Any, BaseException | None]
_Call = tuple[
    contextvars.Context | None, Callable[..., Any], tuple[Any, ...], "asyncio.Future[Outcome]"
]


class LoopStoppedError(Exception):
    """Internal: the event loop running the flow stopped or closed during its drive."""


class _Held:
    """A cancel a call held back: the task's cancel count before it, its message."""

    __slots__ = ("awaits_left", "before", "message", "scheduled")

    def __init__(self, before: int, message: Any) -> None:
        self.before = before
        self.message = message
        self.awaits_left = 2
        self.scheduled = False


def _refused() -> Outcome:
    """What a call handed over once its drive is over gets."""
    return (None, LoopStoppedError("the drive of this flow is over"))


def unwrap(outcome: Outcome) -> Any:
    """The value of a call made on the drive's thread, or its error raised here (in
    the caller's own frame, so a StopIteration stays what it was)."""
    value, error = outcome
    if error is not None:
        raise error
    return value


class Servant:
    """Calls the flow's code (on `loop`) hands over, and their service: by the drive's
    thread until the flow's coroutine is done (`serve`), or, given an `executor`, on
    it, one call after another, as they come, until `close`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, executor: Executor | None = None) -> None:
        self._loop = loop
        self._executor = executor
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._fatal: BaseException | None = None
        self._thread: int | None = None  # the thread making the calls, while it does
        self._closed = False  # the drive is over: calls handed over now are refused
        self._held: dict[asyncio.Task[Any], _Held] = {}  # cancels held back, by task
        self._in_call: set[asyncio.Task[Any]] = set()  # tasks awaiting a call
        self._draining = False  # with an executor: a turn of `_drain` is on it or due
        self._turns = threading.Lock()

    @property
    def fatal(self) -> BaseException | None:
        """A KeyboardInterrupt or SystemExit a call raised (its caller got a cancel):
        the drive raises it once the flow's code has unwound."""
        return self._fatal

    def serving_here(self) -> bool:
        """Whether this is the thread making the calls, making one of them."""
        return self._thread == threading.get_ident()

    async def call(
        self, fn: Callable[..., Any], *args: Any, context: contextvars.Context | None = None
    ) -> Outcome:
        """On the loop: have the drive's thread run `fn(*args)` (in `context` when one
        is given, else in the drive's own), and await how it ended.

        The call cannot be cancelled, as it could not be when it held the loop: a
        cancel that reaches the awaiting task meanwhile (`asyncio.timeout`) waits for
        the call, and lands where the held loop would have let it (see `_deliver`), if
        whoever asked for it still does then (a timeout whose block the code has left
        by then no longer does).
        """
        if self._closed:
            return _refused()
        future: asyncio.Future[Outcome] = self._loop.create_future()
        self._calls.put((context, fn, args, future))
        if self._executor is not None:
            self._take_turn()
        if self._closed and not future.done():  # the drive ended as it was handed over
            future.set_result(_refused())
        task = asyncio.current_task()
        held = None if task is None else self._held.get(task)
        before = held.before if held is not None else 0 if task is None else task.cancelling()
        if task is not None:
            self._in_call.add(task)
        try:
            while True:
                try:
                    outcome = await asyncio.shield(future)
                    break
                except asyncio.CancelledError as cancel:
                    if future.cancelled():  # the loop itself is going away
                        raise
                    if held is None and task is not None:
                        message = cancel.args[0] if cancel.args else None
                        held = self._held[task] = _Held(before, message)
        finally:
            if task is not None:
                self._in_call.discard(task)
        if held is not None and task is not None:
            self._look_later(task, held)
        return outcome

    def _look_later(self, task: asyncio.Task[Any], held: _Held) -> None:
        if not held.scheduled:
            held.scheduled = True
            self._loop.call_soon(self._deliver, task)

    def _deliver(self, task: asyncio.Task[Any]) -> None:
        """A cancel a call held back lands where the loop, had the calls held it,
        would have delivered it: at the task's second await that is not a call (a
        timer due while the loop was held runs after the task's next wake-up), unless
        it was withdrawn by then (`uncancel`, as a timeout's block does when left)."""
        held = self._held.get(task)
        if held is None:
            return
        held.scheduled = False
        if task.done():
            del self._held[task]
            return
        if task in self._in_call:
            return  # that call's end looks again
        held.awaits_left -= 1
        if held.awaits_left > 0:
            self._look_later(task, held)
            return
        del self._held[task]
        if task.cancelling() > held.before:
            task.uncancel()
            task.cancel(held.message)

    def serve(self, done: concurrent.futures.Future[Any]) -> Any:
        """On the drive's thread: run the calls handed over until `done` (the flow's
        coroutine, on the loop) is, and return its result or raise its error. Calls
        handed over once it returns (or raises) are refused with `LoopStoppedError`.

        Raises:
            LoopStoppedError: the loop stopped or closed first (the coroutine is cancelled).
            KeyboardInterrupt, SystemExit: a call raised it (re-raised here, the drive's
                thread, instead of on the loop, which it would stop for every run).
        """
        self._thread = threading.get_ident()
        done.add_done_callback(lambda _: self._calls.put(None))
        idle_looks = 0  # looks in a row that found the loop not running
        try:
            while True:
                try:
                    call = self._calls.get(timeout=LOOP_CHECK)
                except queue.Empty:
                    # Twice in a row: a worker's loop restarting after a SystemExit
                    # is not running for a moment, and its flows go on.
                    running = not self._loop.is_closed() and self._loop.is_running()
                    idle_looks = 0 if running else idle_looks + 1
                    if self._loop.is_closed() or idle_looks >= 2:
                        done.cancel()
                        raise LoopStoppedError(
                            "the event loop running the flow stopped during its drive"
                        ) from None
                    continue
                if call is None:
                    break
                self._run(*call)
        finally:
            self._close()
        if self._fatal is not None:
            raise self._fatal
        if done.cancelled():
            raise LoopStoppedError("the flow's task was cancelled: its event loop is closing")
        return done.result()

    def _take_turn(self) -> None:
        """With an executor: have it make the calls queued, unless a turn is due."""
        assert self._executor is not None
        with self._turns:
            if self._draining:
                return
            self._draining = True
        try:
            self._executor.submit(self._drain)
        except RuntimeError:  # shut down: nothing will make the calls
            with self._turns:
                self._draining = False
            self._close()

    def _drain(self) -> None:
        """A turn on the executor: make the calls queued, one after another, until
        none is left."""
        self._thread = threading.get_ident()
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                with self._turns:
                    if self._calls.empty():  # else one came as this turn was ending
                        self._thread = None
                        self._draining = False
                        return
                continue
            if call is not None:
                self._run(*call)

    def close(self) -> None:
        """With an executor, once the flow's coroutine is done: refuse every call
        handed over from now on (a task it left running), and those still queued."""
        self._close()

    def _close(self) -> None:
        """Refuse every call handed over from now on, and those still queued."""
        self._closed = True
        while True:
            try:
                left = self._calls.get_nowait()
            except queue.Empty:
                return
            if left is not None:
                with contextlib.suppress(RuntimeError):  # a closed loop runs nothing more
                    self._loop.call_soon_threadsafe(_settle, left[3], _refused())

    def _run(
        self,
        context: contextvars.Context | None,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        future: asyncio.Future[Outcome],
    ) -> None:
        try:
            value = fn(*args) if context is None else context.run(fn, *args)
        except (KeyboardInterrupt, SystemExit) as exc:
            self._fatal = exc  # raised by serve() once the flow's code has unwound
            outcome: Outcome = (None, asyncio.CancelledError(f"{type(exc).__name__} in a step"))
        except BaseException as exc:
            outcome = (None, exc)
        else:
            outcome = (value, None)
        with contextlib.suppress(RuntimeError):  # a closed loop: serve() sees it next
            self._loop.call_soon_threadsafe(_settle, future, outcome)


def _settle(future: asyncio.Future[Outcome], outcome: Outcome) -> None:
    if not future.done():
        future.set_result(outcome)


class LoopThread:
    """An event loop running in a thread of its own: where a worker's async flows run,
    as tasks side by side, while each drive's thread serves its flow's blocking calls."""

    def __init__(self, name: str, executor_threads: int) -> None:
        self.loop = asyncio.new_event_loop()
        # Flows share it (asyncio.to_thread): as many threads as a loop per
        # drive would have had, for every drive at once.
        self._executor = ThreadPoolExecutor(executor_threads, thread_name_prefix=f"{name}-executor")
        self.loop.set_default_executor(self._executor)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            while not self._closing:
                # One from a flow's task: its drive raises it; the other runs go on.
                with contextlib.suppress(SystemExit, KeyboardInterrupt):
                    loop.run_forever()
        finally:  # as asyncio.run ends: what flows left running is cancelled first
            let_go(loop)  # the async API's calls a task gave up on: `join_threads` waits
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            # None left: no gather, which would look for the policy's current loop, one
            # a policy set since the loop started (uvloop's, say) does not know.
            gathered = asyncio.gather(*left, return_exceptions=True) if left else None
            while gathered is not None and not gathered.done():
                # The stop close() queued runs here when a flow's SystemExit or
                # KeyboardInterrupt ended the loop first: "stopped before Future completed".
                with contextlib.suppress(RuntimeError):
                    loop.run_until_complete(gathered)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()  # the executor's threads go on: see `join_threads`

    def close(self) -> None:
        """Stop the loop (once the drives using it are done) and close it."""
        self._closing = True
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()

    def join_threads(self, seconds: float) -> bool:
        """After `close`, as asyncio.run ends: wait for the threads the flows started
        on the loop's default executor (a call of `asyncio.to_thread` whose awaiting
        task was cancelled goes on) and for the async API's calls made from the loop
        (`start_async` in a step, see `_threads`), but no longer than `seconds` (at
        least a tenth of a second, which idle threads take to end): one that never
        returns holds no stop.
        (Not `shutdown_default_executor`: on Python 3.11 it joins them however long.)

        Returns:
            Whether they all ended (if not, a warning is logged).
        """
        joined = threading.Event()

        def join() -> None:
            self._executor.shutdown(wait=True)
            call_threads().wait_quiet(tag=self.loop)
            joined.set()

        threading.Thread(target=join, name=f"{self._thread.name}-join", daemon=True).start()
        waited = max(seconds, 0.1)
        if joined.wait(waited):
            return True
        _log.warning(
            "loom: threads the async flows started (asyncio.to_thread, start_async) still "
            "run after %.1f s",
            waited,
        )
        return False
