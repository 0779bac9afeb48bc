"""The engine: a small facade (`Engine`) over parts with one job each (the driver, starts,
enqueueing, delivery, recovery, versions, reading), plus run handles, views and
listeners. It imports every layer below it; the hosting layer reaches its parts
through `parts_of`, never through a private member of `Engine`.
"""

from loom_kernel._engine._driver import DRIVE_WATCH, Driver
from loom_kernel._engine._each import raise_first, try_each
from loom_kernel._engine._enqueueing import LocalSlots, QueuedDrive
from loom_kernel._engine._facade import Engine, EngineParts, Listener, parts_of
from loom_kernel._engine._handles import RunHandle
from loom_kernel._engine._recovery import NOT_STARTED
from loom_kernel._engine._retention import Retention, RetentionSweep
from loom_kernel._engine._views import (
    Execution,
    HistoryEntry,
    InboxMessage,
    RunSummary,
    SentKey,
)

__all__ = [
    "DRIVE_WATCH",
    "NOT_STARTED",
    "Driver",
    "Engine",
    "EngineParts",
    "Execution",
    "HistoryEntry",
    "InboxMessage",
    "Listener",
    "LocalSlots",
    "QueuedDrive",
    "Retention",
    "RetentionSweep",
    "RunHandle",
    "RunSummary",
    "SentKey",
    "parts_of",
    "raise_first",
    "try_each",
]
