"""supervise_children: an OTP-style supervisor, written as a flow over child executions."""

from __future__ import annotations

import math
import re
from collections.abc import Coroutine, Generator, Sequence
from typing import Any, Final, Literal, overload

import attrs
from loom_kernel import (
    AsyncContext,
    Context,
    Engine,
    Execution,
    Flow,
    InvalidArgumentError,
    LoomError,
    Status,
)

from loom_orchestration._children import start_child_as, wait_any

__all__ = [
    "ChildId",
    "ChildSpec",
    "ChildView",
    "SupervisorEscalationError",
    "format_supervision",
    "supervise_children",
    "supervision",
]

Strategy = Literal["one_for_one", "one_for_all", "rest_for_one"]
Restart = Literal["permanent", "transient", "temporary"]
_NAME: Final = re.compile(r"[A-Za-z0-9_.~:+=-]{1,60}")
_CANCEL_STEP: Final = "loom.supervisor.cancel"
_RESTART_REASON: Final = "restarted by its supervisor"


@attrs.frozen
class ChildSpec:
    """One supervised child.

    Attributes:
        name: unique among the supervisor's children; its executions are
            `<supervisor id>/<name>@<attempt>`.
        flow: the child's flow (name or Flow).
        input: the child's input.
        restart: `permanent` (always restarted), `transient` (restarted only after it
            failed) or `temporary` (never restarted).
    """

    name: str
    flow: str | Flow
    input: Any = None
    restart: Restart = "permanent"


@attrs.frozen
class ChildId:
    """The id of one execution of a supervised child: `<supervisor>/<name>@<attempt>`.

    Deterministic, so a supervisor replayed after a crash finds the same child.
    """

    supervisor: str
    name: str
    attempt: int

    def __str__(self) -> str:
        return f"{self.supervisor}/{self.name}@{self.attempt}"

    @classmethod
    def parse(cls, execution_id: str) -> ChildId | None:
        """The parts of a supervised child's id; None for any other id."""
        supervisor, _, tail = execution_id.rpartition("/")
        name, at, attempt = tail.rpartition("@")
        if not supervisor or not at or _NAME.fullmatch(name) is None or not attempt.isdigit():
            return None
        return cls(supervisor, name, int(attempt))


class SupervisorEscalationError(LoomError):
    """The restart intensity was exceeded: the supervisor gives up and fails, so its own
    parent (if any) sees it fail."""


def _flow_name(flow: str | Flow) -> str:
    return flow.name if isinstance(flow, Flow) else flow


def _check(specs: Sequence[ChildSpec], strategy: str, intensity: int, period: float) -> None:
    if strategy not in ("one_for_one", "one_for_all", "rest_for_one"):
        raise InvalidArgumentError(f"unknown strategy {strategy!r}")
    if isinstance(intensity, bool) or not isinstance(intensity, int) or intensity < 0:
        raise InvalidArgumentError(f"intensity is an int >= 0, not {intensity!r}")
    if (
        isinstance(period, bool)
        or not isinstance(period, (int, float))
        or not math.isfinite(period)
        or period <= 0
    ):
        raise InvalidArgumentError(f"period is a finite number of seconds > 0, not {period!r}")
    if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
        raise InvalidArgumentError(f"specs is a list of ChildSpec, not {specs!r}")
    for spec in specs:
        if not isinstance(spec, ChildSpec):
            raise InvalidArgumentError(f"a supervised child is a ChildSpec, not {spec!r}")
        if not isinstance(spec.name, str) or _NAME.fullmatch(spec.name) is None:
            raise InvalidArgumentError(f"invalid child name {spec.name!r}")
        if not isinstance(spec.flow, (str, Flow)):
            raise InvalidArgumentError(f"a child's flow is a name or a Flow, not {spec.flow!r}")
        if spec.restart not in ("permanent", "transient", "temporary"):
            raise InvalidArgumentError(f"unknown restart type {spec.restart!r}")
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"child names must be unique: {names}")


def _needs_restart(spec: ChildSpec, status: str) -> bool:
    if spec.restart == "permanent":
        return True
    return spec.restart == "transient" and status == Status.FAILED


