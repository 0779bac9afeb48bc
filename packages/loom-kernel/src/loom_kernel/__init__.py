"""Loom's kernel: durable execution for Python, embedded, on a pluggable journal.

    from loom_kernel import Engine, flow, open_store

The root is what flow authors use: the engine, flows and their context, the views
of a run, and the error tree. Store authors import `loom_kernel.spi`; tools that read
journals import `loom_kernel.events`; tests import `loom_kernel.testing`. Every
`_module` behind them is private.
"""

from loom_kernel._coordination._queues import Queue, QueueView, Rate
from loom_kernel._core._errors import (
    CanonicalJSONError,
    CodeVersionError,
    ConflictError,
    ExecutionEndedError,
    ExecutionNotFoundError,
    GateTimeoutError,
    InvalidArgumentError,
    InvalidIdError,
    LoomError,
    NonDeterminismError,
    NotFoundError,
    NotSuspendedError,
    ResultTimeoutError,
    RunBusyError,
    RunFinishedError,
    SchemaError,
    StepFailedError,
    StoreMisconfiguredError,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
    UnknownFlowError,
    publish_errors,
)
from loom_kernel._core._reachability import reachable
from loom_kernel._core._state import ExecutionState, Gate, Status, StepFrame
from loom_kernel._engine._facade import Engine, Listener
from loom_kernel._engine._handles import RunHandle
from loom_kernel._engine._retention import Retention, RetentionSweep
from loom_kernel._engine._views import (
    Execution,
    HistoryEntry,
    InboxMessage,
    RunSummary,
    SentKey,
)
from loom_kernel._hosting._worker import Worker, WorkerStats
from loom_kernel._replay._async_context import AsyncContext
from loom_kernel._replay._context import Context
from loom_kernel._replay._flows import NO_RETRY, Flow, RetryPolicy, code_hash, flow
from loom_kernel._replay._waits import Woken
from loom_kernel._spi._blobs import BlobNotFoundError
from loom_kernel._spi._memory_store import MemoryStore
from loom_kernel._spi._registry import installed_stores, open_store

__all__ = [
    "NO_RETRY",
    "AsyncContext",
    "BlobNotFoundError",
    "CanonicalJSONError",
    "CodeVersionError",
    "ConflictError",
    "Context",
    "Engine",
    "Execution",
    "ExecutionEndedError",
    "ExecutionNotFoundError",
    "ExecutionState",
    "Flow",
    "Gate",
    "GateTimeoutError",
    "HistoryEntry",
    "InboxMessage",
    "InvalidArgumentError",
    "InvalidIdError",
    "Listener",
    "LoomError",
    "MemoryStore",
    "NonDeterminismError",
    "NotFoundError",
    "NotSuspendedError",
    "Queue",
    "QueueView",
    "Rate",
    "ResultTimeoutError",
    "Retention",
    "RetentionSweep",
    "RetryPolicy",
    "RunBusyError",
    "RunFinishedError",
    "RunHandle",
    "RunSummary",
    "SchemaError",
    "SentKey",
    "Status",
    "StepFailedError",
    "StepFrame",
    "StoreMisconfiguredError",
    "StoreUnavailableError",
    "StreamDeletedError",
    "TrimmedError",
    "UnknownFlowError",
    "Woken",
    "Worker",
    "WorkerStats",
    "code_hash",
    "flow",
    "installed_stores",
    "open_store",
    "reachable",
]

publish_errors(__name__, [globals()[name] for name in __all__])
