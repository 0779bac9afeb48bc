"""The Engine: drives flows against a store through the journal protocol."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs

from loom_kernel._coordination._executions import (
    EXECUTION_PREFIX,
    compact,
    execution_ids,
    fresh_execution_id,
    load,
    new_execution_id,
    stream_of,
)
from loom_kernel._coordination._inbox import Inbox, Message
from loom_kernel._coordination._leases import (
    DEFAULT_LEASE,
    MAX_LEASE,
    WORKERS_PREFIX,
    Heartbeat,
    abandoned_here,
    default_worker_id,
    driving_here,
    last_record,
    sighting,
)
from loom_kernel._coordination._published import Published, event_key_refusal
from loom_kernel._coordination._queues import Queue, QueueBook, QueueView
from loom_kernel._coordination._run_index import ENDED, OpenHint, RunIndex
from loom_kernel._coordination._timers import TIMER_GATE, TimerEntry, TimerIndex, timer_resume_key
from loom_kernel._core._codec import decode_events, encode_event, to_json
from loom_kernel._core._errors import (
    CodeVersionError,
    ConflictError,
    ExecutionNotFoundError,
    InvalidArgumentError,
    InvalidIdError,
    LoomError,
    NotSuspendedError,
    RunBusyError,
    RunFinishedError,
    SchemaError,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
    UnknownFlowError,
)
from loom_kernel._core._events import (
    Event,
    ExecutionCancelled,
    ExecutionClaimed,
    ExecutionMigrated,
    ExecutionResumed,
    ExecutionStarted,
    QueuePlace,
)
from loom_kernel._core._ids import (
    MAX_ID_LENGTH,
    has_utf8,
    is_name,
    validate_prefix,
    validate_stream_id,
)
from loom_kernel._core._numbers import finite_number
from loom_kernel._core._state import ExecutionState, Status, StepFrame
from loom_kernel._engine._cache import StateCache
from loom_kernel._engine._each import raise_first, try_each
from loom_kernel._engine._handles import RunHandle
from loom_kernel._engine._listeners import Listener, Listeners, installed_listeners
from loom_kernel._engine._locks import KeyedLocks, LockBusyError
from loom_kernel._engine._views import Execution, HistoryEntry
from loom_kernel._replay._context import DriveControl, Runtime
from loom_kernel._replay._driving import (
    Drive,
    awaitable_sleep,
    drive_here,
    on_loop,
    replay_check,
    run_flow,
)
from loom_kernel._replay._flows import Flow, RetryPolicy, code_hash, flow
from loom_kernel._replay._threads import in_a_thread
from loom_kernel._replay._waits import (
    RESERVED_RESUME_KEYS,
    consumed_positions,
    gate_payload,
    message_key,
    message_payload,
    validate_topic,
    wait_of,
)
from loom_kernel._spi._journal import JournalStore, check_gapless

logger = logging.getLogger("loom")
_T = TypeVar("_T")


if TYPE_CHECKING:
    from loom_kernel._hosting._worker import Worker

__all__ = ["Engine"]


class Engine:
    """Drives flows: starts, resumes, cancels and recovers executions on a store.

    Every method is safe to call from many threads. Drives of the same execution
    (start, resume, a timer, recover) are serialised within one engine; reads and
    cancels never wait for a drive. Across engines and processes the store's
    expected-head rule decides: one writer wins, the other gets ConflictError.

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
    ) -> None:
        if not finite_number(lease) or not 0 < lease <= MAX_LEASE:
            raise InvalidArgumentError(
                f"a lease is a number of seconds above 0 and at most {MAX_LEASE:.0f}, not {lease!r}"
            )
        self._configured_id = worker_id
        self._default_id = (os.getpid(), default_worker_id())
        self.lease = float(lease)
        self._heartbeat = Heartbeat(store, lambda: self.worker_id, self.lease, clock)
        validate_stream_id(WORKERS_PREFIX + self.worker_id)
        self.store = store
        self.clock = clock
        self.sleep = sleep
        self.async_sleep = async_sleep or (
            asyncio.sleep if sleep is time.sleep else awaitable_sleep(sleep)
        )
        self.retry = retry or RetryPolicy()
        self.timers = TimerIndex(store, clock)
        self.runs = RunIndex(store, clock)
        self._inbox = Inbox(store, clock)
        self._published = Published(store, clock)
        self._queues = QueueBook(store, clock, queues)
        self._finishes = threading.Condition()  # notified when a drive here ends a run
        self._finished_count = 0
        self._local_workers: list[Worker] = []  # running workers of this engine
        self._flows: dict[str, dict[str, Flow]] = {}  # name -> code hash -> flow
        self._newest: dict[str, Flow] = {}
        self._cache = StateCache(cache_size)
        self._locks = KeyedLocks()
        self._drives: dict[str, DriveControl] = {}
        self._drives_lock = threading.Lock()
        self._listeners = Listeners(installed_listeners() if listeners is None else listeners)
        for item in flows:
            self.register(item)

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
        self._listeners.add(listener)

    def _settled(
        self, execution: Execution, delivered: Callable[[Execution], None] | None = None
    ) -> Execution:
        """Tell the listeners about a run that parked or ended; return its view after them
        (a listener may have moved it on, by resuming it, say). A finished run is then
        closed in the run index (or handed to `delivered` instead)."""
        if execution.status is Status.RUNNING:
            return execution
        if execution.status.finished:
            with self._finishes:
                self._finished_count += 1
                self._finishes.notify_all()
        then = delivered or self._close
        if not self._listeners:
            try:
                then(execution)
            except LoomError as exc:  # still open: the next recover() closes it
                logger.warning("loom: %s not closed in the run index: %s", execution.id, exc)
            return execution
        if not self._listeners.deliver(self, execution, then):
            return execution  # queued for the delivery loop this call runs inside
        try:
            return self.get(execution.id)
        except LoomError:
            return execution

    def _wait_for_a_finish(self, seen: int, seconds: float) -> None:
        """Wait up to `seconds` for a drive of this engine to end a run, unless one
        has since `seen` (the count `_finished_count` had): a handle waiting on a run
        driven here wakes at once, not at its next look."""
        with self._finishes:
            if self._finished_count == seen:
                self._finishes.wait(seconds)

    def _close(self, execution: Execution) -> None:
        """Close a finished run in the run index, once its listeners have all run."""
        if execution.status.finished:
            self.runs.closed(execution.id, execution.status, execution.flow)

    # -- registration and ids -------------------------------------------------

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
        registered = item if isinstance(item, Flow) else flow(item)
        versions = self._flows.setdefault(registered.name, {})
        same = versions.get(registered.code_hash)
        if (
            same is not None
            and same.fn is not registered.fn
            and code_hash(same.fn) != code_hash(registered.fn)
        ):
            raise InvalidArgumentError(
                f"flow {registered.name!r} version {registered.version!r} is registered "
                "already with other code: two codes under one version would drive each "
                "other's runs; give the new code a version of its own"
            )
        versions[registered.code_hash] = registered
        if newest or registered.name not in self._newest:
            self._newest[registered.name] = registered
        return registered

    def _flow(self, name: str | Flow) -> Flow:
        """The flow new runs of `name` start on: the version registered last."""
        key = name.name if isinstance(name, Flow) else name
        found = self._newest.get(key) if isinstance(key, str) else None
        if found is None:
            known = ", ".join(sorted(self._newest)) or "none"
            raise UnknownFlowError(f"no flow named {key!r} is registered (registered: {known})")
        if isinstance(name, Flow):
            return self._resolve_version(key, name)
        return found

    def hosts(self, name: str) -> bool:
        """Whether any version of flow `name` is registered here."""
        return name in self._newest

    def _hosts_code(self, name: str, code: str) -> bool:
        """Whether the version of flow `name` with code hash `code` is registered here
        (any version, when `code` is empty)."""
        return code in self._flows.get(name, {}) if code else name in self._newest

    def newest(self, name: str) -> Flow:
        """The version of flow `name` that new runs start on (the one registered last).

        Raises:
            UnknownFlowError: no version of it is registered.
        """
        return self._flow(name)

    def _pinned_flow(self, state: ExecutionState) -> Flow:
        """The code a run is pinned to (K11).

        Raises:
            UnknownFlowError: no version of its flow is registered.
            CodeVersionError: its flow is registered, but not in the version it pins.
        """
        versions = self._flows.get(state.flow)
        if not versions:
            self._flow(state.flow)  # raises UnknownFlowError, naming what is registered
        assert versions is not None
        found = versions.get(state.code_hash)
        if found is None:
            raise CodeVersionError(state.id, state.flow, state.code_hash, sorted(versions))
        return found

    def _resolve_version(self, name: str, to: Flow | str | None) -> Flow:
        """A registered version of flow `name`: by Flow, by code hash or version, or the
        newest when None."""
        if to is None:
            return self._flow(name)
        versions = self._flows.get(name, {})
        if isinstance(to, Flow):
            if to.name != name:
                raise InvalidArgumentError(
                    f"{to.name!r} {to.code_hash} is another flow than {name!r}: a run moves "
                    "only to a version of its own flow"
                )
            wanted = to.code_hash
        elif isinstance(to, str) and to:
            # A code hash ("version:2", "sha256:..."), else a version ("2", "2024:02").
            wanted = to if to in versions else f"version:{to}"
        else:
            raise InvalidArgumentError(f"a version is a Flow, a code hash or a version, not {to!r}")
        found = versions.get(wanted)
        if found is None:
            have = ", ".join(sorted(versions)) or "none"
            raise UnknownFlowError(
                f"flow {name!r} has no registered version {wanted!r} (registered: {have})"
            )
        return found

    @staticmethod
    def stream_of(execution_id: str) -> str:
        """The journal stream of an execution.

        Raises:
            InvalidIdError: the id is not a valid stream id.
        """
        return stream_of(execution_id)

    # -- loading --------------------------------------------------------------

    def _checkout(self, execution_id: str) -> ExecutionState:
        """The execution's current state, for this caller alone (see StateCache)."""
        self.stream_of(execution_id)
        return load(self.store, execution_id, self._cache.take(execution_id))

    def _view(self, execution_id: str, read: Callable[[ExecutionState], Any]) -> Any:
        state = self._checkout(execution_id)
        try:
            return read(state)
        finally:
            self._cache.give_back(state)

    # -- driving ----------------------------------------------------------------

    def _append(
        self, state: ExecutionState, events: list[Event], control: DriveControl | None = None
    ) -> None:
        """Journal `events` at the state's position, after what the drive holds pending."""
        stream = self.stream_of(state.id)
        now = self.clock()
        pending = control.pending if control is not None else []
        records = pending + [encode_event(e, now) for e in events]
        self.store.append(stream, state.position - len(pending), records)
        pending.clear()
        for event in events:
            state.apply(event)

    def _runtime(self) -> Runtime:
        """What a context needs from this engine, as it is configured now."""
        return Runtime(
            self,
            self.store,
            self.clock,
            self.sleep,
            self.async_sleep,
            self.retry,
            self.timers,
            self._inbox,
            self._published,
            self._heartbeat.in_doubt,
        )

    def _drive(self, state: ExecutionState, control: DriveControl | None = None) -> Drive[None]:
        """Re-run the flow from the top until it parks or ends, and journal how it ended.

        Raises:
            ConflictError: another writer moved the journal (this run stopped).
            NonDeterminismError, InvalidArgumentError: the code misused or diverged
                from the journal; the journal is left as it was.
        """
        if state.status is not Status.RUNNING:
            return
        control = control or DriveControl()
        ending = yield from run_flow(self._pinned_flow(state), self._runtime(), state, control)
        if ending is not None:
            self._append(state, [ending], control)
        elif control.pending:  # parked without new work: the resume still happened
            self.store.append(
                self.stream_of(state.id), state.position - len(control.pending), control.pending
            )
            control.pending.clear()

    def _drive_owned(self, state: ExecutionState, control: DriveControl | None = None) -> Execution:
        """`_driving_owned` on this thread."""
        return drive_here(self._driving_owned(state, control))

    def _driving_owned(
        self, state: ExecutionState, control: DriveControl | None = None
    ) -> Drive[Execution]:
        """Drive a state this caller owns (holding the run's lock), then cache it.

        A racing writer (another engine, or a cancel) is the one now in charge: the
        run stops and the view returned is the journal's, read afresh.

        Returns:
            The run's view after the drive (built before the state goes back to the
            cache, where another thread may fold into it).
        """
        control = control or DriveControl()
        with self._drives_lock:
            self._drives[state.id] = control
        try:
            with self._heartbeat.holding(state.id):
                yield from self._drive(state, control)
        except ConflictError:
            if control.pending:
                raise  # the resume itself lost the race: the caller's payload went nowhere
            state = load(self.store, state.id, None)
        finally:
            with self._drives_lock:
                if self._drives.get(state.id) is control:
                    del self._drives[state.id]
        execution = Execution.of(state)
        self._cache.give_back(state)
        return execution

    # -- the public API -----------------------------------------------------------

    def start(
        self,
        flow_name: str | Flow,
        input: Any = None,
        *,
        key: str | None = None,
        parent: str | None = None,
    ) -> Execution:
        """Start an execution and run it until it parks or ends.

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
        execution_id, event = self._new_start(flow_name, input, key, parent, self.worker_id)
        with self._locks.hold(execution_id), self._heartbeat.holding(execution_id):
            if not self._append_start(event, execution_id):
                return self.get(execution_id)
            state = ExecutionState(id=execution_id)
            state.apply(event)
            execution = self._drive_owned(state)
        return self._settled(execution)

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
        if queue is not None:
            place = self._queues.queue(queue), priority, queue_key
            return self._enqueue_on(flow_name, input, key, parent, place)
        if type(priority) is not int or priority != 0 or queue_key is not None:
            raise InvalidArgumentError(
                f"a priority or a queue key needs a queue (queue=name), not priority={priority!r}"
                f" and queue_key={queue_key!r}"
            )
        return self._enqueue(flow_name, input, key, parent, inline_otherwise=False)

    def _enqueue_on(
        self,
        flow_name: str | Flow,
        input: Any,
        key: str | None,
        parent: str | None,
        where: tuple[Queue, int, str | None],
    ) -> RunHandle:
        """Start a run with no owner on a queue (with a priority and a key), then have
        it wait there for a worker."""
        queue, priority, queue_key = where
        execution_id, event = self._new_start(flow_name, input, key, parent, None)
        place = queue.place(execution_id, priority, queue_key)
        event = attrs.evolve(event, queue=place)
        with self._locks.hold(execution_id), self._heartbeat.holding(execution_id):
            added = self._append_start(event, execution_id)
            if added:
                state = ExecutionState(id=execution_id)
                state.apply(event)
                self._cache.give_back(state)
        if added:
            self._queue_up(place, execution_id, event.flow, event.code_hash)
        return RunHandle(self, execution_id)

    def _queue_up(self, place: QueuePlace, execution_id: str, flow: str, code: str) -> None:
        """Have a queued run whose start or wake landed wait on its queue, and wake
        this engine's workers. A failure is logged, not raised: what landed stands,
        and the sweeps add the run to its queue (see `_ensure_queued`)."""
        try:
            self._queues.add(place, execution_id, flow, code)
        except LoomError as exc:
            logger.warning("loom: %s not put on queue %r yet: %s", execution_id, place.name, exc)
        for worker in self._local_workers:
            worker._wake.set()

    def _wake_queued(self, state: ExecutionState, resumed: ExecutionResumed) -> Execution:
        """Journal the wake of a parked queued run with no owner (held by the caller, who
        holds its lock), then have it wait on its queue: its workers drive it.

        Raises:
            ConflictError: another writer moved the run first.
        """
        assert state.queue is not None
        try:
            self._append(state, [attrs.evolve(resumed, by=None)])
        except BaseException:
            self._cache.drop(state.id)
            raise
        execution = Execution.of(state)
        place, flow, code = state.queue, state.flow, state.code_hash
        self._cache.give_back(state)
        self._queue_up(place, state.id, flow, code)
        return execution

    def _ensure_queued(self, execution_id: str, place: QueuePlace, flow: str, code: str) -> None:
        """Put a queued run left running with no driver back on its queue, if it is
        neither waiting there nor admitted, and its writer (which adds it right after
        its start or wake) has had half a lease to do so."""
        fold = self._queues.read(place.name, place.partition)
        if execution_id in fold.waiting or execution_id in fold.active:
            return
        last = last_record(self.store, self.stream_of(execution_id))
        if last is not None and self.clock() - last.timestamp <= self.lease / 2:
            return
        logger.info("loom: %s: putting it back on queue %r", execution_id, place.name)
        self._queue_up(place, execution_id, flow, code)

    def _drive_queued(self, execution_id: str) -> Drive[QueuedDrive]:
        """Drive a run a worker of this engine admitted from its queue: claim it, then
        drive it until it parks or ends.

        Returns:
            What the admission came to (see `QueuedDrive`).
        """
        with self._locks.hold(execution_id), self._heartbeat.holding(execution_id):
            try:
                state = self._checkout(execution_id)
            except ExecutionNotFoundError:
                return QueuedDrive.VOID
            if state.status is not Status.RUNNING:  # ended (a cancel), or parked already
                self._cache.give_back(state)
                return QueuedDrive.VOID
            try:
                claimed = self._take_over(state)
            except (ConflictError, StoreUnavailableError):
                self._cache.drop(execution_id)
                return QueuedDrive.NOT_NOW
            except BaseException:
                self._cache.drop(execution_id)
                raise
            if not claimed:  # a live owner holds it (one that let it go, not gone yet)
                self._cache.give_back(state)
                return QueuedDrive.NOT_NOW
            execution = yield from self._driving_owned(state)
        self._settled(execution)
        if execution.status is Status.RUNNING and execution.owner == self.worker_id:
            return QueuedDrive.LEFT_RUNNING  # let go at a stop, or stopped by a fault
        return QueuedDrive.DRIVEN

    def _queued_stale(self, execution_id: str, taker: str) -> bool | None:
        """Whether a run admitted by worker `taker` (long enough ago) is no longer
        driven by it: None while it may be; else whether it should wait again (it is
        running: the taker never claimed it, or stopped)."""
        try:
            status, owner = self._view(execution_id, lambda state: (state.status, state.owner))
        except ExecutionNotFoundError:
            return False
        if status is not Status.RUNNING:
            return False
        if owner != taker:
            return True  # admitted half a lease ago and never claimed
        if owner == self.worker_id:
            return None if driving_here(owner, execution_id) else True
        if abandoned_here(owner, execution_id):
            return True
        seen = sighting(self.store, owner, execution_id, self.stream_of(execution_id))
        return True if seen.expired(self.clock(), self.lease) else None

    def queue(self, name: str) -> QueueView:
        """What waits on one of this engine's queues, in order, and what is driven.

        Raises:
            InvalidArgumentError: this engine has no such queue.
            SchemaError: a partition of the queue holds a damaged record.
        """
        return self._queues.view(name)

    def _start_or_hand(
        self, flow_name: str | Flow, input: Any, key: str | None, parent: str | None
    ) -> RunHandle:
        """Hand a new run to a worker of this engine (a free slot or its queue), or,
        when none takes it (none runs, or it is stopping), start it inline."""
        return self._enqueue(flow_name, input, key, parent, inline_otherwise=True)

    def _enqueue(
        self,
        flow_name: str | Flow,
        input: Any,
        key: str | None,
        parent: str | None,
        *,
        inline_otherwise: bool,
    ) -> RunHandle:
        workers = list(self._local_workers)
        if inline_otherwise and not workers:
            return RunHandle(self, self.start(flow_name, input, key=key, parent=parent).id)
        execution_id, event = self._new_start(flow_name, input, key, parent, None)
        taker = next((w for w in workers if w._reserve(execution_id, queue=False)), None)
        if taker is None:  # no free slot anywhere here: a place in a worker's queue
            taker = next((w for w in workers if w._reserve(execution_id, queue=True)), None)
        if taker is None and inline_otherwise:
            return RunHandle(self, self.start(flow_name, input, key=key, parent=parent).id)
        if taker is not None:  # the run starts as this engine's own
            event = attrs.evolve(event, by=self.worker_id)
        handoff = contextlib.ExitStack()
        added = handed = False
        try:
            with self._locks.hold(execution_id), self._heartbeat.holding(execution_id):
                added = self._append_start(event, execution_id)
                state = ExecutionState(id=execution_id)
                state.apply(event)
                if added and taker is not None:
                    # Held until the worker's drive holds it: no beat in between may
                    # say this worker dropped the run, or another could take it over.
                    handoff.enter_context(self._heartbeat.holding(execution_id))
                elif added:
                    self._cache.give_back(state)  # a worker of this engine starts from it
            if taker is not None and added:
                drive = partial(self._drive_handed, state, handoff)
                handed = taker._hand(execution_id, drive, handoff.close, event.flow)
        except BaseException:
            # The start failed (a start that landed although its append raised is this
            # engine's: a poll finds it), or an interrupt: nothing is handed over.
            if not handed:
                handoff.close()
                if taker is not None:
                    taker._unreserve(execution_id)
            raise
        if taker is not None and not handed:
            # A run with that key exists, or the worker is stopping: the run is left
            # to the polls, and the slot or place goes back.
            handoff.close()
            taker._unreserve(execution_id)
        if added and taker is None:  # once this engine no longer holds it
            for worker in workers:
                worker._wake.set()
        return RunHandle(self, execution_id)

    def _drive_handed(self, state: ExecutionState, handoff: contextlib.ExitStack) -> Drive[str]:
        """Drive a run `enqueue` started as this engine's own and handed to a worker's
        free slot, as `start` would have inline: no claim, no poll."""
        execution_id = state.id
        try:
            with self._locks.hold(execution_id), self._heartbeat.holding(execution_id):
                handoff.close()
                execution = yield from self._driving_owned(state)
        finally:
            handoff.close()
        self._settled(execution)
        return execution_id

    def handle(self, execution_id: str) -> RunHandle:
        """A handle to an existing run, to wait for its result.

        Raises:
            InvalidIdError: the id is not a valid execution id.
        """
        self.stream_of(execution_id)
        return RunHandle(self, execution_id)

    def _new_start(
        self, flow_name: str | Flow, input: Any, key: str | None, parent: str | None, by: str | None
    ) -> tuple[str, ExecutionStarted]:
        """The id and the EXECUTION_STARTED of a new run (nothing journaled yet)."""
        definition = self._flow(flow_name)
        data = to_json(input, "the flow input")
        execution_id = new_execution_id(key) if key is not None else fresh_execution_id()
        started = ExecutionStarted(definition.name, definition.code_hash, data, key, parent, by)
        return execution_id, started

    def _append_start(self, event: ExecutionStarted, execution_id: str) -> bool:
        """Index the run (the hint first), then journal its start. False when a run
        with that id exists already.

        Raises:
            ExecutionNotFoundError: the id belongs to a deleted run.
        """
        stream = self.stream_of(execution_id)
        queue = None if event.queue is None else event.queue.name
        try:
            if event.key is not None and self.store.head(stream) > 0:
                return False  # a start by key of a run that exists: no second hint
            hinted = time.monotonic()
            self.runs.opened(execution_id, event.flow, self.worker_id, queue)
            self.store.append(stream, 0, [encode_event(event, self.clock())])
        except ConflictError:
            return False
        except StreamDeletedError:
            raise ExecutionNotFoundError(
                f"execution {execution_id!r} was deleted; its key cannot start another run"
            ) from None
        if time.monotonic() - hinted > self.lease / 2:
            # Paused between the hint and the start (a frozen VM, say): another worker
            # may have judged the hint abandoned and dropped it. Write it again.
            self.runs.opened(execution_id, event.flow, self.worker_id, queue)
        return True

    def resume(
        self,
        execution_id: str,
        payload: Any = None,
        *,
        key: str | None = None,
        on: str | None = None,
    ) -> Execution:
        """Deliver `payload` to the gate the run is parked at, then run it on.

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
        data = to_json(payload, "the resume payload")
        if key is not None and (not isinstance(key, str) or not key):
            raise InvalidArgumentError(f"a resume key is a non-empty str, not {key!r}")
        if key is not None and key.startswith(RESERVED_RESUME_KEYS):
            raise InvalidArgumentError(
                f"a resume key starting with {' or '.join(RESERVED_RESUME_KEYS)} is the "
                f"kernel's own (timers, messages), not {key!r}"
            )
        return self._resume(execution_id, data, key, timer=False, on=on)

    def _resume(
        self,
        execution_id: str,
        data: Any,
        key: str | None,
        *,
        timer: bool,
        on: str | None = None,
        settle: bool = True,
    ) -> Execution:
        resuming = self._resuming(execution_id, data, key, timer=timer, on=on, settle=settle)
        return drive_here(resuming)

    def _resuming(
        self,
        execution_id: str,
        data: Any,
        key: str | None,
        *,
        timer: bool,
        on: str | None = None,
        settle: bool = True,
    ) -> Drive[Execution]:
        with self._run_lock(execution_id):
            state = self._checkout(execution_id)
            try:
                if timer and key != timer_resume_key(len(state.resume_payloads)):
                    # A timer of a gate another writer passed meanwhile: the run may be
                    # parked at a later gate with a deadline of its own.
                    raise _AlreadyDeliveredError
                data = self._check_parked(state, data, key, timer=timer, on=on)
            except _AlreadyDeliveredError:
                execution = Execution.of(state)
                self._cache.give_back(state)
                if timer:
                    raise  # the poller counts only the wakes it made
                return execution
            except LoomError:
                self._cache.give_back(state)
                raise
            resumed = ExecutionResumed(data, key, self.worker_id)
            if state.queue is not None:
                execution = self._wake_queued(state, resumed)
                return self._settled(execution) if settle else execution
            # The resume is journaled with the drive's first new work, not before: a
            # replay that diverges before then journals nothing, and the run stays
            # parked at its gate for fixed code to take the same payload.
            control = DriveControl([encode_event(resumed, self.clock())])
            state.apply(resumed)
            execution = yield from self._driving_owned(state, control)
        return self._settled(execution) if settle else execution

    @contextlib.contextmanager
    def _run_lock(self, execution_id: str) -> Iterator[None]:
        """Hold a run's lock to resume it. From inside a drive (a step resuming
        another run), wait half a lease at most: two runs whose steps resume each
        other would otherwise wait for each other for ever.

        Raises:
            RunBusyError: the wait from inside a drive passed.
        """
        wait = self.lease / 2 if self._locks.holding_any() else None
        try:
            with self._locks.hold(execution_id, wait=wait):
                yield
        except LockBusyError:
            raise RunBusyError(execution_id, wait or 0.0) from None

    @staticmethod
    def _check_parked(
        state: ExecutionState, data: Any, key: str | None, *, timer: bool, on: str | None
    ) -> Any:
        """Whether the run's pending gate takes this resume; the payload to record."""
        if key is not None and key in state.resume_keys:
            raise _AlreadyDeliveredError
        gate = state.pending_gate
        if gate is None:
            raise NotSuspendedError(state.id, state.status)
        if timer:
            if gate.wake_at is None:
                raise NotSuspendedError(state.id, "suspended", f"it waits on {gate.on!r}")
            return None  # a deadline: what the gate records is the timer's key
        if gate.on == TIMER_GATE:
            detail = f"it sleeps until {gate.wake_at}; fire_due_timers wakes it"
            raise NotSuspendedError(state.id, "suspended", detail)
        try:
            wait = wait_of(gate.on)
        except InvalidArgumentError as exc:
            raise NotSuspendedError(state.id, "suspended", str(exc)) from None
        assert wait is not None
        if not wait.gates:
            topics = ", ".join(repr(topic) for topic in wait.topics)
            detail = f"it waits for a message on {topics}; engine.send delivers it"
            raise NotSuspendedError(state.id, "suspended", detail)
        if on is None and len(wait.gates) > 1:
            detail = f"it waits on any of {list(wait.gates)}: say which with on="
            raise NotSuspendedError(state.id, "suspended", detail)
        name = wait.gates[0] if on is None else on
        if name not in wait.gates:
            shown = gate.on if not wait.named else f"any of {list(wait.gates)}"
            raise NotSuspendedError(state.id, "suspended", f"it waits on {shown!r}, not {on!r}")
        return gate_payload(name, data) if wait.named else data

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
        self.stream_of(execution_id)
        topic = validate_topic(topic)
        if key is not None and (not isinstance(key, str) or not key or len(key) > MAX_ID_LENGTH):
            raise InvalidArgumentError(
                f"a message key is a non-empty str of at most {MAX_ID_LENGTH} characters, "
                f"not {key!r}"
            )
        data = to_json(message, "the message")
        status = self._view(execution_id, lambda state: state.status)
        first = None if key is None else self._inbox.sent(execution_id, key)
        if first is not None:
            return first  # a resend: a no-op, whatever the run has done since
        if status.finished:
            raise RunFinishedError(execution_id, status.value)
        position = self._inbox.append(execution_id, topic, key, data)
        if key is not None:  # a racing resend may have landed first: that one counts
            position = self._inbox.sent(execution_id, key) or position
        try:
            if drive and self._locks.holding_any():
                # From inside a drive (a step): waiting for a run another drive holds
                # could wait for ever (its step may be sending to this run); the
                # delivery is made by whoever releases it.
                self._deliver_now_or_at_release(execution_id)
            elif drive:
                self._deliver(execution_id)
            else:
                view = self.get(execution_id)
                if view.status is Status.SUSPENDED and topic in view.topics:
                    self.runs.nudged(execution_id, view.flow)
        except LoomError as exc:  # the message is sent: the wake is the run's business
            logger.warning("loom: %s: a message was sent, its wake failed: %s", execution_id, exc)
            with contextlib.suppress(LoomError):
                self.runs.nudged(execution_id, self._view(execution_id, lambda s: s.flow))
        state = self._checkout(execution_id)
        try:
            if state.status.finished and position not in consumed_positions(state.resume_keys):
                raise RunFinishedError(execution_id, state.status.value, position)
        finally:
            self._cache.give_back(state)
        return position

    def _deliver_now_or_at_release(self, execution_id: str) -> None:
        """Deliver a waiting message now if the run's lock is free, else once it is
        released, by the thread that releases it (never waiting for it here)."""

        def attempt() -> None:
            try:
                if self._deliver(execution_id, wait=0.0) is not _BUSY:
                    return
            except LoomError as exc:
                logger.warning(
                    "loom: %s: a message was sent, its wake failed: %s", execution_id, exc
                )
                return
            if not self._locks.after_release(execution_id, attempt):
                attempt()  # released meanwhile

        attempt()

    def _deliver(
        self, execution_id: str, *, nudge: bool = True, wait: float | None = None
    ) -> Execution | _Busy | None:
        """`_delivering` on this thread."""
        return drive_here(self._delivering(execution_id, nudge=nudge, wait=wait))

    def _delivering(
        self, execution_id: str, *, nudge: bool = True, wait: float | None = None
    ) -> Drive[Execution | _Busy | None]:
        """Hand the first waiting message to the gate a run is parked at, if that gate
        takes it, and drive the run on; None when there was nothing to deliver here
        (see `_deliver_held`); `_BUSY` when the run's lock was not free within `wait`
        seconds (None: as long as it takes)."""
        try:
            with self._locks.hold(execution_id, wait=wait):
                execution = yield from self._deliver_held(execution_id, nudge=nudge)
        except LockBusyError:
            return _BUSY
        return None if execution is None else self._settled(execution)

    def _deliver_held(self, execution_id: str, *, nudge: bool = True) -> Drive[Execution | None]:
        """`_deliver` without calling the listeners. None when the run waits for no
        message that is there, when another writer moved it first (it reads the inbox
        itself from there), or when this engine lacks its flow's code: the run index
        then has the workers that have it look (with `nudge`: a visit from the index
        makes none, or each visit's nudge would bring the next)."""
        with self._locks.hold(execution_id):
            state = self._checkout(execution_id)
            try:
                message = self._waiting_message(state)
                if message is not None and state.queue is None and not self._hosts(state):
                    if nudge:
                        self.runs.nudged(execution_id, state.flow)
                    message = None
            except LoomError:
                self._cache.give_back(state)
                raise
            if message is None:
                self._cache.give_back(state)
                return None
            payload = message_payload(message.topic, message.position, message.message)
            resumed = ExecutionResumed(payload, message_key(message.position), self.worker_id)
            if state.queue is not None:  # its queue's workers drive it on
                try:
                    return self._wake_queued(state, resumed)
                except ConflictError:
                    return None  # a sender, a timer or a cancel moved first
            control = DriveControl([encode_event(resumed, self.clock())])
            state.apply(resumed)
            try:
                return (yield from self._driving_owned(state, control))
            except ConflictError:
                return None  # a sender, a timer or the run itself moved first

    def _waiting_message(self, state: ExecutionState) -> Message | None:
        """The message the gate a run is parked at would take now, if any."""
        gate = state.pending_gate
        wait = None if gate is None else wait_of(gate.on)
        if wait is None or not wait.topics:
            return None
        return self._inbox.next_for(state.id, wait.topics, consumed_positions(state.resume_keys))

    def _hosts(self, state: ExecutionState) -> bool:
        """Whether this engine has the code a run is pinned to."""
        if state.flow not in self._newest:
            return False
        try:
            self._pinned_flow(state)
        except CodeVersionError:
            return False
        return True

    def get_event(self, execution_id: str, key: str, timeout: float | None = None) -> Any:
        """The latest value a run published under `key` (`ctx.set_event`), read without
        its journal; None if it has published none.

        Args:
            execution_id: the execution.
            key: the event's key.
            timeout: seconds to wait at most for a first value (None: do not wait); the
                wait ends early once the run has finished.

        Raises:
            InvalidArgumentError: the timeout is not a number of seconds >= 0.
            InvalidIdError: the id is not a valid execution id.
        """
        looks = self._event_looks(execution_id, key, timeout)
        while True:
            pause, value = looks.look()
            if pause is None:
                return value
            time.sleep(pause)

    def _event_looks(self, execution_id: str, key: str, timeout: float | None) -> _EventLooks:
        """The looks of a `get_event`, its arguments checked."""
        self.stream_of(execution_id)
        if not is_name(key):
            raise InvalidArgumentError(event_key_refusal(key))
        if timeout is not None and (not finite_number(timeout) or timeout < 0):
            raise InvalidArgumentError(f"a timeout is a number of seconds >= 0, not {timeout!r}")
        return _EventLooks(self, execution_id, key, timeout)

    def get_events(self, execution_id: str) -> dict[str, Any]:
        """Every key a run has published, with its latest value (`ctx.set_event`)."""
        self.stream_of(execution_id)
        return self._published.values(execution_id)

    # -- the async API ------------------------------------------------------------

    async def start_async(
        self,
        flow_name: str | Flow,
        input: Any = None,
        *,
        key: str | None = None,
        parent: str | None = None,
    ) -> Execution:
        """`start`, for `async def` callers: the drive runs on a thread of Loom's own
        (one for each call in flight, never the loop's default executor's few), so
        the caller's event loop is never held and no call waits for another, and an
        async flow's code runs on the caller's loop (a sync flow's, on that thread).
        Arguments, result and errors are those of `start`."""
        return await self._in_thread(self.start, flow_name, input, key=key, parent=parent)

    async def resume_async(
        self,
        execution_id: str,
        payload: Any = None,
        *,
        key: str | None = None,
        on: str | None = None,
    ) -> Execution:
        """`resume`, for `async def` callers (see `start_async`)."""
        return await self._in_thread(self.resume, execution_id, payload, key=key, on=on)

    async def send_async(
        self,
        execution_id: str,
        message: Any = None,
        *,
        topic: str | None = None,
        key: str | None = None,
        drive: bool = True,
    ) -> int:
        """`send`, for `async def` callers (see `start_async`)."""
        return await self._in_thread(
            self.send, execution_id, message, topic=topic, key=key, drive=drive
        )

    async def get_event_async(
        self, execution_id: str, key: str, timeout: float | None = None
    ) -> Any:
        """`get_event`, for `async def` callers: each look is made on a thread, and
        the wait between looks on the loop (holding no thread)."""
        looks = self._event_looks(execution_id, key, timeout)
        while True:
            pause, value = await in_a_thread(looks.look)
            if pause is None:
                return value
            await asyncio.sleep(pause)

    @staticmethod
    async def _in_thread(call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await in_a_thread(on_loop(loop, call), *args, **kwargs)

    def cancel(self, execution_id: str, reason: str | None = None) -> Execution:
        """End a run: it never starts another step. Cancelling a finished run changes nothing.

        A cancel does not wait for a drive in progress: it journals the cancel at
        once, and the drive stops before its next step, whichever engine or thread
        of this process runs it (a step already running finishes, and its result is
        not journaled). A drive in another process stops there too, unless the step
        begins within a millisecond of its last append (or its store's heads cost a
        request, as on S3): then the step runs and its append is refused.
        """
        _check_reason(reason)
        while True:
            state = self._checkout(execution_id)
            execution = Execution.of(state)
            if state.status.finished:
                self._cache.give_back(state)
                return execution
            try:
                self._append(state, [ExecutionCancelled(reason)])
            except ConflictError:
                continue  # the run moved on meanwhile: look again
            break
        execution = Execution.of(state)
        self._cache.give_back(state)
        with self._drives_lock:
            control = self._drives.get(execution_id)
        if control is not None:
            control.stopped = True
        return self._settled(execution)

    def get(self, execution_id: str) -> Execution:
        """The execution's current view; for a running run, who drives it and when that
        worker was last seen, so a crash (seen longer ago than a lease) and a run
        driven elsewhere are different answers.

        Raises:
            ExecutionNotFoundError: no such execution.
        """
        view: Execution = self._view(execution_id, Execution.of)
        if view.owner is None:
            return view
        seen = sighting(self.store, view.owner, execution_id, self.stream_of(execution_id))
        return attrs.evolve(view, owner_seen_at=seen.seen_at)

    def state(self, execution_id: str) -> ExecutionState:
        """A copy of the execution's full folded state (frames, gates, variables)."""
        copy: ExecutionState = self._view(execution_id, ExecutionState.copy)
        return copy

    def frames(self, execution_id: str) -> Mapping[int, StepFrame]:
        """The execution's recorded steps by call index, read-only.

        A shallow copy (frames are not copied), so it is cheap and a run driven
        meanwhile does not change it under the caller.
        """
        frames: Mapping[int, StepFrame] = self._view(
            execution_id, lambda state: MappingProxyType(dict(state.steps))
        )
        return frames

    def history(self, execution_id: str) -> list[HistoryEntry]:
        """The decoded journal (if the run was compacted: from the last record its
        latest snapshot covers on)."""
        stream = self.stream_of(execution_id)
        after = 0
        try:
            try:
                records = self.store.read(stream)
            except TrimmedError as exc:
                after = exc.floor
                records = self.store.read(stream, after)
        except StreamDeletedError:
            raise ExecutionNotFoundError(f"execution {execution_id!r} was deleted") from None
        if not records:
            raise ExecutionNotFoundError(f"no execution with id {execution_id!r}")
        check_gapless(records, after, stream)
        events = decode_events(records, stream)
        return [
            HistoryEntry(r.position, r.timestamp, e) for r, e in zip(records, events, strict=True)
        ]

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
        return self._listing(prefix, status, flow, None)

    def _listing(
        self,
        prefix: str,
        status: Status | str | Iterable[Status | str] | None,
        flow: str | None,
        unreadable: Callable[[str, SchemaError], None] | None,
    ) -> Iterator[Execution]:
        """`executions`; with `unreadable`, a run whose journal cannot be folded is
        handed to it and the listing goes on (`loom ls`)."""
        wanted = _statuses(status)
        if wanted is None and flow is None:
            ids: Iterable[str] = execution_ids(self.store, prefix)
        else:
            ids = self._indexed_ids(prefix, wanted, flow)
        for execution_id in ids:
            try:
                execution = self.get(execution_id)
            except ExecutionNotFoundError:
                continue
            except SchemaError as exc:
                if unreadable is None:
                    raise
                unreadable(execution_id, exc)
                continue
            if (wanted is None or execution.status in wanted) and (
                flow is None or execution.flow == flow
            ):
                yield execution

    def _indexed_ids(
        self, prefix: str, wanted: frozenset[Status] | None, flow: str | None
    ) -> Iterable[str]:
        """The ids that may match, from the run index (every id, when it is not built
        or is damaged)."""
        if not isinstance(prefix, str):
            raise InvalidIdError(prefix, "an execution id prefix is a str")
        validate_prefix(EXECUTION_PREFIX + prefix)
        try:
            if not self.runs.built():
                return execution_ids(self.store, prefix)
            found: set[str] = set()
            for hint in self.runs.open_runs():
                if flow is None or hint.flow == flow:
                    found.add(hint.execution_id)
            for execution_id, ended_as, ended_flow in self.runs.closed_runs():
                if (wanted is None or ended_as in wanted) and (flow is None or ended_flow == flow):
                    found.add(execution_id)
            for ended_as in ENDED:
                if wanted is not None and ended_as not in wanted:
                    continue
                for execution_id, ended_flow in self.runs.ended(ended_as):
                    if flow is None or ended_flow == flow:
                        found.add(execution_id)
        except SchemaError as exc:
            logger.warning("loom: %s; listing every journal instead", exc)
            return execution_ids(self.store, prefix)
        return sorted(execution_id for execution_id in found if execution_id.startswith(prefix))

    def recover(self) -> list[str]:
        """Drive every run left running (by a crash, or a process that stopped mid-run),
        and call the listeners again for every run still open (parked, or ended with a
        listener not yet run to the end).

        The runs are found through the run index, so the cost is the runs still open,
        however many have finished. On a store indexed by no engine yet (one written
        by Loom before 1.18), or with a damaged index record, every journal is listed
        instead, and the index is rewritten from them.

        A run that cannot be loaded or driven (a damaged journal, or code that
        diverged from it) does not stop the others: every run is tried and each
        failure logged, then the first is raised.

        Returns:
            The ids of the executions it drove.
        """
        try:
            hints = list(self.runs.open_runs()) if self.runs.built() else None
        except SchemaError as exc:
            logger.warning("loom: %s; recovering from every journal", exc)
            hints = None
        if hints is None:
            return self._recover_everything()
        driven, failures = try_each(hints, self.recover_open, "recover")
        raise_first(failures)
        return [execution_id for execution_id in driven if execution_id is not None]

    def recover_open(self, hint: OpenHint) -> str | None:
        """Visit one run the index holds open: drive it if it is left running and may
        be taken over, call the listeners again if it parked or ended, and drop the
        hint of a run that does not exist once its writer is gone.

        Returns:
            The run's id if it was driven.
        """
        outcome = drive_here(self._recover_hint(hint))
        return outcome if isinstance(outcome, str) else None

    def _recover_hint(self, hint: OpenHint) -> Drive[str | _NotStarted | None]:
        """As `recover_open`, telling a run whose start has not landed yet (its writer
        may still be writing it) with NOT_STARTED."""
        execution_id = hint.execution_id
        outcome = yield from self._recovering_one(execution_id)
        if not isinstance(outcome, _Missing):
            return outcome
        if self._hint_abandoned(hint):
            self.runs.dropped(execution_id)
            return None
        return NOT_STARTED

    def _hint_abandoned(self, hint: OpenHint) -> bool:
        """Whether a hint's run can no longer start: deleted, or its writer is gone (known
        gone here, or not seen for a lease since the hint)."""
        stream = self.stream_of(hint.execution_id)
        try:
            if self.store.head(stream) > 0:
                return False  # it started since
        except StreamDeletedError:
            return True
        if hint.by is None:
            return self.clock() - hint.at > self.lease
        if abandoned_here(hint.by, hint.execution_id):
            return True
        seen = sighting(self.store, hint.by, hint.execution_id, stream).seen_at
        last = hint.at if seen is None else max(seen, hint.at)
        return self.clock() - last > self.lease

    def _recover_everything(self) -> list[str]:
        """`recover()` by listing every journal, then bringing the run index up to what
        the listing found (see `RunIndex.rebuild`); the store is marked indexed only
        when every run could be looked at."""
        still_open: dict[str, OpenHint] = {}
        ended: dict[str, tuple[str, Status, str]] = {}

        def file_ended(execution: Execution) -> None:
            if execution.status.finished:
                ended[execution.id] = (execution.id, execution.status, execution.flow)

        def visit(execution_id: str) -> str | None:
            try:
                outcome = drive_here(self._recovering_one(execution_id, file_ended))
            finally:  # indexed as open even when its visit failed: it is not ended
                with contextlib.suppress(LoomError):
                    flow_name = self._view(execution_id, lambda state: state.flow)
                    still_open[execution_id] = OpenHint(execution_id, flow_name, None, 0.0)
            return None if isinstance(outcome, _Missing) else outcome

        driven, failures = try_each(execution_ids(self.store), visit, "recover")
        for execution_id in ended:
            still_open.pop(execution_id, None)
        try:
            self.runs.index_ended(ended.values())
            self.runs.rebuild(still_open.values(), ended)
            if not failures:
                self.runs.mark_built()
        except LoomError as exc:
            failures.append(exc)
        raise_first(failures)
        return [execution_id for execution_id in driven if execution_id is not None]

    def _recovering_one(
        self, execution_id: str, delivered: Callable[[Execution], None] | None = None
    ) -> Drive[str | _Missing | None]:
        """Drive one run if it is left running; its id if it was driven, None if not,
        _MISSING if there is no such run."""
        driven = None
        with self._locks.hold(execution_id), self._heartbeat.holding(execution_id):
            try:
                state = self._checkout(execution_id)
            except ExecutionNotFoundError:
                return _MISSING  # deleted since the listing, or never started
            queued = state.queue if state.status is Status.RUNNING else None
            code = state.code_hash
            if queued is not None:  # its queue's workers drive it, as the limits allow
                execution = Execution.of(state)
                self._cache.give_back(state)
            elif (
                state.status is Status.RUNNING
                and state.flow in self._newest
                and self._take_over(state)
            ):
                execution = yield from self._driving_owned(state)
                driven = execution_id
            else:
                execution = Execution.of(state)
                self._cache.give_back(state)
        if queued is not None:
            self._ensure_queued(execution_id, queued, execution.flow, code)
        self._settled(execution, delivered)
        # A sender that appended its message and stopped before waking the run (the
        # listeners hear how the drive ends from `_deliver`, once).
        if (
            execution.status is Status.SUSPENDED
            and _waits_for_messages(execution.waiting_on)
            and (yield from self._delivering(execution_id, nudge=False)) is not None
        ):
            driven = execution_id
        return driven

    @property
    def worker_id(self) -> str:
        """Who this engine is in the journal: the configured id, or one made for this
        process (a process forked from it gets its own)."""
        if self._configured_id is not None:
            return self._configured_id
        pid, made = self._default_id
        if pid != os.getpid():
            self._default_id = pid, made = os.getpid(), default_worker_id()
        return made

    def _take_over(self, state: ExecutionState) -> bool:
        """Whether this engine may drive a running run now, claiming it first when
        another worker owned it (an append at the exact head: one taker wins, and the
        old owner's next append is refused)."""
        self._pinned_flow(state)  # a worker without the run's code never claims it
        owner, me = state.owner, self.worker_id
        if self._driven_now(state, besides=1):  # besides this recover
            return False
        try:  # a claim even of a run with no owner (1.16) or ours: it is a fresh sighting
            self._append(state, [ExecutionClaimed(me, owner)])
        except ConflictError:
            return False  # another taker, a cancel or the owner itself moved first
        return True

    def _driven_now(self, state: ExecutionState, *, besides: int = 0) -> bool:
        """Whether a running run's owner may be driving it now: a drive of this
        engine's own (not counting `besides` holds the caller has), or another owner
        seen within the lease that has not dropped it and is not known gone."""
        owner = state.owner
        if owner is None:
            return False
        if owner == self.worker_id:
            # Ours: a drive of ours stopped (a store fault), or this worker restarted
            # under its configured id; unless a drive of ours is on it right now.
            return driving_here(owner, state.id, besides=besides)
        if abandoned_here(owner, state.id):
            return False
        seen = sighting(self.store, owner, state.id, self.stream_of(state.id))
        if seen.expired(self.clock(), self.lease):
            return False
        logger.debug(
            "loom: %s is running on %s (seen %.1f s ago): left to it",
            state.id,
            owner,
            self.clock() - (seen.seen_at or 0.0),
        )
        return True

    def fire_due_timers(self) -> list[str]:
        """Wake every run whose timer is due by the engine's clock.

        A run that cannot be woken (its flow diverged from its journal, say), or a
        damaged timer record, does not stop the others: every due timer is tried,
        then the first error is raised.

        Returns:
            The ids of the executions it woke.
        """
        now = self.clock()
        woken, failures = self.timers.fire_due(
            now, lambda entry: drive_here(self._fire(entry, now))
        )
        raise_first(failures)
        return woken

    def _fire(self, entry: TimerEntry, now: float) -> Drive[bool | None]:
        """Wake one timer: True if woken, False if the hint is obsolete, None if not yet known.

        Decided and done under the run's lock, so two pollers of one engine never both
        count the same wake; across engines the resume's dedupe key decides. The
        listeners run after the lock is released, as after every drive.
        """
        with self._locks.hold(entry.execution_id):
            due = self._timer_state(entry, now)
            if due is not True:
                return due
            # A message already in the inbox beats the deadline: it was sent before the
            # timer fired, whatever the clocks said.
            execution = yield from self._deliver_held(entry.execution_id)
            if execution is None:
                key = timer_resume_key(entry.gate)
                try:
                    execution = yield from self._resuming(
                        entry.execution_id, None, key, timer=True, settle=False
                    )
                except _AlreadyDeliveredError:
                    return False  # another engine woke it meanwhile
        self._settled(execution)
        return True

    def _timer_state(self, entry: TimerEntry, now: float) -> bool | None:
        """Whether a timer hint is due to wake its run now (see `_timer_due`); False
        for a run that does not exist."""
        try:
            due: bool | None = self._view(
                entry.execution_id, lambda state: _timer_due(state, entry.gate, now)
            )
        except ExecutionNotFoundError:
            return False
        return due

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
        state = self._checkout(execution_id)
        try:
            replay_check(self._resolve_version(state.flow, to), self._runtime(), state)
        finally:
            self._cache.give_back(state)

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
        _check_reason(reason)
        with self._locks.hold(execution_id):
            state = self._checkout(execution_id)
            try:
                if state.status.finished:
                    raise InvalidArgumentError(
                        f"execution {execution_id!r} is {state.status}: a finished run never "
                        "runs again, so there is nothing to migrate"
                    )
                target = self._resolve_version(state.flow, to)
                if (
                    target.code_hash != state.code_hash
                    and state.status is Status.RUNNING
                    and self._driven_now(state)
                ):
                    raise InvalidArgumentError(
                        f"execution {execution_id!r} is being driven by {state.owner!r}: "
                        "its code cannot change under a drive in flight; migrate it once it "
                        "parks, or once its owner is gone (its lease runs out)"
                    )
                if target.code_hash != state.code_hash:
                    replay_check(target, self._runtime(), state)
                    migrated = ExecutionMigrated(state.code_hash, target.code_hash, reason)
                    self._append(state, [migrated])
                execution = Execution.of(state)
                place, flow_name, code = state.queue, state.flow, state.code_hash
            except BaseException:
                self._cache.drop(execution_id)
                raise
            self._cache.give_back(state)
        if place is not None and execution.status is Status.RUNNING:
            self._requeue_migrated(place, execution_id, flow_name, code)
        return execution

    def _requeue_migrated(self, place: QueuePlace, execution_id: str, flow: str, code: str) -> None:
        """A queued run waiting on its queue, migrated: its entry there takes the new
        code (keeping its place), or workers with only the new code never admit it."""
        try:
            waiting = self._queues.read(place.name, place.partition).waiting.get(execution_id)
        except LoomError as exc:
            logger.warning("loom: %s: its queue not told of its new code: %s", execution_id, exc)
            return
        if waiting is not None and waiting.code != code:
            self._queue_up(place, execution_id, flow, code)

    def compact(self, execution_id: str) -> int:
        """Snapshot the folded state, then trim the journal below it (K10.4).

        The snapshot is written first, so a crash between the two writes loses
        nothing. Engines may compact the same run at once: a snapshot never replaces
        one that covers more, so a load always finds the journal from its snapshot on.

        Returns:
            The position the latest snapshot covers.
        """
        state = self._checkout(execution_id)
        try:
            return compact(self.store, state, self.clock)
        finally:
            self._cache.give_back(state)


class _EventLooks:
    """A `get_event`'s looks at what a run published: each says how long to wait
    before the next, or (None, the value) once the wait is over."""

    def __init__(self, engine: Engine, execution_id: str, key: str, timeout: float | None) -> None:
        self._engine = engine
        self._id = execution_id
        self._key = key
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._pause = 0.005

    def look(self) -> tuple[float | None, Any]:
        engine, execution_id = self._engine, self._id
        values = engine._published.values(execution_id)
        if self._key in values:
            return None, values[self._key]
        left = 0.0 if self._deadline is None else self._deadline - time.monotonic()
        if left <= 0:
            return None, None
        with contextlib.suppress(ExecutionNotFoundError):
            if engine._view(execution_id, lambda state: state.status.finished):
                return None, engine._published.values(execution_id).get(self._key)
        pause = min(self._pause, left)
        self._pause = min(self._pause * 2, 0.25)
        return pause, None


class QueuedDrive(enum.Enum):
    """What a queue admission came to: DRIVEN (until it parked or ended, or another
    writer took over), LEFT_RUNNING (driven, then let go running: it waits again),
    NOT_NOW (not driven: its claim met a live owner or a transient fault; it waits
    again, and the admission counts for no rate), VOID (not driven: the run had
    ended or parked; the admission counts for no rate)."""

    DRIVEN = "driven"
    LEFT_RUNNING = "left running"
    NOT_NOW = "not now"
    VOID = "void"


class _Missing:
    """What `_recovering_one` returns for a run that does not exist."""


_MISSING: Final = _Missing()


class _Busy:
    """A delivery that found the run's lock taken (see `_deliver`)."""


_BUSY: Final = _Busy()


class _NotStarted:
    """What `_recover_hint` returns for a hint whose run may still start."""


NOT_STARTED: Final = _NotStarted()


def _statuses(status: Status | str | Iterable[Status | str] | None) -> frozenset[Status] | None:
    """The statuses asked for, validated."""
    if status is None:
        return None
    items = [status] if isinstance(status, str) else list(status)
    try:
        return frozenset(Status(item) for item in items)
    except ValueError:
        known = ", ".join(member.value for member in Status)
        raise InvalidArgumentError(f"a status is one of {known}, not {status!r}") from None


def _timer_due(state: ExecutionState, gate: int, now: float) -> bool | None:
    """Whether timer gate `gate` is due to be woken now: True; False when the hint is
    obsolete; None when the journal does not show the gate yet."""
    if state.status.finished:
        return False
    if gate >= len(state.gates):
        return None  # the hint is ahead of the journal: the suspend may still land
    if gate < len(state.resume_payloads):
        return False  # already woken
    recorded = state.gates[gate]
    # A hint from an earlier attempt is obsolete; the recorded wake has its own.
    return recorded.wake_at is not None and recorded.wake_at <= now


def _check_reason(reason: object) -> None:
    """A cancel's or a migration's reason: a str, or None (the journal records it)."""
    if reason is not None and not isinstance(reason, str):
        raise InvalidArgumentError(f"a reason is a str or None, not {reason!r}")
    if reason is not None and not has_utf8(reason):
        raise InvalidArgumentError(f"a reason has a UTF-8 form (no lone surrogate): {reason!r}")


def _waits_for_messages(on: str | None) -> bool:
    try:
        wait = None if on is None else wait_of(on)
    except InvalidArgumentError:
        return False
    return wait is not None and bool(wait.topics)


class _AlreadyDeliveredError(Exception):
    """Inside the engine only: a resume whose dedupe key was already delivered."""
