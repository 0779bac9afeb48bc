"""The replay context an `async def` flow receives: the same operations, awaitable.

Its decisions and journal writes are `BaseContext`'s; what is its own is how an async
flow's code runs: its ctx calls come from its own task, steps may run concurrently
(and a pass ends when the code would see how concurrent steps finished), and the
blocking calls go to the drive's thread when its code runs on another thread's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import itertools
import threading
from collections.abc import Callable, Coroutine, Generator
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Final, TypeVar

from loom_kernel._core import ExecutionState, InvalidArgumentError, LoomError
from loom_kernel._replay._context import BaseContext
from loom_kernel._replay._decisions import NEW
from loom_kernel._replay._flows import RetryPolicy
from loom_kernel._replay._host import DriveControl, Host, Unwind
from loom_kernel._replay._servant import FLOW_LOOP, unwrap
from loom_kernel._replay._waits import Woken

if TYPE_CHECKING:
    from loom_kernel._replay._servant import Servant

__all__ = ["AsyncContext"]

T = TypeVar("T")

#: In async flows: the context whose step function is running in this task, and the
#: step's name (a task gathered beside it is not inside it). A sync context keeps the
#: name on itself, which costs less per step.
_RUNNING_STEP: contextvars.ContextVar[tuple[object, str] | None] = contextvars.ContextVar(
    "loom_running_step", default=None
)


def _cancel_tasks_of(
    coroutines: list[Coroutine[Any, Any, Any]],
) -> list[Coroutine[Any, Any, Any]]:
    """Cancel the tasks made around coroutines that never started (`ensure_future`,
    `create_task` with no await after): cancelled before their first run, such a task
    closes its coroutine without running it, and ends cancelled, with nothing logged
    (a coroutine closed under it would make it fail: "Task exception was never
    retrieved").

    Returns:
        The coroutines no task holds, which the caller closes.
    """
    left = set(coroutines)
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # no loop runs here: no task can hold them
        tasks = set()
    for task in tasks:
        coroutine = task.get_coro()
        if coroutine in left:
            task.cancel()
            left.discard(coroutine)
    return [coroutine for coroutine in coroutines if coroutine in left]


class _Resumptions:
    """Awaits a coroutine, calling `check` each time the event loop resumes it.

    `check` returns a stop to throw into the coroutine instead of resuming it, or None.
    """

    __slots__ = ("_check", "_coroutine")

    def __init__(
        self, coroutine: Coroutine[Any, Any, Any], check: Callable[[], Unwind | None]
    ) -> None:
        self._coroutine = coroutine
        self._check = check

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine = self._coroutine
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = coroutine.send(value) if error is None else coroutine.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = yield yielded
            except BaseException as exc:  # a cancel or close: handed to the flow's code
                error = exc
            if error is None:
                error = self._check()


#: A step's attempt where the engine has no tracer.
_NO_SPAN: Final = contextlib.nullcontext()


class AsyncContext(BaseContext):
    """What an `async def` flow receives as `ctx`: the same journal, awaitable calls.

    The rule in async flows: `step`, `suspend` and `sleep` return awaitables, and each
    must be awaited before the flow parks or returns (an un-awaited one would silently
    not happen, so it is refused). `now`, `random` and `uuid` are plain calls, as in a
    sync flow. Every ctx call is made by the flow's own code (its own task); steps may
    run concurrently when that code gathers them (`asyncio.gather(ctx.step(...),
    ctx.step(...))`). The flow's code never sees how new concurrent steps finished:
    when it would (it resumes after one finished elsewhere), the pass ends, the steps
    still running finish and are journaled, and the code runs again from the top on
    the journal, where every step is recorded and they finish in the order they were
    called. So what the code decides never depends on timing. Gates are awaited by
    the flow's own task, one at a time.
    """

    def __init__(
        self, host: Host, state: ExecutionState, control: DriveControl | None = None
    ) -> None:
        super().__init__(host, state, control)
        self._task: asyncio.Task[Any] | None = None
        self._unstarted: dict[object, tuple[str, Coroutine[Any, Any, Any]]] = {}
        self._in_flight: set[int] = set()  # new steps whose functions are running
        self._quiet: asyncio.Future[None] | None = None  # done when none is running
        self._own_step = False  # the flow's own task is running a new step's function
        self._finished_elsewhere = False  # a new step finished in another task
        self._replaying: dict[int, asyncio.Future[None] | None] = {}  # see _in_call_order
        # On a loop of another thread's (see Servant), that thread makes the blocking
        # calls; `_lock` keeps them and the loop's own journaling ctx calls (ctx.now)
        # one at a time, and `_halt_lock` (never held over a call to the store) keeps
        # a stop from one thread from overwriting the other's.
        self._servant: Servant | None = None
        self._lock = threading.RLock()
        self._halt_lock = threading.Lock()
        self._ended = False  # the pass is over: a task it left may not journal

    def served_by(self, servant: Servant) -> None:
        """Have `servant` (the drive's thread) make this run's blocking calls."""
        self._servant = servant

    def _halt(self, error: LoomError | None = None) -> Unwind:
        with self._halt_lock:
            return super()._halt(error)

    def _replay_again(self) -> Unwind:
        with self._halt_lock:
            return super()._replay_again()

    def _recorded(self, name: str, produce: Callable[[], Any]) -> Any:
        with self._lock:  # on the loop, even beside a servant: ctx.now() is no awaitable
            return super()._recorded(name, produce)

    def patched(self, change: str) -> bool:
        """As `Context.patched` (it reads the recorded steps a servant may be adding to)."""
        with self._lock:
            return super().patched(change)

    def _begin_step(self, name: object, returns: type[Any] | None) -> tuple[int, Any]:
        """Replay a recorded step or claim a new one: (index, replayed value or NEW).

        The common replay (a recorded, successful, untyped step of the same name) is
        answered inline in `step` before this is called; this is the checked path. The
        owner of a new step is checked when its coroutine starts (`_new_step`), off the
        loop.
        """
        index, frame = self._claim_step(name)
        if frame is not None:
            return index, self._replayed(frame, returns)
        return index, NEW

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, a call that reads or writes the journal: on the servant's thread
        when there is one (the loop goes on meanwhile), else here.

        The call cannot be cancelled (see `Servant.call`), as it could not be when it
        held the loop: the code never sees a call fail that the journal records.
        """
        servant = self._servant
        if servant is None:
            return fn(*args)
        # In this task's context: what the call would see here (the running step).
        outcome = await servant.call(self._locked, fn, *args, context=contextvars.copy_context())
        result: T = unwrap(outcome)
        return result

    def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            return fn(*args)

    async def run(self, flow: Coroutine[Any, Any, Any]) -> Any:
        """Run the flow's coroutine as the task its ctx calls must come from; however
        the pass ends, the new steps it started finish and are journaled first."""
        self._task = asyncio.current_task()
        try:
            result = await _Resumptions(flow, self._on_resume)
            self._refuse_unawaited("returned")
            if self._in_flight:
                raise self._replay_again()
            return result
        finally:
            self._task = None
            self._ended = True
            for _what, coroutine in self._unstarted.values():
                coroutine.close()
            stopped = False
            while self._in_flight:  # even when the loop cancels this task as it closes
                self._quiet = asyncio.get_running_loop().create_future()
                try:
                    await asyncio.shield(self._quiet)
                except asyncio.CancelledError:
                    stopped = True
            if stopped:
                raise asyncio.CancelledError

    def _on_resume(self) -> Unwind | None:
        """The loop resumes the flow's code after new steps ran elsewhere: end the pass."""
        if self._own_step or not (self._in_flight or self._finished_elsewhere):
            return None
        return self._replay_again()

    def _running_step(self) -> str | None:
        running = _RUNNING_STEP.get()
        return running[1] if running is not None and running[0] is self else None

    _checks_claims = True

    def _before_claim(self, call: str) -> None:
        task = self._task
        if task is None:
            self._refuse_after_the_pass(call)
            return
        servant = self._servant
        if servant is not None and servant.serving_here():
            return  # a call the flow's own task handed over (set_event's), checked there
        try:
            current = asyncio.current_task()
        except RuntimeError:  # another thread, with no loop
            current = None
        if current is task:
            return
        self._refuse_inside_step(call)
        raise self._halt(
            InvalidArgumentError(
                f"{call} was called in another task than the flow's own (a coroutine run "
                "by asyncio.gather, create_task or wait): which position it takes would "
                "depend on timing, so a replay could not match it; call ctx in the flow "
                "itself (asyncio.gather(ctx.step(...), ctx.step(...)) runs steps "
                "concurrently), and make a branch of several steps one step or a child flow"
            )
        )

    def _track(
        self, what: str, make: Callable[[object], Coroutine[Any, Any, T]]
    ) -> Coroutine[Any, Any, T]:
        token = object()
        coroutine = make(token)
        self._unstarted[token] = (what, coroutine)
        return coroutine

    def _refuse_unawaited(self, before: str) -> None:
        if not self._unstarted:
            return
        what, _ = next(iter(self._unstarted.values()))
        coroutines = [coroutine for _what, coroutine in self._unstarted.values()]
        self._unstarted.clear()
        for coroutine in _cancel_tasks_of(coroutines):
            coroutine.close()  # it will never run: no "never awaited" warning on top
        raise self._halt(
            InvalidArgumentError(
                f"{what} was called but never awaited before the flow {before}: in an async "
                "flow every ctx.step, ctx.suspend and ctx.sleep must be awaited (an "
                "un-awaited call does not happen, and a replay could not tell)"
            )
        )

    def _before_new_gate(self) -> None:
        if self._servant is None:  # else made on the loop, before the gate is handed over
            self._refuse_new_gate_now()

    def _refuse_new_gate_now(self) -> None:
        """A new gate waits for no step: an unawaited one is refused, and one still
        running ends the pass (it is journaled, and the code runs again)."""
        self._refuse_unawaited("parked")
        if self._in_flight:
            raise self._replay_again()

    def _checks_before_handing_a_gate(self, call: str) -> None:
        """With a servant: the checks of the loop's own bookkeeping `_before_new_gate`
        makes, made here, on the loop, before a new gate goes to the drive's thread
        (after the one `_gate` makes before it: a gate inside a step never waits for
        that step to end)."""
        if self._servant is not None and self._gate_index >= len(self._state.gates):
            self._refuse_inside_step(call)
            self._refuse_new_gate_now()

    def _refuse_after_the_pass(self, call: str) -> None:
        """A ctx call from a task the flow left running once its pass was over."""
        if self._ended:
            raise self._halt(
                InvalidArgumentError(
                    f"{call} was called after the flow's pass ended, by a task it left "
                    "running: a run journals only what its own code does while it runs; "
                    "await every task the flow starts"
                )
            )

    def _gate_in_own_task(self, call: str) -> None:
        if self._halted is not None:
            raise self._halted
        if self._task is None:
            self._refuse_after_the_pass(call)
        if self._task is not None and asyncio.current_task() is not self._task:
            raise self._halt(
                InvalidArgumentError(
                    f"{call} was awaited in another task than the flow's own (asyncio.gather, "
                    "asyncio.wait, create_task): gates cannot race each other or a timer, "
                    "because which one wins is not journaled; await gates one at a time in "
                    "the flow itself"
                )
            )

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        retry: RetryPolicy | None = None,
        returns: type[T] | None = None,
        **kwargs: Any,
    ) -> Coroutine[Any, Any, Any]:
        """As `Context.step`, awaitable; `fn` may be sync or async.

        A step takes its position when `ctx.step` is called, in the flow's own code,
        so steps gathered concurrently replay correctly whatever order they finished in.
        """
        what = f"ctx.step({name!r})"
        self._before_claim(what)
        # The replay hot path, as in Context.step.
        index = self._step_index
        frame = self._state.steps.get(index)
        if frame is not None and frame.name == name and frame.error is None and returns is None:
            self._step_index += 1
            return self._track(what, lambda token: self._replayed_step(token, index, frame.result))
        try:
            index, replayed = self._begin_step(name, returns)
        except Exception as exc:  # a recorded failure: raised where the step is awaited
            failure = exc
            return self._track(what, lambda token: self._replayed_step(token, index, None, failure))
        if replayed is not NEW:
            return self._track(what, lambda token: self._replayed_step(token, index, replayed))
        call = partial(fn, *args, **kwargs)
        policy = retry or self._host.retry
        return self._track(
            what,
            lambda token: self._new_step(token, index, name, call, policy=policy, returns=returns),
        )

    async def _replayed_step(
        self, token: object, index: int, result: Any, failure: Exception | None = None
    ) -> Any:
        self._unstarted.pop(token, None)
        if asyncio.current_task() is not self._task:
            await self._in_call_order(index)
        if failure is not None:
            raise failure
        return result

    async def _in_call_order(self, index: int) -> None:
        """Recorded steps running concurrently finish in the order they were called
        (whatever order asyncio started their tasks in), so code that watches them
        finish (asyncio.as_completed) sees the same order on every replay."""
        waiting = self._replaying
        waiting[index] = None
        try:
            await asyncio.sleep(0)  # siblings scheduled beside this one start too
            if min(waiting) != index:
                turn = waiting[index] = asyncio.get_running_loop().create_future()
                await turn
        finally:
            del waiting[index]
            if waiting:
                following = waiting[min(waiting)]
                if following is not None and not following.done():
                    following.set_result(None)

    def _seen_if_stopped(self, task: asyncio.Task[Any]) -> None:
        """A task of the flow's own making ran a step, and ended: once the drive has
        stopped, what it ended with goes nowhere (the flow may never await it), so it
        is taken as seen, and asyncio logs no "Task exception was never retrieved"."""
        if self._halted is not None and not task.cancelled():
            task.exception()

    async def _new_step(
        self,
        token: object,
        index: int,
        name: str,
        call: Callable[[], Any],
        *,
        policy: RetryPolicy,
        returns: type[Any] | None,
    ) -> Any:
        self._unstarted.pop(token, None)
        task = asyncio.current_task()
        if task is not None and task is not self._task:
            task.add_done_callback(self._seen_if_stopped)
        if self._halted is not None:
            raise self._halted  # the drive stopped before this step began
        if self._control.replay_only:
            raise self._halt(None)  # a replay-check ends at the first new work, at once
        own = asyncio.current_task() is self._task
        self._in_flight.add(index)
        self._own_step = self._own_step or own
        try:
            await self._blocking(self._writer.check_owner)
            value = await self._attempts(index, name, call, policy, returns)
        finally:
            self._in_flight.discard(index)
            if own:
                self._own_step = False
            else:
                self._finished_elsewhere = True
            if not self._in_flight and self._quiet is not None and not self._quiet.done():
                self._quiet.set_result(None)
        if own and (self._in_flight or self._finished_elsewhere):
            raise self._replay_again()
        return value

    async def _attempts(
        self,
        index: int,
        name: str,
        call: Callable[[], Any],
        policy: RetryPolicy,
        returns: type[T] | None,
    ) -> Any:
        servant = None if inspect.iscoroutinefunction(call) else self._servant
        span = self._control.span
        counters = self._host.counters
        for attempt in itertools.count(1):
            counters.steps += 1
            running = _RUNNING_STEP.set((self, name))
            try:
                try:
                    # Inline, not a coroutine of its own: a StopIteration the step
                    # raises must reach the handler below as itself (PEP 479).
                    with _NO_SPAN if span is None else span.step(index, name, attempt):
                        if servant is None:
                            value = call()
                        else:  # a sync function: on the drive's thread, never the loop's
                            copied = contextvars.copy_context()
                            # A flow it drives inline gets a loop of its own, as it
                            # would have under this loop, so this loop closing does
                            # not stop it.
                            copied.run(FLOW_LOOP.set, None)
                            value = unwrap(await servant.call(call, context=copied))
                        if inspect.isawaitable(value):
                            value = await value
                finally:
                    _RUNNING_STEP.reset(running)
            except Unwind:
                raise
            except Exception as exc:
                await self._host.async_sleep(
                    await self._blocking(self._retry_delay, policy, index, name, exc, attempt)
                )
                await self._blocking(self._writer.check_owner)  # a cancel or a release meanwhile
                continue
            except BaseException as exc:
                self._cut_short(name, exc)
                raise
            writer = self._writer
            return await self._blocking(writer.record_step, index, name, value, attempt, returns)
        raise AssertionError("unreachable")  # pragma: no cover

    def suspend(
        self, on: str, timeout: float | timedelta | None = None
    ) -> Coroutine[Any, Any, Any]:
        """As `Context.suspend`, awaitable; awaited by the flow's own task."""
        call = f"ctx.suspend({on!r})"
        return self._track(
            call, lambda token: self._own(token, call, self._suspend_gate, on, timeout)
        )

    def receive(
        self, topic: str | None = None, timeout: float | timedelta | None = None
    ) -> Coroutine[Any, Any, Any]:
        """As `Context.receive`, awaitable; awaited by the flow's own task."""
        call = f"ctx.receive({topic!r})"
        return self._track(
            call, lambda token: self._own(token, call, self._receive_gate, topic, timeout)
        )

    def wait_first(
        self,
        gates: list[str] | tuple[str, ...] = (),
        topics: list[str | None] | tuple[str | None, ...] = (),
        timeout: float | timedelta | None = None,
    ) -> Coroutine[Any, Any, Woken]:
        """As `Context.wait_first`, awaitable; awaited by the flow's own task."""
        call = "ctx.wait_first(...)"
        return self._track(
            call, lambda token: self._own(token, call, self._first_gate, gates, topics, timeout)
        )

    def set_event(self, key: str, value: Any) -> Coroutine[Any, Any, None]:
        """As `Context.set_event`, awaitable; awaited by the flow's own task."""
        call = f"ctx.set_event({key!r})"
        return self._track(
            call, lambda token: self._own(token, call, self._publish, key, value, gate=False)
        )

    async def _own(
        self, token: object, call: str, fn: Callable[..., T], *args: Any, gate: bool = True
    ) -> T:
        """Make a gate's call (or `set_event`'s, with `gate` false) in the flow's own
        task (as a suspend is)."""
        self._unstarted.pop(token, None)
        self._gate_in_own_task(call)
        if gate:
            self._checks_before_handing_a_gate(call)
        return await self._blocking(fn, *args)

    def sleep(self, duration: float | timedelta) -> Coroutine[Any, Any, None]:
        """As `Context.sleep`, awaitable; awaited by the flow's own task."""
        return self._track(f"ctx.sleep({duration!r})", lambda token: self._sleep(token, duration))

    async def _sleep(self, token: object, duration: float | timedelta) -> None:
        self._unstarted.pop(token, None)
        self._gate_in_own_task("ctx.sleep")
        seconds = self._sleep_seconds(duration)
        self._checks_before_handing_a_gate("ctx.sleep")
        await self._blocking(self._sleep_gate, seconds)
