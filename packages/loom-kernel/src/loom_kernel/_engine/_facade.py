"""The Engine: a small facade over the parts that drive flows against a store.

Each public call is one line into the part that owns it (see `EngineParts`); the
kernel's hosting layer (the worker, the CLI's tools) reaches those parts through
`parts_of`, never through a private member.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

import attrs

from loom_kernel._coordination import (
    DEFAULT_LEASE,
    MAX_LEASE,
    WORKERS_PREFIX,
    Queue,
    QueueView,
    compact,
)
from loom_kernel._core import (
    ExecutionState,
    InvalidArgumentError,
    Status,
    StepFrame,
    finite_number,
    stream_of,
    validate_stream_id,
)
from loom_kernel._engine._delivery import Delivery
from loom_kernel._engine._driver import Driver, Settings
from loom_kernel._engine._enqueueing import Enqueueing
from loom_kernel._engine._flow_book import FlowBook
from loom_kernel._engine._handles import RunHandle
from loom_kernel._engine._listeners import installed_listeners
from loom_kernel._engine._reading import Reading
from loom_kernel._engine._recovery import Recovery
from loom_kernel._engine._retention import Retention, RetentionSweep, Sweeper
from loom_kernel._engine._starts import Starts
from loom_kernel._engine._twins import async_twin
from loom_kernel._engine._versions import Versions
from loom_kernel._engine._views import (
    Execution,
    HistoryEntry,
    InboxMessage,
    RunSummary,
    SentKey,
)
from loom_kernel._replay import Flow, RetryPolicy, awaitable_sleep, in_a_thread
from loom_kernel._spi import JournalStore

__all__ = ["Engine", "EngineParts", "Listener", "parts_of"]

#: What `add_listener` takes: called with the engine and the view of a run that
#: parked or ended.
Listener = Callable[["Engine", Execution], None]


@attrs.frozen
class EngineParts:
    """The parts behind an engine's facade, each with one job (for the kernel's own
    hosting layer and named test seams; not a public API).

    Attributes:
        driver: checks runs out, locks, drives, appends, views; owns the config, the
            coordination streams a drive touches, the cache and the locks.
        starts: starts runs (K9).
        enqueueing: queues and the slots of this engine's workers; queued drives.
        delivery: resumes, messages, timers and cancels, and the drives on from them.
        recovery: runs left running, listeners to call again, the run index rebuilt.
        versions: replay checks and migrations (K11).
        reading: views, histories, listings, published values.
        sweeper: retention's sweeps.
    """

    driver: Driver
    starts: Starts
    enqueueing: Enqueueing
    delivery: Delivery
    recovery: Recovery
    versions: Versions
    reading: Reading
    sweeper: Sweeper


class Engine:
    """Drives flows: starts, resumes, cancels and recovers executions on a store.

    Every method is safe to call from many threads. Drives of the same execution
    (start, resume, a timer, recover) are serialised within one engine; reads and
    cancels never wait for a drive. Across engines and processes the store's
    expected-head rule decides: one writer wins, the other gets ConflictError. Every
    call that reads or writes the store has an `_async` twin for `async def` callers
    (`start_async`, `get_async`, ...; see docs/running.md).

    Args:
        store: the journal store.
        flows: the flows this engine can run (Flow objects or plain functions).
        clock: returns the time in epoch seconds; inject a fake one in tests.
        sleep: waits between a sync step's retries; inject a no-op in tests.
        async_sleep: waits between an async step's retries; by default
            `asyncio.sleep` when `sleep` is `time.sleep`, else `sleep` itself (so one
            injected no-op serves both).
        retry: the default step retry policy.
        cache_size: how many folded executions to keep in memory.
        listeners: called when a run parks or ends (see `add_listener`); by default,
            every listener installed in the `loom.listeners` entry-point group (so
            installing loom-orchestration makes every engine deliver child outcomes).
        worker_id: who this engine is in the journal (the owner of the runs it
            drives); by default unique per engine and process,
            `<host>.<boot id>.<pid namespace>:<pid>:<nonce>`. A configured id must be
            unique among the processes alive at once.
        lease: seconds this engine may go without renewing its lease (it renews
            every third of it while it drives) before another worker's `recover()`
            may take its running runs over; see docs/running.md.
        queues: the queues `enqueue(..., queue=name)` may put runs on, and whose
            limits this engine's workers keep; see docs/queues.md.
        retention: which ended runs the store keeps: this engine's workers sweep the
            rest every `retention.every` seconds (see `gc` and docs/retention.md).
            None (the default) keeps every run.
    """

    def __init__(
        self,
        store: JournalStore,
        flows: Iterable[Flow | Callable[..., Any]] = (),
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        async_sleep: Callable[[float], Awaitable[None]] | None = None,
        retry: RetryPolicy | None = None,
        cache_size: int = 1024,
        listeners: Iterable[Listener] | None = None,
        worker_id: str | None = None,
        lease: float = DEFAULT_LEASE,
        queues: Iterable[Queue] = (),
        retention: Retention | None = None,
    ) -> None:
        if retention is not None and not isinstance(retention, Retention):
            raise InvalidArgumentError(f"retention is a Retention or None, not {retention!r}")
        self.retention = retention
        if not finite_number(lease) or not 0 < lease <= MAX_LEASE:
            raise InvalidArgumentError(
                f"a lease is a number of seconds above 0 and at most {MAX_LEASE:.0f}, not {lease!r}"
            )
        settings = Settings(
            store,
            clock,
            sleep,
            async_sleep or (asyncio.sleep if sleep is time.sleep else awaitable_sleep(sleep)),
            retry or RetryPolicy(),
            float(lease),
            worker_id,
            cache_size,
        )
        self._flows = FlowBook()
        chosen = installed_listeners() if listeners is None else listeners
        driver = Driver(self, settings, self._flows, chosen)
        validate_stream_id(WORKERS_PREFIX + driver.worker_id)
        starts = Starts(driver)
        enqueueing = Enqueueing(driver, starts, queues)
        delivery = Delivery(driver, enqueueing)
        recovery = Recovery(driver, enqueueing, delivery)
        versions = Versions(driver, enqueueing)
        reading = Reading(driver)
        self._parts = EngineParts(
            driver, starts, enqueueing, delivery, recovery, versions, reading, Sweeper(driver)
        )
        for item in flows:
            self.register(item)

    # -- configuration ------------------------------------------------------------

    @property
    def store(self) -> JournalStore:
        """The journal store."""
        return self._parts.driver.store

    @property
    def clock(self) -> Callable[[], float]:
        """The clock (epoch seconds)."""
        return self._parts.driver.clock

    @property
    def sleep(self) -> Callable[[float], None]:
        """How a sync step waits between its attempts (settable: drives that begin
        from then on use the new one)."""
        return self._parts.driver.settings.sleep

    @sleep.setter
    def sleep(self, sleep: Callable[[float], None]) -> None:
        self._parts.driver.configure(sleep=sleep)

    @property
    def async_sleep(self) -> Callable[[float], Awaitable[None]]:
        """How an async step waits between its attempts (settable, as `sleep`)."""
        return self._parts.driver.settings.async_sleep

    @async_sleep.setter
    def async_sleep(self, async_sleep: Callable[[float], Awaitable[None]]) -> None:
        self._parts.driver.configure(async_sleep=async_sleep)

    @property
    def retry(self) -> RetryPolicy:
        """The default step retry policy (settable, as `sleep`)."""
        return self._parts.driver.settings.retry

    @retry.setter
    def retry(self, retry: RetryPolicy) -> None:
        self._parts.driver.configure(retry=retry)

    @property
    def lease(self) -> float:
        """Seconds this engine may go without renewing its lease (see `Engine`)."""
        return self._parts.driver.lease

    @property
    def worker_id(self) -> str:
        """Who this engine is in the journal: the configured id, or one made for this
        process (a process forked from it gets its own)."""
        return self._parts.driver.worker_id

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(engine, execution)` whenever a run parks or ends here.

        Listeners run after the journal append that parked or ended the run, outside
        the engine's per-execution locks, and `recover()` calls them again for every
        parked or ended run, so a listener that a crash cut short gets another chance:
        write listeners to be idempotent. A LoomError a listener raises is swallowed
        (the next recover retries it); any other error propagates.

        Deliveries never nest: a run that a listener parks or ends is delivered to
        the listeners after the current delivery returns, in the same call, so a
        chain of any length (200 children finishing in turn) runs in a loop.
        """
        self._parts.driver.listeners.add(listener)

    # -- flows ----------------------------------------------------------------------

    def register(self, item: Flow | Callable[..., Any], *, newest: bool = True) -> Flow:
        """Make a flow startable by name; a plain function is wrapped with `@flow`.

        Registering another version of a registered name (another `version=`, or
        changed source) hosts both: each run is driven on the code it is pinned to,
        and new runs start on the version registered last, unless it was registered
        with `newest=False` (an old version kept for its runs).

        Raises:
            InvalidArgumentError: another code is registered under this flow's name
                and version.
        """
        return self._flows.register(item, newest=newest)

    def hosts(self, name: str) -> bool:
        """Whether any version of flow `name` is registered here."""
        return self._flows.hosts(name)

    def newest(self, name: str) -> Flow:
        """The version of flow `name` that new runs start on (the one registered last).

        Raises:
            UnknownFlowError: no version of it is registered.
        """
        return self._flows.newest(name)

    @staticmethod
    def stream_of(execution_id: str) -> str:
        """The journal stream of an execution.

        Raises:
            InvalidIdError: the id is not a valid stream id.
        """
        return stream_of(execution_id)

    # -- starting -------------------------------------------------------------------

    def start(
        self,
        flow_name: str | Flow,
        input: Any = None,
        *,
        key: str | None = None,
        parent: str | None = None,
    ) -> Execution:
        """Start an execution and run it until it parks or ends.

        Returns the run's view then. If another worker took the run over during the
        drive (this engine's lease lapsed: a frozen process, say), the drive stops
        at its next append, and the view says so: status running, `owner` naming
        the worker that took it over, `owner_seen_at` set (and a warning is logged).

        Args:
            flow_name: a registered flow's name, or the Flow itself.
            input: the flow's input; must have a JSON form.
            key: idempotency key, used as the execution id: a second start with the
                same key returns the existing execution, whatever its status, and runs
                nothing (even when processes race).
            parent: the id of the execution starting this one, if any.

        Raises:
            UnknownFlowError: no such flow is registered.
            InvalidArgumentError: the input is not JSON.
            InvalidIdError: the key is not a valid id.
        """
        return self._parts.starts.start(flow_name, input, key, parent)

    def enqueue(
        self,
        flow_name: str | Flow,
        input: Any = None,
        *,
        key: str | None = None,
        parent: str | None = None,
        queue: str | None = None,
        priority: int = 0,
        queue_key: str | None = None,
    ) -> RunHandle:
        """Start an execution without driving it: a worker (`Worker`, `loom worker`)
        drives it. Returns at once, with a handle to wait for its result.

        With `queue`, the run waits on that queue of this engine (see docs/queues.md):
        only workers drive it, as the queue's limits allow, lower `priority` first
        (then in arrival order); `queue_key` names the key its per-key limit counts
        (a customer, say). A wake of the parked run (a resume, a message, a timer, a
        child) journals the wake and has it wait on the queue again.

        When a `Worker` of this engine has a free slot, the run starts as this
        engine's own (as `start` would) and that slot drives it at once, with no
        poll and no claim; with every slot busy, it starts as this engine's own and
        waits in a worker's queue (see docs/running.md: let go for any worker after a
        second). Past the queue's bound, or with no worker here, it is journaled with
        no owner, and the first worker to claim it drives it (`recover()` too).
        Arguments and errors are those of `start`; starting with an existing key
        returns a handle to the existing run (K9).

        Raises:
            InvalidArgumentError: no such queue on this engine, a priority that is not
                a 32-bit int, a queue key that is not a non-empty str, or a priority
                or queue key without a queue.
        """
        return self._parts.enqueueing.enqueue(
            flow_name, input, key, parent, queue=queue, priority=priority, queue_key=queue_key
        )

    def dispatch(
        self,
        flow_name: str | Flow,
        input: Any = None,
        *,
        key: str | None = None,
        parent: str | None = None,
    ) -> RunHandle:
        """Start a run where this engine drives it soonest: on a `Worker` of this
        engine when one runs (a free slot, or its queue, as `enqueue` hands it), else
        inline, as `start` does, until it parks or ends. How a parent starts its
        children (`loom_orchestration.start_child`). Arguments and errors are those of
        `start`; an existing key gives a handle to the existing run (K9)."""
        return self._parts.enqueueing.dispatch(flow_name, input, key, parent)

    def fork(self, execution_id: str, *, from_step: int = 0, key: str | None = None) -> Execution:
        """Start a run that ended (failed, cancelled or completed) again, as a new run:
        the same flow (its newest version here; by name, for a worker, where this engine
        has no code for it), the same input, and `retry_of` naming the old run in its
        start (and its view). With `from_step`, the old run's first `from_step` step
        outcomes are journaled into the new run as they are and not run again (DBOS's
        fork): the new run replays them, and runs from the next. Driven here until it
        parks or ends, as `start` (with a `key`, a K9 start: the same key again
        returns that run).

        Raises:
            ExecutionNotFoundError: there is no such run.
            InvalidArgumentError: the run has not ended; `from_step` is negative, or
                its first `from_step` steps are not all its own steps before its first
                gate, timer, message or end (a published value or a child's start is
                never reused), or its journal was compacted below them.
        """
        return self._parts.starts.fork(execution_id, from_step, key)

    def handle(self, execution_id: str) -> RunHandle:
        """A handle to an existing run, to wait for its result.

        Raises:
            InvalidIdError: the id is not a valid execution id.
        """
        stream_of(execution_id)
        return RunHandle(self._parts.driver, execution_id)

    # -- delivering -----------------------------------------------------------------

    def resume(
        self,
        execution_id: str,
        payload: Any = None,
        *,
        key: str | None = None,
        on: str | None = None,
    ) -> Execution:
        """Deliver `payload` to the gate the run is parked at, then run it on. An engine
        without the run's flow code (a web tier, `loom resume`) journals the resume with
        no owner and leaves the drive to a worker (the run index has every worker look at
        the run at once); the view it returns is the run's, running.

        Args:
            execution_id: the execution.
            payload: what the gate's `ctx.suspend` returns; must have a JSON form.
            key: dedupe key: a resume whose key was already delivered does nothing and
                returns the execution, so a re-delivered notice never feeds a later gate.
            on: the gate the caller means; when the run is parked at another gate,
                the resume is refused instead of feeding that one. A run parked at
                `ctx.wait_first(gates=...)` takes a resume on one of those gates
                (`on` may be left out when it waits on one gate only).

        Raises:
            ExecutionNotFoundError: no such execution.
            NotSuspendedError: the run is not parked at a gate (running, finished,
                asleep on a timer, or waiting for a message only: `send` delivers
                those); nothing is buffered (`send` is the call that buffers).
            ConflictError: another writer resumed or moved the run first.
            InvalidArgumentError: the payload is not JSON, or the key is not a str (or
                is one of the kernel's own: `timer:...`, `loom....`).
        """
        return self._parts.delivery.resume(execution_id, payload, key, on)

    def send(
        self,
        execution_id: str,
        message: Any = None,
        *,
        topic: str | None = None,
        key: str | None = None,
        drive: bool = True,
    ) -> int:
        """Send a message to a run: journaled in its inbox whether it waits for one,
        is busy, or has not reached its `ctx.receive` yet; it waits there, in send
        order, until the run reads it. A run parked at a receive (or a `wait_first`)
        on that topic is woken and driven on here, as `resume` would (or, with
        `drive=False`, by a worker).

        Args:
            execution_id: the execution.
            message: the message; must have a JSON form.
            topic: its topic (None: the default topic).
            key: dedupe key: a message sent again with the same key (from any process)
                is never delivered twice; a resend is a no-op that returns the first
                one's position, even once the run has finished.
            drive: False to return at once: a run waiting for the message is left to
                the workers (the run index has every worker look at it now).

        Returns:
            The message's position in the run's inbox.

        Raises:
            ExecutionNotFoundError: no such execution.
            RunFinishedError: the run has finished (nothing sent), or finished while
                the message was being sent, without reading it.
            InvalidArgumentError: the message is not JSON, or the topic or key is not
                a non-empty str.
            InvalidIdError: the id is not a valid execution id.
        """
        return self._parts.delivery.send(execution_id, message, topic, key, drive)

    def cancel(self, execution_id: str, reason: str | None = None) -> Execution:
        """End a run: it never starts another step. Cancelling a finished run changes nothing.

        A cancel does not wait for a drive in progress: it journals the cancel at
        once, and the drive stops before its next step, whichever engine or thread
        of this process runs it (a step already running finishes, and its result is
        not journaled). A drive in another process stops there too, unless the step
        begins within a millisecond of its last append (or its store's heads cost a
        request, as on S3): then the step runs and its append is refused.
        """
        return self._parts.delivery.cancel(execution_id, reason)

    def fire_due_timers(self) -> list[str]:
        """Wake every run whose timer is due by the engine's clock.

        A run that cannot be woken (its flow diverged from its journal, say), or a
        damaged timer record, does not stop the others: every due timer is tried,
        then the first error is raised.

        Returns:
            The ids of the executions it woke.
        """
        return self._parts.delivery.fire_due_timers()

    def recover(self, execution_id: str | None = None) -> list[str]:
        """Drive every run left running (by a crash, or a process that stopped mid-run),
        and call the listeners again for every run still open (parked, or ended with a
        listener not yet run to the end). With `execution_id`, that run only: driven
        if it is left running (no owner, or one gone for a lease) and this engine has
        its code, its listeners called again; a run another live worker drives is left
        to it.

        The runs are found through the run index, so the cost is the runs still open,
        however many have finished. On a store indexed by no engine yet (one written
        by Loom before 1.18), or with a damaged index record, every journal is listed
        instead, and the index is rewritten from them.

        A run that cannot be loaded or driven (a damaged journal, or code that
        diverged from it) does not stop the others: every run is tried and each
        failure logged, then the first is raised.

        Returns:
            The ids of the executions it drove.

        Raises:
            ExecutionNotFoundError: with `execution_id`, there is no such run.
        """
        if execution_id is not None:
            return self._parts.recovery.recover_one(execution_id)
        return self._parts.recovery.recover()

    def gc(self, retention: Retention | None = None, *, dry_run: bool = False) -> RetentionSweep:
        """Delete the ended runs past `retention` (by default the engine's), at most
        `retention.batch` of them: each leaves one EXECUTION_DELETED record in its
        journal, and a start with its id afterwards is a new run that never sees what
        the deleted one recorded (see docs/retention.md). Workers call it every
        `retention.every` seconds.

        Args:
            retention: what to keep; the engine's `retention` when None.
            dry_run: only say what would be deleted.

        Raises:
            InvalidArgumentError: no retention given, and the engine has none.
        """
        chosen = retention if retention is not None else self.retention
        if not isinstance(chosen, Retention):
            raise InvalidArgumentError(
                "gc needs a Retention: pass one, or give the engine one (Engine(..., "
                "retention=Retention(keep_for=...)))"
            )
        return self._parts.sweeper.sweep(chosen, dry_run=dry_run)

    # -- reading --------------------------------------------------------------------

    def get(self, execution_id: str) -> Execution:
        """The execution's current view; for a running run, who drives it and when that
        worker was last seen, so a crash (seen longer ago than a lease) and a run
        driven elsewhere are different answers.

        Raises:
            ExecutionNotFoundError: no such execution.
        """
        return self._parts.driver.execution(execution_id)

    def state(self, execution_id: str) -> ExecutionState:
        """A copy of the execution's full folded state (frames, gates, variables)."""
        return self._parts.reading.state(execution_id)

    def frames(self, execution_id: str) -> Mapping[int, StepFrame]:
        """The execution's recorded steps by call index, read-only.

        A shallow copy (frames are not copied), so it is cheap and a run driven
        meanwhile does not change it under the caller.
        """
        return self._parts.reading.frames(execution_id)

    def history(self, execution_id: str) -> list[HistoryEntry]:
        """The decoded journal (if the run was compacted: from the last record its
        latest snapshot covers on)."""
        return self._parts.reading.history(execution_id)

    def executions(
        self,
        prefix: str = "",
        *,
        status: Status | str | Iterable[Status | str] | None = None,
        flow: str | None = None,
    ) -> Iterator[Execution]:
        """The executions in the store whose id starts with `prefix`, in id order;
        with `status` or `flow`, only those (answered from the run index: the cost is
        the runs that match and the runs still open, not every run in the store).

        Args:
            prefix: an id prefix.
            status: one status or several ("failed", Status.FAILED, or a list).
            flow: a flow name.

        Raises:
            InvalidIdError: the prefix breaks the id rules.
            InvalidArgumentError: an unknown status.
            SchemaError: a journal cannot be folded (the listing stops there; `recover`
                and `loom ls` go on past it and report it).
        """
        return self._parts.reading.listing(prefix, status, flow)

    def runs(
        self,
        prefix: str = "",
        *,
        status: Status | str | Iterable[Status | str] | None = None,
        flow: str | None = None,
        since: float | datetime | None = None,
        limit: int | None = None,
    ) -> list[RunSummary]:
        """The runs in the store, newest start first: what a listing shows of each
        (status, flow, start and end times, gate, parent), read from the run index for
        an ended run and from its journal only for an open one, so it costs the runs
        still open, not every journal (`loom ls` and the web view use it; `executions`
        gives whole views and reads every journal it lists).

        Args:
            prefix: an id prefix.
            status: one status or several ("failed", Status.FAILED, or a list).
            flow: a flow name.
            since: only runs started at or after it (Unix seconds, or an aware
                datetime); a run whose start is not known is left out.
            limit: at most this many (the newest).

        Raises:
            InvalidIdError: the prefix breaks the id rules.
            InvalidArgumentError: an unknown status, a bad `since` or `limit`.
            SchemaError: an open run's journal cannot be folded.
        """
        return self._parts.reading.runs(prefix, status=status, flow=flow, since=since, limit=limit)

    def get_event(self, execution_id: str, key: str, timeout: float | None = None) -> Any:
        """The latest value a run published under `key` (`ctx.set_event`), read without
        its journal; None if it has published none.

        Args:
            execution_id: the execution.
            key: the event's key.
            timeout: seconds to wait at most for a first value (None: do not wait); the
                wait ends early once the run has finished.

        Raises:
            ExecutionNotFoundError: there is no such run (nothing to wait for).
            InvalidArgumentError: the timeout is not a number of seconds >= 0.
            InvalidIdError: the id is not a valid execution id.
        """
        return self._parts.reading.get_event(execution_id, key, timeout)

    def get_events(self, execution_id: str) -> dict[str, Any]:
        """Every key a run has published, with its latest value (`ctx.set_event`).

        Raises:
            ExecutionNotFoundError: there is no such run.
        """
        return self._parts.reading.get_events(execution_id)

    def inbox(self, execution_id: str) -> list[InboxMessage]:
        """Every message in a run's inbox, in send order (a resend of a key left out),
        each saying whether the run has read it. Messages the run has read are
        compacted away in time (see docs/messages.md): `inbox_keys` still knows them.

        Raises:
            ExecutionNotFoundError: there is no such run.
            InvalidIdError: the id is not a valid execution id.
        """
        return self._parts.reading.inbox(execution_id)

    def inbox_keys(self, execution_id: str) -> dict[str, SentKey]:
        """Every dedupe key a message to a run was sent with, those of messages
        compacted away too, each with the position of the message first sent with it
        and whether the run has read that message.

        Raises:
            ExecutionNotFoundError: there is no such run.
            InvalidIdError: the id is not a valid execution id.
        """
        return self._parts.reading.inbox_keys(execution_id)

    def queue(self, name: str) -> QueueView:
        """What waits on one of this engine's queues, in order, and what is driven.

        Raises:
            InvalidArgumentError: this engine has no such queue.
            SchemaError: a partition of the queue holds a damaged record.
        """
        return self._parts.enqueueing.view(name)

    # -- versions and compaction ----------------------------------------------------

    def replay_check(self, execution_id: str, to: Flow | str | None = None) -> None:
        """Check that a run's recorded history replays on other code, touching nothing.

        The code is re-run in memory against the journal up to where the history
        ends; no step runs and nothing is written.

        Args:
            execution_id: the execution.
            to: the code to check against: a registered Flow, a code hash
                ("sha256:..."), a version ("2" or "version:2"); None for the newest
                registered version of the run's flow.

        Raises:
            NonDeterminismError: the history does not replay (the index, what was
                recorded, what the code asks for).
            UnknownFlowError: no such version of the run's flow is registered.
        """
        self._parts.versions.replay_check(execution_id, to)

    def resume_as(
        self, execution_id: str, to: Flow | str, *, reason: str | None = None
    ) -> Execution:
        """Migrate a live run to other code of its flow (K11), after a replay-check.

        The recorded history is first re-run on the new code in memory (see
        `replay_check`); only when it replays does the engine journal
        EXECUTION_MIGRATED (from, to, reason), an entry of the run's append-only
        `_migrations` audit, and pin the run to the new code. A parked run stays
        parked (its next resume runs the new code); a run left running is driven by
        `recover()`. Migrating to the code it is pinned to changes nothing.

        Raises:
            NonDeterminismError: the history does not replay on the new code;
                nothing was journaled.
            InvalidArgumentError: the run has finished (it never runs again).
            UnknownFlowError: that version of its flow is not registered here.
            ConflictError: the run moved meanwhile; check again.
        """
        return self._parts.versions.resume_as(execution_id, to, reason)

    def compact(self, execution_id: str) -> int:
        """Snapshot the folded state, then trim the journal below it (K10.4).

        The snapshot is written first, so a crash between the two writes loses
        nothing. Engines may compact the same run at once: a snapshot never replaces
        one that covers more, so a load always finds the journal from its snapshot on.

        Returns:
            The position the latest snapshot covers.
        """
        driver = self._parts.driver
        state = driver.checkout(execution_id)
        try:
            return compact(driver.store, state, driver.clock)
        finally:
            driver.cache.give_back(state)

    # -- the async API (see `_twins`: every call that touches the store has one) -----

    start_async = async_twin(start)
    enqueue_async = async_twin(enqueue)
    dispatch_async = async_twin(dispatch)
    fork_async = async_twin(fork)
    resume_async = async_twin(resume)
    send_async = async_twin(send)
    cancel_async = async_twin(cancel)
    fire_due_timers_async = async_twin(fire_due_timers)
    recover_async = async_twin(recover)
    gc_async = async_twin(gc)
    get_async = async_twin(get)
    state_async = async_twin(state)
    frames_async = async_twin(frames)
    history_async = async_twin(history)
    get_events_async = async_twin(get_events)
    inbox_async = async_twin(inbox)
    queue_async = async_twin(queue)
    replay_check_async = async_twin(replay_check)
    resume_as_async = async_twin(resume_as)
    compact_async = async_twin(compact)

    async def executions_async(
        self,
        prefix: str = "",
        *,
        status: Status | str | Iterable[Status | str] | None = None,
        flow: str | None = None,
    ) -> list[Execution]:
        """`executions`, for `async def` callers: the whole listing, read on a thread of
        Loom's own, as a list (the sync call's iterator reads the store as it goes)."""
        listing = self._parts.reading.listing
        return await in_a_thread(lambda: list(listing(prefix, status, flow)))

    async def get_event_async(
        self, execution_id: str, key: str, timeout: float | None = None
    ) -> Any:
        """`get_event`, for `async def` callers: each look is made on a thread, and
        the wait between looks on the loop (holding no thread)."""
        looks = self._parts.reading.event_looks(execution_id, key, timeout)
        while True:
            pause, value = await in_a_thread(looks.look)
            if pause is None:
                return value
            await asyncio.sleep(pause)


def parts_of(engine: Engine) -> EngineParts:
    """The parts behind `engine` (see `EngineParts`): the kernel's hosting layer and
    named test seams reach the engine's machinery here."""
    return engine._parts
