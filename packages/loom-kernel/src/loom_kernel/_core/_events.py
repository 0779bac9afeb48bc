"""The event kinds of an execution's journal, and the schema version they are written under.

Adding a kind, or a fold key derived from existing events, is a minor bump of
EVENT_SCHEMA; changing an existing payload's meaning is a major one. PINNED is
the reviewed list of kinds: a test holds known_event_types() equal to it, so a
new kind is always a conscious change.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

import attrs

__all__ = [
    "EVENT_SCHEMA",
    "PINNED",
    "ErrorInfo",
    "Event",
    "ExecutionCancelled",
    "ExecutionClaimed",
    "ExecutionCompleted",
    "ExecutionDeleted",
    "ExecutionFailed",
    "ExecutionMigrated",
    "ExecutionResumed",
    "ExecutionStarted",
    "ExecutionSuspended",
    "QueuePlace",
    "StepCompleted",
    "StepFailed",
    "error_info",
    "event_class",
    "known_event_types",
]

EVENT_SCHEMA: Final = "1.21.0"


@attrs.frozen
class ErrorInfo:
    """An error as the journal keeps it: its type's qualified name and its message."""

    type: str
    message: str


def error_info(exc: BaseException) -> ErrorInfo:
    """An exception as the journal keeps it: qualified type name and message, never a pickle."""
    kind = type(exc)
    module = kind.__module__
    name = kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
    return ErrorInfo(type=name, message=str(exc))


@attrs.frozen
class QueuePlace:
    """Where a queued run waits: its queue, the queue's partition (a stream of its
    own), its priority (lower first) and its key (for a per-key limit), from 1.18.0."""

    name: str
    partition: int = 0
    priority: int = 0
    key: str | None = None


@attrs.frozen
class ExecutionStarted:
    """An execution began: the flow, the pinned hash of its code, its input, the
    worker that drives it (`by`, from 1.17.0), the queue whose workers alone drive it
    (`queue`, from 1.18.0), the run it starts again (`retry_of`, from 1.19.0:
    `Engine.fork`), and the trace context of its starter (`trace`, a W3C
    `traceparent`, from 1.20.0: `loom_kernel.otel`)."""

    KIND: ClassVar[str] = "EXECUTION_STARTED"
    flow: str
    code_hash: str
    input: Any
    key: str | None = None
    parent: str | None = None
    by: str | None = None
    queue: QueuePlace | None = None
    retry_of: str | None = None
    trace: str | None = None


@attrs.frozen
class StepCompleted:
    """The step at `index` (its call order) returned `result` after `attempts` tries."""

    KIND: ClassVar[str] = "STEP_COMPLETED"
    index: int
    name: str
    result: Any
    attempts: int = 1


@attrs.frozen
class StepFailed:
    """The step at `index` exhausted its retry policy; replay raises the same error."""

    KIND: ClassVar[str] = "STEP_FAILED"
    index: int
    name: str
    error: ErrorInfo
    attempts: int = 1


@attrs.frozen
class ExecutionSuspended:
    """The run parked at gate number `gate`, waiting on `on` (until `wake_at` for a timer)."""

    KIND: ClassVar[str] = "EXECUTION_SUSPENDED"
    gate: int
    on: str
    wake_at: float | None = None


@attrs.frozen
class ExecutionResumed:
    """A payload was delivered to the parked gate (`key` dedupes re-deliveries); `by`
    is the worker that drives the run on from there (from 1.17.0)."""

    KIND: ClassVar[str] = "EXECUTION_RESUMED"
    payload: Any
    key: str | None = None
    by: str | None = None


@attrs.frozen
class ExecutionClaimed:
    """Worker `by` took over a running run whose owner (`previous`) stopped renewing
    its lease; appended at the exact head, so one taker wins and the old owner's next
    append is refused."""

    KIND: ClassVar[str] = "EXECUTION_CLAIMED"
    by: str
    previous: str | None = None


@attrs.frozen
class ExecutionCompleted:
    """The flow returned `result`."""

    KIND: ClassVar[str] = "EXECUTION_COMPLETED"
    result: Any


@attrs.frozen
class ExecutionFailed:
    """The flow raised an error it did not catch."""

    KIND: ClassVar[str] = "EXECUTION_FAILED"
    error: ErrorInfo


@attrs.frozen
class ExecutionCancelled:
    """The run was cancelled; it never runs another step."""

    KIND: ClassVar[str] = "EXECUTION_CANCELLED"
    reason: str | None = None


@attrs.frozen
class ExecutionMigrated:
    """The run moved from one code hash to another after a replay check (audit entry)."""

    KIND: ClassVar[str] = "EXECUTION_MIGRATED"
    from_hash: str
    to_hash: str
    reason: str | None = None


@attrs.frozen
class ExecutionDeleted:
    """Retention deleted the run that ended before this record (from 1.21.0): a fold
    starts over here, as no run. A start with the run's id after it is a new run,
    number `generation` of that id, whose inbox and published values are streams of
    their own (the deleted run's are gone), so it never sees what the deleted run
    recorded (see docs/retention.md)."""

    KIND: ClassVar[str] = "EXECUTION_DELETED"
    generation: int
    reason: str | None = None


Event = (
    ExecutionStarted
    | StepCompleted
    | StepFailed
    | ExecutionSuspended
    | ExecutionResumed
    | ExecutionCompleted
    | ExecutionFailed
    | ExecutionCancelled
    | ExecutionMigrated
    | ExecutionClaimed
    | ExecutionDeleted
)

_CLASSES: Final[tuple[type[Any], ...]] = (
    ExecutionStarted,
    StepCompleted,
    StepFailed,
    ExecutionSuspended,
    ExecutionResumed,
    ExecutionCompleted,
    ExecutionFailed,
    ExecutionCancelled,
    ExecutionMigrated,
    ExecutionClaimed,
    ExecutionDeleted,
)
_BY_KIND: Final[dict[str, type[Any]]] = {cls.KIND: cls for cls in _CLASSES}

# Reviewed by hand: a change here is a schema change (see docs/schema.md).
PINNED: Final = frozenset(
    {
        "EXECUTION_STARTED",
        "STEP_COMPLETED",
        "STEP_FAILED",
        "EXECUTION_SUSPENDED",
        "EXECUTION_RESUMED",
        "EXECUTION_COMPLETED",
        "EXECUTION_FAILED",
        "EXECUTION_CANCELLED",
        "EXECUTION_MIGRATED",
        "EXECUTION_CLAIMED",
        "EXECUTION_DELETED",
    }
)


def known_event_types() -> frozenset[str]:
    """Return the kinds the kernel can decode, as defined by the event classes."""
    return frozenset(_BY_KIND)


def event_class(kind: str) -> type[Any] | None:
    """Return the event class of a kind, or None for a kind this kernel does not know."""
    return _BY_KIND.get(kind)
