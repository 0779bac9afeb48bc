"""Loom's kernel: durable execution for Python, embedded, on a pluggable journal.

The public surface is what `__all__` lists; every `_module` behind it is private.
"""

from loom_kernel._canonical import DEFAULT_MAX_DEPTH, stable_hash, stable_stringify
from loom_kernel._codec import (
    CONVERTER,
    decode_event,
    decode_events,
    encode_event,
    register_upcaster,
)
from loom_kernel._context import AsyncContext, Context
from loom_kernel._engine import Engine
from loom_kernel._errors import (
    CanonicalJSONError,
    ConflictError,
    ExecutionNotFoundError,
    InvalidArgumentError,
    InvalidIdError,
    LoomError,
    NonDeterminismError,
    NotFoundError,
    NotSuspendedError,
    SchemaError,
    StepFailedError,
    StoreMisconfiguredError,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
    UnknownFlowError,
    publish_errors,
)
from loom_kernel._events import (
    EVENT_SCHEMA,
    PINNED,
    ErrorInfo,
    Event,
    ExecutionCancelled,
    ExecutionCompleted,
    ExecutionFailed,
    ExecutionMigrated,
    ExecutionResumed,
    ExecutionStarted,
    ExecutionSuspended,
    StepCompleted,
    StepFailed,
    known_event_types,
)
from loom_kernel._faults import Fault
from loom_kernel._flows import Flow, RetryPolicy, code_hash, flow
from loom_kernel._ids import MAX_ID_LENGTH, validate_prefix, validate_stream_id
from loom_kernel._journal import JournalStore, NewRecord, Record
from loom_kernel._listeners import Listener
from loom_kernel._memory_store import MemoryStore
from loom_kernel._reachability import reachable
from loom_kernel._registry import installed_stores, open_store, register_store
from loom_kernel._state import ExecutionState, Gate, Status, StepFrame, fold
from loom_kernel._views import Execution, HistoryEntry

__all__ = [
    "CONVERTER",
    "DEFAULT_MAX_DEPTH",
    "EVENT_SCHEMA",
    "MAX_ID_LENGTH",
    "PINNED",
    "AsyncContext",
    "CanonicalJSONError",
    "ConflictError",
    "Context",
    "Engine",
    "ErrorInfo",
    "Event",
    "Execution",
    "ExecutionCancelled",
    "ExecutionCompleted",
    "ExecutionFailed",
    "ExecutionMigrated",
    "ExecutionNotFoundError",
    "ExecutionResumed",
    "ExecutionStarted",
    "ExecutionState",
    "ExecutionSuspended",
    "Fault",
    "Flow",
    "Gate",
    "HistoryEntry",
    "InvalidArgumentError",
    "InvalidIdError",
    "JournalStore",
    "Listener",
    "LoomError",
    "MemoryStore",
    "NewRecord",
    "NonDeterminismError",
    "NotFoundError",
    "NotSuspendedError",
    "Record",
    "RetryPolicy",
    "SchemaError",
    "Status",
    "StepCompleted",
    "StepFailed",
    "StepFailedError",
    "StepFrame",
    "StoreMisconfiguredError",
    "StoreUnavailableError",
    "StreamDeletedError",
    "TrimmedError",
    "UnknownFlowError",
    "code_hash",
    "decode_event",
    "decode_events",
    "encode_event",
    "flow",
    "fold",
    "installed_stores",
    "known_event_types",
    "open_store",
    "reachable",
    "register_store",
    "register_upcaster",
    "stable_hash",
    "stable_stringify",
    "validate_prefix",
    "validate_stream_id",
]

publish_errors(__name__, [globals()[name] for name in __all__])
