"""What a drive needs from the engine that hosts it, and what the two share while it runs.

The replay layer never imports the engine or the coordination streams: the engine
hands each drive a `Host`, a record of the store, the clock and the few calls a
context makes beyond its own journal (a timer's hint, a look into the inbox, a
published value), and a `DriveControl` it can stop the drive through.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Final

import attrs

from loom_kernel._core import ExecutionState, LoomError, NewRecord
from loom_kernel._replay._flows import RetryPolicy
from loom_kernel._replay._tracing import DriveSpan, Tracing
from loom_kernel._replay._waits import Message
from loom_kernel._spi import JournalStore

__all__ = ["RELEASE", "DriveControl", "Host", "Unwind"]


class Counters:
    """What an engine's drives have done since it was made (read by
    `loom_kernel.otel.instrument_metrics`): plain ints, bumped where it happens.

    Attributes:
        steps: step attempts run (a replayed step runs nothing and is not counted).
        takeovers: runs claimed from another worker that had stopped renewing.
    """

    __slots__ = ("steps", "takeovers")

    def __init__(self) -> None:
        self.steps = 0
        self.takeovers = 0


@attrs.frozen
class Host:
    """What a context needs from the engine that drives it.

    Attributes:
        engine: the engine itself, for `ctx.engine` (starting other flows from a step).
        store: the journal store.
        clock: the injected clock.
        sleep: waits between a sync step's retries.
        async_sleep: waits between an async step's retries, without blocking the loop.
        retry: the default retry policy.
        worker_id: who the engine is in the journal (the `by` of the resumes a drive
            journals itself: a timer that is due at once, a message already there).
        lease_in_doubt: whether the engine's lease may have run out (no renewal for
            half a lease): a drive then looks at the journal's head before its next
            step, even on a store where that costs a request.
        add_timer: writes the hint of a timer gate (execution id, gate, wake time),
            before the suspend that it points at.
        next_message: the first message in a run's inbox on one of `topics` that is
            not among the positions it consumed (the run's state, topics, consumed).
        publish: publishes a value of `ctx.set_event` (the run's state, key, value).
        tracing: makes the spans of drives and steps (`loom_kernel.otel`), if any.
        counters: the engine's counts of what its drives did.
    """

    engine: Any
    store: JournalStore
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    async_sleep: Callable[[float], Awaitable[None]]
    retry: RetryPolicy
    worker_id: Callable[[], str]
    lease_in_doubt: Callable[[], bool]
    add_timer: Callable[[str, int, float], None]
    next_message: Callable[[ExecutionState, tuple[str | None, ...], set[int]], Message | None]
    publish: Callable[[ExecutionState, str, Any], None]
    tracing: Tracing | None = None
    counters: Counters = attrs.Factory(Counters)


#: Set by a worker around the drives it makes: once the event is set (the worker is
#: stopping and its grace is over), every drive made under it stops before its next
#: step, nested drives (a listener resuming a parent) included.
RELEASE: Final[contextvars.ContextVar[threading.Event | None]] = contextvars.ContextVar(
    "loom_release", default=None
)


class DriveControl:
    """What an engine and a drive in progress share.

    Attributes:
        stopped: true once a cancel's record is journaled (or the worker that made
            the drive released it), so the run stops before its next step even on a
            store whose head the context does not look at.
        pending: records already folded into the run's state but not yet journaled
            (a resume): they are journaled with the drive's first new work, so a
            replay that diverges before any journals nothing.
        replay_only: a replay-check: the drive stops, as if parked, at the first new
            work, having written nothing and run no new step.
        span: the drive's span, where the engine has a tracer.
    """

    __slots__ = ("_release", "_stopped", "pending", "replay_only", "span")

    def __init__(
        self, pending: list[NewRecord] | None = None, *, replay_only: bool = False
    ) -> None:
        self._stopped = False
        self._release = RELEASE.get()
        self.pending: list[NewRecord] = pending or []
        self.replay_only = replay_only
        self.span: DriveSpan | None = None

    @property
    def stopped(self) -> bool:
        release = self._release
        return self._stopped or (release is not None and release.is_set())

    @stopped.setter
    def stopped(self, value: bool) -> None:
        self._stopped = value


class Unwind(BaseException):
    """Internal: stops a flow's code. A BaseException so `except Exception` cannot swallow it.

    `error` is None when the run parked at a gate; otherwise the kernel error the
    caller gets (another writer moved the journal, non-determinism, a store fault).
    """

    def __init__(self, error: LoomError | None = None) -> None:
        super().__init__(error)
        self.error = error
