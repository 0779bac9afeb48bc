"""Loom's kernel: durable execution for Python, embedded, on a pluggable journal.

The public surface is what `__all__` lists; every `_module` behind it is private.
"""

from loom_kernel._canonical import DEFAULT_MAX_DEPTH, stable_hash, stable_stringify
from loom_kernel._codec import CONVERTER, decode_event, encode_event, register_upcaster
from loom_kernel._errors import (
    CanonicalJSONError,
    ConflictError,
    InvalidArgumentError,
    InvalidIdError,
    LoomError,
    NotFoundError,
    SchemaError,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
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
from loom_kernel._ids import MAX_ID_LENGTH, validate_prefix, validate_stream_id
from loom_kernel._journal import JournalStore, NewRecord, Record
from loom_kernel._memory_store import MemoryStore
from loom_kernel._reachability import reachable
from loom_kernel._registry import installed_stores, open_store, register_store

__all__ = [
    "CONVERTER",
    "DEFAULT_MAX_DEPTH",
    "EVENT_SCHEMA",
    "MAX_ID_LENGTH",
    "PINNED",
    "CanonicalJSONError",
    "ConflictError",
    "ErrorInfo",
    "Event",
    "ExecutionCancelled",
    "ExecutionCompleted",
    "ExecutionFailed",
    "ExecutionMigrated",
    "ExecutionResumed",
    "ExecutionStarted",
    "ExecutionSuspended",
    "InvalidArgumentError",
    "InvalidIdError",
    "JournalStore",
    "LoomError",
    "MemoryStore",
    "NewRecord",
    "NotFoundError",
    "Record",
    "SchemaError",
    "StepCompleted",
    "StepFailed",
    "StoreUnavailableError",
    "StreamDeletedError",
    "TrimmedError",
    "decode_event",
    "encode_event",
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
