"""Running a flow's code once, from the top, against its folded journal.

A drive is a generator (`Drive`): it runs the sync parts of a drive (the lock, the
claim, the journal's reads and writes, a sync flow's whole code) where it is resumed,
and yields a `FlowPass` for each pass of an async flow's code, which its driver runs
and sends back the outcome of. `drive_here` drives one on this thread (each pass on
the loop the caller runs under, or its own); a worker drives one across its pool and
its event loop, so that an async flow holds no thread while its code awaits (see
`Worker`).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Coroutine, Generator
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeAlias, TypeVar

from loom_kernel._core import (
    ExecutionCompleted,
    ExecutionFailed,
    ExecutionState,
    LoomError,
    NonDeterminismError,
    error_info,
    to_json,
)
from loom_kernel._replay._async_context import AsyncContext
from loom_kernel._replay._context import Context
from loom_kernel._replay._flows import Flow
from loom_kernel._replay._host import DriveControl, Host, Unwind
from loom_kernel._replay._servant import FLOW_LOOP, LoopStoppedError, Outcome, Servant

T = TypeVar("T")

__all__ = [
    "FLOW_LOOP",
    "Drive",
    "FlowPass",
    "awaitable_sleep",
    "drive_here",
    "drive_on_loop",
    "on_loop",
    "replay_check",
    "run_flow",
]


class FlowPass:
    """What a drive asks its driver for: one pass of an async flow's code (`coroutine`,
    the flow's own, run as `context.run(coroutine)`); the driver sends back its result
    or throws in its error."""

    __slots__ = ("context", "coroutine")

    def __init__(self, context: AsyncContext, coroutine: Coroutine[Any, Any, Any]) -> None:
        self.context = context
        self.coroutine = coroutine


#: A drive (see the module's docstring), returning T.
Drive: TypeAlias = Generator[FlowPass, Any, T]


def drive_here(drive: Drive[T], asked: FlowPass | None = None) -> T:
    """Drive to its end on this thread, each pass of async code as `_run_coroutine`
    runs it; its result. `asked`: the pass it asked for already, if it was begun
    elsewhere."""
    try:
        if asked is None:
            asked = next(drive)
        while True:
            try:
                value = _run_coroutine(asked.context, asked.coroutine)
            except BaseException as exc:
                asked = drive.throw(exc)
            else:
                asked = drive.send(value)
    except StopIteration as stop:
        result: T = stop.value
        return result


async def drive_on_loop(
    drive: Drive[Any], asked: FlowPass, context: contextvars.Context, executor: Executor
) -> Outcome:
    """Drive to its end a drive begun elsewhere (it asked for `asked`), holding no
    thread while its flow's code runs: each pass of that code is a task of the running
    loop whose blocking calls are made on `executor`, as the drive's sync parts are,
    all in `context` (the drive's own, from its first part: the locks it takes reset
    context variables).

    Returns:
        How the drive ended: (its result, None) or (None, its error), never raised
        here (a KeyboardInterrupt or SystemExit raised on the loop would stop it for
        every run).
    """
    loop = asyncio.get_running_loop()
    closing = False  # the loop cancelled this: it is closing, no pass starts now
    while True:
        if closing:
            asked.coroutine.close()
            resume: Callable[[Any], Any] = drive.throw
            value: Any = Unwind(LoomError("the event loop running the flow is closing"))
        else:
            (resume, value), closing = await _pass_on_loop(drive, asked, context, executor)

        def part(
            resume: Callable[[Any], Any] = resume, value: Any = value
        ) -> tuple[Outcome | None, Any]:
            """On the executor: the drive's next sync part; how it ended, or the next
            pass it asks for."""
            try:
                return None, context.run(resume, value)
            except StopIteration as stop:
                return (stop.value, None), None
            except BaseException as exc:
                return (None, exc), None

        future = loop.run_in_executor(executor, part)
        while True:
            try:
                ended, asked = await asyncio.shield(future)
                break
            except asyncio.CancelledError:  # the part goes on: the drive waits for it
                closing = True
        if ended is not None:
            return ended


async def _pass_on_loop(
    drive: Drive[Any], asked: FlowPass, context: contextvars.Context, executor: Executor
) -> tuple[tuple[Callable[[Any], Any], Any], bool]:
    """One pass of the flow's code as a task of this loop, its calls made on `executor`;
    how to resume the drive with how it ended, and whether the loop cancelled this
    meanwhile (it is closing)."""
    servant = Servant(asyncio.get_running_loop(), executor)
    asked.context.served_by(servant)
    run = asked.context.run(asked.coroutine)
    task = asyncio.get_running_loop().create_task(run, context=context.copy())
    closing = False
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:  # the loop closing cancels the flow's task too
            closing = True
    servant.close()
    if servant.fatal is not None:
        return (drive.throw, servant.fatal), closing
    if task.cancelled():
        stopped = LoomError("the flow's task was cancelled: its event loop is closing")
        return (drive.throw, Unwind(stopped)), closing
    error = task.exception()
    if error is not None:
        return (drive.throw, error), closing
    return (drive.send, task.result()), closing


def run_flow(
    definition: Flow, host: Host, state: ExecutionState, control: DriveControl
) -> Drive[ExecutionCompleted | ExecutionFailed | None]:
    """Re-run the flow from the top until it parks or ends.

    Steps and gates journal themselves as the code reaches them; what is left is how
    the run ended.

    Returns:
        The event that ends the run (its result, or the error it did not catch), or
        None when it parked at a gate.

    Raises:
        ConflictError: another writer moved the journal (this run stopped).
        NonDeterminismError, InvalidArgumentError: the code misused or diverged from
            the journal (including returning or failing before it reached every
            recorded call); the journal is left as it was.
    """
    ending, context = yield from _execute(definition, host, state, control)
    if ending is not None:
        _refuse_unconsumed(state.id, ending, context)
    return ending


def replay_check(definition: Flow, host: Host, state: ExecutionState) -> None:
    """Re-run `definition` against the run's recorded history, in memory, writing nothing.

    The replay stops where recorded history ends (at the first call with no record,
    before it runs); no new step runs and nothing is journaled.

    Raises:
        NonDeterminismError: the code diverges from the history: it asks for another
            call than the one recorded (naming the index and both names), or it stops
            (returns, fails, parks) before it reaches everything recorded.
    """
    control = DriveControl(replay_only=True)
    ending, context = drive_here(_execute(definition, host, state.copy(), control))
    _refuse_unconsumed(state.id, ending, context)


def _refuse_unconsumed(
    execution_id: str,
    ending: ExecutionCompleted | ExecutionFailed | None,
    context: Context | AsyncContext,
) -> None:
    """Raise when the code stopped before reaching every call the journal records."""
    missed = context.unconsumed()
    if missed is None:
        return
    kind, index, name = missed
    if isinstance(ending, ExecutionFailed):
        found = f"(nothing: the code failed first with {ending.error.type}: {ending.error.message})"
    elif isinstance(ending, ExecutionCompleted):
        found = "(nothing: the code returned first)"
    else:
        found = "(nothing: the code stopped first)"
    raise NonDeterminismError(execution_id, kind, index, name, found)


def _execute(
    definition: Flow, host: Host, state: ExecutionState, control: DriveControl
) -> Drive[tuple[ExecutionCompleted | ExecutionFailed | None, Context | AsyncContext]]:
    """Run the code from the top, again while a pass asks to (`Context.replay_again`):
    each such pass journaled the steps it left running, so the next one gets further."""
    while True:
        before = state.position
        ending, context = yield from _execute_once(definition, host, state, control)
        if not context.replay_again:
            return ending, context
        if state.position == before:  # the next pass would end the same way, forever
            raise LoomError(
                f"run {state.id!r}: a pass of its code ended to run again having "
                "journaled nothing, so the next would too; the drive stops, the journal "
                "as it was (a bug in Loom: please report it)"
            )


def _execute_once(
    definition: Flow, host: Host, state: ExecutionState, control: DriveControl
) -> Drive[tuple[ExecutionCompleted | ExecutionFailed | None, Context | AsyncContext]]:
    context: Context | AsyncContext = (
        AsyncContext(host, state, control) if definition.is_async else Context(host, state, control)
    )
    try:
        if isinstance(context, AsyncContext):
            result = yield FlowPass(context, definition.fn(context, state.input))
        else:
            result = definition.fn(context, state.input)
    except Unwind as unwind:
        _raise_error(context.halted or unwind)  # an error may have replaced a replay
        return None, context
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseExceptionGroup as group:  # a TaskGroup's: a stop inside it is a stop
        if group.subgroup((KeyboardInterrupt, SystemExit)) is not None:
            raise
        stop = context.halted or _unwind_in(group)
        if stop is None:
            if isinstance(group, Exception):
                return ExecutionFailed(error_info(group)), context
            raise
        _raise_error(stop)
        return None, context
    except Exception as exc:
        if context.halted is not None:  # the flow went on past a stop it swallowed
            _raise_error(context.halted)
            return None, context
        return ExecutionFailed(error_info(exc)), context
    if context.halted is not None:
        _raise_error(context.halted)
        return None, context
    completed = ExecutionCompleted(
        to_json(result, f"the result of flow {definition.name!r}", str_keys=False)
    )
    return completed, context


def _unwind_in(group: BaseExceptionGroup[BaseException]) -> Unwind | None:
    """The first stop of the drive among a group's exceptions, nested ones included."""
    for exc in group.exceptions:
        if isinstance(exc, Unwind):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _unwind_in(exc)
            if found is not None:
                return found
    return None