@overload
def supervise_children(
    ctx: Context,
    specs: Sequence[ChildSpec],
    *,
    strategy: Strategy = ...,
    intensity: int = ...,
    period: float = ...,
) -> dict[str, Any]: ...
@overload
def supervise_children(
    ctx: AsyncContext,
    specs: Sequence[ChildSpec],
    *,
    strategy: Strategy = ...,
    intensity: int = ...,
    period: float = ...,
) -> Coroutine[Any, Any, dict[str, Any]]: ...
def supervise_children(
    ctx: Context | AsyncContext,
    specs: Sequence[ChildSpec],
    *,
    strategy: Strategy = "one_for_one",
    intensity: int = 3,
    period: float = 5.0,
) -> Any:
    """Run `specs` as children and restart them as OTP's supervisors do. Call it in a
    flow (in an `async def` flow, awaitable: `await supervise_children(ctx, ...)`).

    - one_for_one: only the child that ended is restarted;
    - one_for_all: every running child is cancelled and all are restarted;
    - rest_for_one: the children after it (in `specs` order) are cancelled and
      restarted with it.

    More than `intensity` restarts within `period` seconds (by the journaled clock,
    `ctx.now()`) makes the supervisor cancel its children and fail with
    SupervisorEscalationError. Every child is started with on_parent_close="cancel",
    so the supervisor's end ends them too.

    Returns:
        When no child is left running: {name: {"id", "status", "attempts"}} of the last
        execution of each child.
    """
    _check(specs, strategy, intensity, period)
    plan = _supervise(ctx.execution_id, specs, strategy, intensity, period)
    if isinstance(ctx, AsyncContext):
        return _run_async(ctx, plan)
    return _run(ctx, plan)


@attrs.frozen
class _Start:
    child_id: str
    flow: str | Flow
    input: Any


@attrs.frozen
class _Cancel:
    child_id: str


@attrs.frozen
class _WaitAny:
    child_ids: list[str]


@attrs.frozen
class _Now:
    pass


_Op = _Start | _Cancel | _WaitAny | _Now
#: The supervisor's logic, as a generator of the ctx calls it makes (each answered
#: with the call's result), so sync and async flows share it.
_Plan = Generator[_Op, Any, dict[str, Any]]


def _perform(ctx: Context | AsyncContext, op: _Op) -> Any:
    """Make one ctx call of the plan; in an async flow, the awaitable of it."""
    if isinstance(op, _Start):
        return start_child_as(ctx, op.child_id, op.flow, op.input, "cancel")
    if isinstance(op, _Cancel):
        child_id = op.child_id

        def cancel() -> dict[str, Any]:
            child = ctx.engine.cancel(child_id, _RESTART_REASON)
            error = child.error and {"type": child.error.type, "message": child.error.message}
            stopped = child.status is Status.CANCELLED and child.cancel_reason == _RESTART_REASON
            return {
                "id": child.id,
                "status": str(child.status),
                "error": error,
                "ended": not stopped,
            }

        return ctx.step(_CANCEL_STEP, cancel)
    if isinstance(op, _WaitAny):
        return wait_any(ctx, op.child_ids)
    return ctx.now()


def _run(ctx: Context, plan: _Plan) -> dict[str, Any]:
    answer: Any = None
    while True:
        try:
            op = plan.send(answer)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        answer = _perform(ctx, op)


async def _run_async(ctx: AsyncContext, plan: _Plan) -> dict[str, Any]:
    answer: Any = None
    while True:
        try:
            op = plan.send(answer)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        answer = _perform(ctx, op)
        if not isinstance(op, _Now):
            answer = await answer


