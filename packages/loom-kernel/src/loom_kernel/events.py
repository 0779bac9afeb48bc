"""The journal's event layer: event kinds, schema governance, the codec and the fold.

    from loom_kernel.events import EVENT_SCHEMA, StepCompleted, decode_events, fold

For tools that read journals (a timeline, an export, a migration), and for schema
reviews (docs/schema.md). Flows never need it.
"""

from loom_kernel._core._canonical import DEFAULT_MAX_DEPTH, stable_hash, stable_stringify
from loom_kernel._core._codec import (
    CONVERTER,
    decode_event,
    decode_events,
    encode_event,
    register_upcaster,
)
from loom_kernel._core._events import (
    EVENT_SCHEMA,
    PINNED,
    ErrorInfo,
    Event,
    ExecutionCancelled,
    ExecutionClaimed,
    ExecutionCompleted,
    ExecutionDeleted,
    ExecutionFailed,
    ExecutionMigrated,
    ExecutionResumed,
    ExecutionStarted,
    ExecutionSuspended,
    QueuePlace,
    StepCompleted,
    StepFailed,
    known_event_types,
)
from loom_kernel._core._state import ExecutionState, Gate, Status, StepFrame, fold

__all__ = [
    "CONVERTER",
    "DEFAULT_MAX_DEPTH",
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
    "ExecutionState",
    "ExecutionSuspended",
    "Gate",
    "QueuePlace",
    "Status",
    "StepCompleted",
    "StepFailed",
    "StepFrame",
    "decode_event",
    "decode_events",
    "encode_event",
    "fold",
    "known_event_types",
    "register_upcaster",
    "stable_hash",
    "stable_stringify",
]