def _raise_error(unwind: Unwind) -> None:
    """A drive a ctx call stopped on an error: raise it to the caller (a park returns)."""
    if unwind.error is not None:
        raise unwind.error from None


def awaitable_sleep(sleep: Callable[[float], None]) -> Callable[[float], Awaitable[None]]:
    """A sync sleep as an async one (an injected no-op serves sync and async flows)."""

    async def pause(seconds: float) -> None:
        sleep(seconds)

    return pause


def on_loop(loop: asyncio.AbstractEventLoop, call: Callable[..., T]) -> Callable[..., T]:
    """`call`, made to run async flows' code on `loop` (for a drive on another thread)."""

    def bound(*args: Any, **kwargs: Any) -> T:
        FLOW_LOOP.set(loop)
        return call(*args, **kwargs)

    return bound


def _run_coroutine(context: AsyncContext, flow: Coroutine[Any, Any, Any]) -> Any:
    """Run an async flow to its end: on the loop of the async API's caller or of a
    worker (this thread making its blocking calls), in this thread, or, under a
    running loop, in a helper thread.

    The coroutine runs in a copy of this context, so it holds what its caller holds
    (the run's lock, the listener queue) instead of waiting for it.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        under_a_loop = False
    else:
        under_a_loop = True
    if not under_a_loop:  # outside the except: a drive's errors are not "during" it
        caller = FLOW_LOOP.get()
        if caller is not None and not caller.is_closed():
            return _on_callers_loop(context, flow, caller)
        return asyncio.run(context.run(flow))
    copied = contextvars.copy_context()
    copied.run(FLOW_LOOP.set, None)  # the helper's nested drives must not wait on a loop
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-flow") as pool:
        return pool.submit(copied.run, asyncio.run, context.run(flow)).result()


def _on_callers_loop(
    context: AsyncContext, flow: Coroutine[Any, Any, Any], loop: asyncio.AbstractEventLoop
) -> Any:
    """Run the flow's coroutine on `loop` while this thread makes its blocking calls;
    a loop that stops or closes meanwhile stops the drive (the journal as it was)."""
    servant = Servant(loop)
    context.served_by(servant)
    try:
        return servant.serve(asyncio.run_coroutine_threadsafe(context.run(flow), loop))
    except LoopStoppedError as exc:
        raise Unwind(LoomError(str(exc))) from None