def _supervise(
    supervisor_id: str, specs: Sequence[ChildSpec], strategy: str, intensity: int, period: float
) -> _Plan:
    order = {spec.name: position for position, spec in enumerate(specs)}
    attempts = dict.fromkeys(order, 0)
    running: dict[str, str] = {}
    last: dict[str, dict[str, Any]] = {}
    restarts: list[float] = []

    def launch(spec: ChildSpec) -> Generator[_Op, Any, None]:
        child_id = str(ChildId(supervisor_id, spec.name, attempts[spec.name]))
        running[spec.name] = str((yield _Start(child_id, spec.flow, spec.input)))

    def stop(name: str) -> Generator[_Op, Any, Any]:
        """Cancel a running child; what the cancel step recorded."""
        return (yield _Cancel(running.pop(name)))

    def stopped(name: str) -> Generator[_Op, Any, bool]:
        """Stop a child for a group restart: whether it is to start again. One that
        had ended by itself meanwhile ends as it did, and starts again only as its
        restart type says; a temporary one stopped here never starts again. (A
        journal from before cancels said how the child had ended records its id:
        the child starts again, as it did then.)"""
        spec = specs[order[name]]
        found = yield from stop(name)
        if not isinstance(found, dict):
            return True
        if found["ended"]:
            last[name] = {key: found[key] for key in ("id", "status", "error")}
            return _needs_restart(spec, found["status"])
        if spec.restart == "temporary":
            last[name] = {"id": found["id"], "status": found["status"], "error": None}
            return False
        return True

    for spec in specs:
        yield from launch(spec)
    while running:
        outcome = yield _WaitAny([running[spec.name] for spec in specs if spec.name in running])
        ended = ChildId.parse(str(outcome["id"]))
        assert ended is not None  # the supervisor launched it under such an id
        name = ended.name
        running.pop(name, None)
        last[name] = {"id": outcome["id"], "status": outcome["status"], "error": outcome["error"]}
        spec = specs[order[name]]
        if not _needs_restart(spec, outcome["status"]):
            continue
        now: float = yield _Now()
        restarts = [moment for moment in restarts if now - moment < period] + [now]
        if len(restarts) > intensity:
            for other in list(running):
                yield from stop(other)
            error = outcome["error"] or {}
            raise SupervisorEscalationError(
                f"restart intensity exceeded: {len(restarts)} restarts within {period}s "
                f"(at most {intensity}); last: child {name!r} {outcome['status']}"
                + (f" with {error.get('type')}: {error.get('message')}" if error else "")
            )
        if strategy == "one_for_one":
            group = [spec]
        elif strategy == "one_for_all":
            group = [s for s in specs if s.name in running or s.name == name]
        else:
            group = [s for s in specs[order[name] :] if s.name in running or s.name == name]
        again = [member for member in group if member.name == name]
        for member in group:
            if member.name in running and (yield from stopped(member.name)):
                again.append(member)
        for member in sorted(again, key=lambda spec: order[spec.name]):
            attempts[member.name] += 1
            yield from launch(member)
    return {name: {**view, "attempts": attempts[name] + 1} for name, view in sorted(last.items())}


@attrs.frozen
class ChildView:
    """A supervised child as its journals show it."""

    name: str
    id: str
    flow: str
    status: Status
    restarts: int
    last_error: str | None


def supervision(engine: Engine, supervisor_id: str) -> list[ChildView]:
    """The supervisor's view of its children, projected from the children's journals.

    Returns:
        One ChildView per child name: its latest execution, how often it was
        restarted, and the last error any of its executions ended with.
    """
    latest: dict[str, tuple[int, Execution]] = {}
    errors: dict[str, tuple[int, str]] = {}
    for child in engine.executions(prefix=f"{supervisor_id}/"):
        found = ChildId.parse(child.id)
        if found is None or found.supervisor != supervisor_id:
            continue  # a grandchild, or a child started without supervision
        name, attempt = found.name, found.attempt
        if attempt >= latest.get(name, (-1, child))[0]:
            latest[name] = (attempt, child)
        if child.error is not None and attempt >= errors.get(name, (-1, ""))[0]:
            errors[name] = (attempt, f"{child.error.type}: {child.error.message}")
    return [
        ChildView(name, child.id, child.flow, child.status, attempt, errors.get(name, (0, None))[1])
        for name, (attempt, child) in sorted(latest.items())
    ]


def format_supervision(views: Sequence[ChildView]) -> str:
    """A table of `supervision(...)` for people."""
    header = f"{'child':<16} {'status':<10} {'restarts':>8}  {'flow':<16} last error"
    rows = [
        f"{v.name:<16} {v.status.value:<10} {v.restarts:>8}  {v.flow:<16} {v.last_error or '-'}"
        for v in views
    ]
    return "\n".join([header, *rows])
