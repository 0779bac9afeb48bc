"""Child executions: start_child, await_child, await_children, await_any.

Built only from kernel machinery: a step starts the child (an idempotent start by a
deterministic id), a gate parks the parent, and a dedupe-keyed resume wakes it.

The wake-up protocol. Parent and child each write their own fact, then look at the
other's: the parent journals its park at gate `child:<id>` and then checks whether
the child has ended; the child journals its end and then checks whether the parent
is parked at a gate naming it. Whichever looks second sees both facts, so at least
one of them delivers the outcome. The delivery is a resume of that gate (`on`) with
the gate's name and the park's position as its dedupe key, so a second delivery to a
park is a no-op and a delivery can never feed any other gate or park. A crash between
a write and its check is covered by
`Engine.recover()`, which runs the same checks for every parked or ended run.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Coroutine, Sequence
from typing import Any, Final, Literal, overload

from loom_kernel import (
    AsyncContext,
    ConflictError,
    Context,
    Engine,
    Execution,
    ExecutionNotFoundError,
    Flow,
    InvalidArgumentError,
    LoomError,
    NotSuspendedError,
    Status,
)

__all__ = [
    "ChildCancelledError",
    "ChildFailedError",
    "ChildIdTakenError",
    "await_any",
    "await_child",
    "await_children",
    "child_gate",
    "install",
    "start_child",
]

START_STEP: Final = "loom.child.start"
_ONE: Final = "child:"
_ANY: Final = "any:"
OnParentClose = Literal["abandon", "cancel"]


class ChildFailedError(LoomError):
    """The awaited child failed; raised in the parent, which may catch it.

    Attributes:
        child_id: the child execution.
        error_type: the qualified type name of the child's uncaught error.
        error_message: its message.
    """

    def __init__(self, child_id: str, error_type: str, error_message: str) -> None:
        self.child_id = child_id
        self.error_type = error_type
        self.error_message = error_message
        super().__init__(f"child {child_id!r} failed: {error_type}: {error_message}")


class ChildCancelledError(LoomError):
    """The awaited child was cancelled; raised in the parent, which may catch it."""

    def __init__(self, child_id: str, reason: str | None) -> None:
        self.child_id = child_id
        self.reason = reason
        super().__init__(f"child {child_id!r} was cancelled" + (f": {reason}" if reason else ""))


class ChildIdTakenError(LoomError):
    """A child's id names a run that is not this parent's child of that flow (a run
    started with that key by someone else): it is not adopted, and the start step
    fails.

    Attributes:
        child_id: the id.
        parent_id: the parent that derived it.
        found_parent: the parent of the run found (None for none).
        found_flow: the flow of the run found.
    """

    def __init__(
        self, child_id: str, parent_id: str, found_parent: str | None, found_flow: str
    ) -> None:
        self.child_id = child_id
        self.parent_id = parent_id
        self.found_parent = found_parent
        self.found_flow = found_flow
        super().__init__(
            f"run {child_id!r} exists and is not a child of {parent_id!r} (its parent is "
            f"{found_parent!r}, its flow {found_flow!r}): it is not adopted as one"
        )


_installed_on: weakref.WeakSet[Engine] = weakref.WeakSet()
#: The child ids each pass of a run's code has started (a pass is one ctx).
_started_by: weakref.WeakKeyDictionary[Context | AsyncContext, set[str]] = (
    weakref.WeakKeyDictionary()
)


def _claim_child_id(ctx: Context | AsyncContext, child_id: str) -> None:
    """A run starts each child id once: a second start of one (supervise_children
    called twice with the same child names) would wait for a child that ended
    before, for ever."""
    started = _started_by.setdefault(ctx, set())
    if child_id in started:
        raise InvalidArgumentError(
            f"child {child_id!r} was already started by this run: a run starts a child "
            "id once (call supervise_children again with other child names)"
        )
    started.add(child_id)


def install(engine: Engine) -> None:
    """Let `engine` deliver child outcomes (idempotent; registers once per engine).

    Engines load this by themselves through the `loom.listeners` entry point when
    loom-orchestration is installed. An engine built with an explicit `listeners=`
    list gets it at its first child start: a parent must never wait for a wake-up
    its engine cannot deliver.
    """
    if engine not in _installed_on:
        engine.add_listener(settle)
        _installed_on.add(engine)


def _outcome(child: Execution) -> dict[str, Any]:
    error = (
        None if child.error is None else {"type": child.error.type, "message": child.error.message}
    )
    return {
        "id": child.id,
        "status": str(child.status),
        "result": child.result,
        "error": error,
        "reason": child.cancel_reason,
    }


def child_gate(child_id: str) -> str:
    """The gate a child's end resumes: name it in `ctx.wait_first(gates=[...])` to
    wait for the child beside messages and a timeout (the gate's value is the
    child's outcome record: id, status, result, error, reason)."""
    return _ONE + child_id


def _children_of_gate(parked: Execution) -> list[tuple[str, str, str]]:
    """(child id, the gate a delivery names, its dedupe key) of each child the run is
    parked for. A key names the park's journal position too, so a child awaited
    before (the same gate parked at again, or named in a `wait_first`) still wakes
    each later park, while a second delivery to one park is a no-op."""
    gate = parked.waiting_on
    if gate is None:
        return []
    key = f"{gate}@{parked.position}"
    if gate.startswith(_ONE):
        return [(gate.removeprefix(_ONE), gate, key)]
    if gate.startswith(_ANY):
        return [(child, gate, key) for child in gate.removeprefix(_ANY).split("|")]
    return [
        (name.removeprefix(_ONE), name, f"{name}@{parked.position}")
        for name in parked.gates
        if name.startswith(_ONE)
    ]


def _deliver(engine: Engine, parent_id: str, gate: str, key: str, child: Execution) -> None:
    with contextlib.suppress(ConflictError, NotSuspendedError):
        # key: a re-delivery is a no-op; on: it can only ever feed this very gate.
        engine.resume(parent_id, _outcome(child), key=key, on=gate)


def settle(engine: Engine, execution: Execution) -> None:
    """The listener: the checks each side makes after writing its own fact."""
    if execution.status is Status.SUSPENDED:
        for child_id, gate, key in _children_of_gate(execution):
            try:
                child = engine.get(child_id)
            except ExecutionNotFoundError:
                continue
            if child.status.finished:
                _deliver(engine, execution.id, gate, key, child)
                return
        return
    if not execution.status.finished:
        return
    if execution.parent is not None:
        try:
            parent = engine.get(execution.parent)
        except ExecutionNotFoundError:
            parent = None
        gates = {} if parent is None else {c: (g, k) for c, g, k in _children_of_gate(parent)}
        if parent is not None and execution.id in gates:
            gate, key = gates[execution.id]
            _deliver(engine, parent.id, gate, key, execution)
    _close_children(engine, execution)


def _close_children(engine: Engine, parent: Execution) -> None:
    """Cancel the children the parent started with on_parent_close="cancel"; and, for
    a cancelled parent, the children whose start it never journaled (cancelled while
    its start step ran): the parent never knew of them, so none may outlive it."""
    journaled: set[str] = set()
    for frame in engine.frames(parent.id).values():
        if frame.name != START_STEP or not isinstance(frame.result, dict):
            continue
        journaled.add(str(frame.result["id"]))
        if frame.result.get("on_parent_close") == "cancel":
            with contextlib.suppress(ExecutionNotFoundError):
                engine.cancel(frame.result["id"], f"parent {parent.id!r} ended")
    if parent.status is not Status.CANCELLED:
        return
    for child in engine.executions(prefix=f"{parent.id}/"):
        if child.parent == parent.id and child.id not in journaled and not child.status.finished:
            with contextlib.suppress(ExecutionNotFoundError):
                engine.cancel(
                    child.id, f"parent {parent.id!r} was cancelled as it started this child"
                )


@overload
def start_child(
    ctx: Context, flow: str | Flow, input: Any = None, *, on_parent_close: OnParentClose = ...
) -> str: ...
@overload
def start_child(
    ctx: AsyncContext,
    flow: str | Flow,
    input: Any = None,
    *,
    on_parent_close: OnParentClose = ...,
) -> Coroutine[Any, Any, str]: ...
def start_child(
    ctx: Context | AsyncContext,
    flow: str | Flow,
    input: Any = None,
    *,
    on_parent_close: OnParentClose = "abandon",
) -> Any:
    """Start a child execution and return its id, without waiting for it (in an
    `async def` flow, awaitable: `child_id = await start_child(ctx, ...)`).

    The id is `<parent id>/c<position>`, fixed by the call's position in the parent,
    so a parent replayed after a crash finds the same child instead of starting a
    second. When a `Worker` runs on the parent's engine, the child is handed to it
    (`enqueue`), so children run side by side on its slots; otherwise the child runs
    inline until it first parks or ends. It survives its parent unless
    `on_parent_close="cancel"`.
    """
    if on_parent_close not in ("abandon", "cancel"):
        raise InvalidArgumentError(
            f"on_parent_close is 'abandon' or 'cancel', not {on_parent_close!r}"
        )
    own = ctx.execution_id if ctx.generation == 1 else f"{ctx.execution_id}/g{ctx.generation}"
    return start_child_as(ctx, f"{own}/c{ctx.position}", flow, input, on_parent_close)


def start_child_as(
    ctx: Context | AsyncContext,
    child_id: str,
    flow: str | Flow,
    input: Any,
    on_parent_close: OnParentClose,
) -> Any:
    """start_child with an id the caller derived deterministically (a supervisor's `name@n`)."""
    engine: Engine = ctx.engine
    install(engine)
    flow_name = flow.name if isinstance(flow, Flow) else flow
    _claim_child_id(ctx, child_id)

    def start() -> dict[str, Any]:
        # A worker here takes the child (one of its slots, or its queue); else inline.
        engine.dispatch(flow_name, input, key=child_id, parent=ctx.execution_id)
        found = engine.get(child_id)
        if found.parent != ctx.execution_id or found.flow != flow_name:
            raise ChildIdTakenError(child_id, ctx.execution_id, found.parent, found.flow)
        return {"id": child_id, "flow": flow_name, "on_parent_close": on_parent_close}

    if isinstance(ctx, AsyncContext):
        return _started_id(ctx.step(START_STEP, start))
    started: dict[str, Any] = ctx.step(START_STEP, start)
    return str(started["id"])


async def _started_id(step: Coroutine[Any, Any, dict[str, Any]]) -> str:
    return str((await step)["id"])


def wait_any(ctx: Context | AsyncContext, child_ids: Sequence[str]) -> Any:
    """Park until the first of these existing children ends; return its outcome record
    (id, status, result, error, reason) without raising (awaitable in async flows)."""
    gate = _ONE + child_ids[0] if len(child_ids) == 1 else _ANY + "|".join(child_ids)
    if isinstance(ctx, AsyncContext):
        return _outcome_async(ctx, gate, child_ids)
    return _outcome_at(ctx, gate, child_ids)


def _is_outcome(payload: Any, child_ids: Sequence[str]) -> bool:
    """Whether a gate's payload is an outcome a delivery made (a stray `resume` of
    the parent is not)."""
    return (
        isinstance(payload, dict)
        and payload.get("id") in child_ids
        and payload.get("status") in ("completed", "failed", "cancelled")
        and {"result", "error", "reason"} <= payload.keys()
    )


def _outcome_at(ctx: Context, gate: str, child_ids: Sequence[str]) -> Any:
    """The outcome at a child gate; a payload that is none (a stray resume) parks the
    run at the gate again, for the delivery."""
    while True:
        outcome = ctx.suspend(gate)
        if _is_outcome(outcome, child_ids):
            return outcome


async def _outcome_async(ctx: AsyncContext, gate: str, child_ids: Sequence[str]) -> Any:
    while True:
        outcome = await ctx.suspend(gate)
        if _is_outcome(outcome, child_ids):
            return outcome


def _pairs(children: Any) -> list[tuple[str | Flow, Any]]:
    """The (flow, input) pairs a call was given, checked."""
    if isinstance(children, (str, bytes)) or not isinstance(children, Sequence):
        raise InvalidArgumentError(f"children is a list of (flow, input) pairs, not {children!r}")
    for child in children:
        if not (
            isinstance(child, (tuple, list))
            and len(child) == 2
            and isinstance(child[0], (str, Flow))
        ):
            raise InvalidArgumentError(
                f"a child is a (flow, input) pair, its flow a name or a Flow, not {child!r}"
            )
    return [(flow, data) for flow, data in children]


def _unwrap(outcome: dict[str, Any]) -> Any:
    status = outcome["status"]
    if status == Status.COMPLETED:
        return outcome["result"]
    if status == Status.FAILED:
        error = outcome["error"] or {"type": "unknown", "message": ""}
        raise ChildFailedError(outcome["id"], error["type"], error["message"])
    raise ChildCancelledError(outcome["id"], outcome.get("reason"))


def await_child(
    ctx: Context | AsyncContext,
    flow: str | Flow,
    input: Any = None,
    *,
    on_parent_close: OnParentClose = "abandon",
) -> Any:
    """Start a child and park the parent until it ends; return its result.

    Raises:
        ChildFailedError: the child failed (carries its error's type and message).
        ChildCancelledError: the child was cancelled.
    """
    if isinstance(ctx, AsyncContext):
        return _await_child_async(ctx, flow, input, on_parent_close)
    child_id = start_child(ctx, flow, input, on_parent_close=on_parent_close)
    return _unwrap(wait_any(ctx, [child_id]))


async def _await_child_async(
    ctx: AsyncContext, flow: str | Flow, input: Any, on_parent_close: OnParentClose
) -> Any:
    child_id = await start_child(ctx, flow, input, on_parent_close=on_parent_close)
    return _unwrap(await wait_any(ctx, [child_id]))


@overload
def await_children(
    ctx: Context,
    children: Sequence[tuple[str | Flow, Any]],
    *,
    on_parent_close: OnParentClose = ...,
) -> list[Any]: ...
@overload
def await_children(
    ctx: AsyncContext,
    children: Sequence[tuple[str | Flow, Any]],
    *,
    on_parent_close: OnParentClose = ...,
) -> Coroutine[Any, Any, list[Any]]: ...
def await_children(
    ctx: Context | AsyncContext,
    children: Sequence[tuple[str | Flow, Any]],
    *,
    on_parent_close: OnParentClose = "abandon",
) -> Any:
    """Start every (flow, input) child, then wait for all; results in the given order.

    Raises:
        ChildFailedError, ChildCancelledError: for the first child, in order, that did
            not complete (after every child has ended).
    """
    children = _pairs(children)
    if isinstance(ctx, AsyncContext):
        return _await_children_async(ctx, children, on_parent_close)
    ids = [start_child(ctx, flow, data, on_parent_close=on_parent_close) for flow, data in children]
    outcomes = [wait_any(ctx, [child_id]) for child_id in ids]
    return [_unwrap(outcome) for outcome in outcomes]


async def _await_children_async(
    ctx: AsyncContext,
    children: Sequence[tuple[str | Flow, Any]],
    on_parent_close: OnParentClose,
) -> list[Any]:
    ids = [
        await start_child(ctx, flow, data, on_parent_close=on_parent_close)
        for flow, data in children
    ]
    outcomes = [await wait_any(ctx, [child_id]) for child_id in ids]
    return [_unwrap(outcome) for outcome in outcomes]


@overload
def await_any(
    ctx: Context,
    children: Sequence[tuple[str | Flow, Any]],
    *,
    on_parent_close: OnParentClose = ...,
) -> tuple[str, Any]: ...
@overload
def await_any(
    ctx: AsyncContext,
    children: Sequence[tuple[str | Flow, Any]],
    *,
    on_parent_close: OnParentClose = ...,
) -> Coroutine[Any, Any, tuple[str, Any]]: ...
def await_any(
    ctx: Context | AsyncContext,
    children: Sequence[tuple[str | Flow, Any]],
    *,
    on_parent_close: OnParentClose = "abandon",
) -> Any:
    """Start every (flow, input) child and wait for the first to end.

    Returns:
        (the id of the first child to end, its result). The others keep running.

    Raises:
        ChildFailedError, ChildCancelledError: the first child to end did not complete.
    """
    children = _pairs(children)
    if not children:
        raise InvalidArgumentError("await_any needs at least one child")
    if isinstance(ctx, AsyncContext):
        return _await_any_async(ctx, children, on_parent_close)
    ids = [start_child(ctx, flow, data, on_parent_close=on_parent_close) for flow, data in children]
    outcome = wait_any(ctx, ids)
    return str(outcome["id"]), _unwrap(outcome)


async def _await_any_async(
    ctx: AsyncContext,
    children: Sequence[tuple[str | Flow, Any]],
    on_parent_close: OnParentClose,
) -> tuple[str, Any]:
    ids = [
        await start_child(ctx, flow, data, on_parent_close=on_parent_close)
        for flow, data in children
    ]
    outcome = await wait_any(ctx, ids)
    return str(outcome["id"]), _unwrap(outcome)
