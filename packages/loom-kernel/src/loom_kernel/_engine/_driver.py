"""The driver every part of the engine drives runs through: check a run's state out,
lock it, drive it, journal how the drive ended, and hand the view to the listeners.

The Engine, the Worker and run handles share one driver per engine. It owns the
engine's configuration, the coordination streams a drive touches (the run index,
timers, inboxes, published values, the heartbeat), the cache of folded states and the
per-run locks.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, Final

import attrs

from loom_kernel._coordination import (
    Heartbeat,
    Inbox,
    Published,
    RunIndex,
    TimerIndex,
    abandoned_here,
    default_worker_id,
    driving_here,
    load,
    sighting,
    snapshot,
)
from loom_kernel._core import (
    ConflictError,
    Event,
    ExecutionClaimed,
    ExecutionMigrated,
    ExecutionState,
    InvalidArgumentError,
    LoomError,
    RunBusyError,
    Status,
    encode_event,
    has_utf8,
    stream_of,
)
from loom_kernel._engine._cache import StateCache
from loom_kernel._engine._flow_book import FlowBook
from loom_kernel._engine._listeners import AnyListener, Listeners
from loom_kernel._engine._locks import KeyedLocks, LockBusyError
from loom_kernel._engine._views import Execution
from loom_kernel._replay import (
    Counters,
    Drive,
    DriveControl,
    Host,
    Message,
    RetryPolicy,
    Tracing,
    drive_here,
    run_flow,
)
from loom_kernel._spi import JournalStore

__all__ = ["DRIVE_WATCH", "Driver", "check_reason"]

logger = logging.getLogger("loom")
#: Records a parked run's journal grows by between two snapshots, on a store whose
#: reads cost a request each (see `Driver._snapshot_if_long`).
SNAPSHOT_EVERY: Final = 256

#: Set by a worker around the drives it makes: called with 1 as each drive made under
#: it begins and -1 as it ends, nested drives (a listener resuming a parent) included,
#: so the worker counts the drives it made, not the tasks it ran.
DRIVE_WATCH: Final[contextvars.ContextVar[Callable[[int], None] | None]] = contextvars.ContextVar(
    "loom_drive_watch", default=None
)


@attrs.frozen
class Settings:
    """What an engine is configured with (see `Engine`)."""

    store: JournalStore
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    async_sleep: Callable[[float], Awaitable[None]]
    retry: RetryPolicy
    lease: float
    worker_id: str | None
    cache_size: int
    tracing: Tracing | None = None


class Driver:
    """Drives the runs of one engine (see the module's docstring)."""

    def __init__(
        self, engine: object, settings: Settings, flows: FlowBook, listeners: Iterable[AnyListener]
    ) -> None:
        store, clock = settings.store, settings.clock
        self.engine = engine
        self.settings = settings
        self.store = store
        self.clock = clock
        self.lease = settings.lease
        self.flows = flows
        self._default_id = (os.getpid(), default_worker_id())
        self.heartbeat = Heartbeat(store, lambda: self.worker_id, self.lease, clock)
        self.timers = TimerIndex(store, clock)
        self.runs = RunIndex(store, clock)
        self.inbox = Inbox(store, clock)
        self.published = Published(store, clock)
        self.cache = StateCache(settings.cache_size)
        self.locks = KeyedLocks()
        self.listeners = Listeners(listeners)
        self._drives: dict[str, DriveControl] = {}
        self._drives_lock = threading.Lock()
        self._finishes = threading.Condition()  # notified when a drive here ends a run
        self.finished_count = 0
        self.counters = Counters()  # what its drives did (loom_kernel.otel reads them)
        self.host = self._host_of(settings)

    def trace_with(self, tracing: Tracing | None) -> None:
        """Trace the drives that begin from now on with `tracing` (None: stop)."""
        self.settings = attrs.evolve(self.settings, tracing=tracing)
        self.host = self._host_of(self.settings)

    def configure(
        self,
        *,
        sleep: Callable[[float], None] | None = None,
        async_sleep: Callable[[float], Awaitable[None]] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """Change how the drives that begin from now on wait and retry (see `Engine`)."""
        changes: dict[str, Any] = {}
        if sleep is not None:
            changes["sleep"] = sleep
        if async_sleep is not None:
            changes["async_sleep"] = async_sleep
        if retry is not None:
            if not isinstance(retry, RetryPolicy):
                raise InvalidArgumentError(f"retry is a RetryPolicy, not {retry!r}")
            changes["retry"] = retry
        self.settings = attrs.evolve(self.settings, **changes)
        self.host = self._host_of(self.settings)

    def _host_of(self, settings: Settings) -> Host:
        """What each drive that begins now runs against."""
        return Host(
            self.engine,
            self.store,
            self.clock,
            settings.sleep,
            settings.async_sleep,
            settings.retry,
            lambda: self.worker_id,
            self.heartbeat.in_doubt,
            self._add_timer,
            self._next_message,
            self._publish,
            settings.tracing,
            self.counters,
        )

    @property
    def worker_id(self) -> str:
        """Who this engine is in the journal: the configured id, or one made for this
        process (a process forked from it gets its own)."""
        configured = self.settings.worker_id
        if configured is not None:
            return configured
        pid, made = self._default_id
        if pid != os.getpid():
            self._default_id = pid, made = os.getpid(), default_worker_id()
        return made

    # The streams a drive writes beside its journal, looked up at each call (a test
    # may stand in for one of them).

    def _add_timer(self, execution_id: str, gate: int, wake_at: float) -> None:
        self.timers.add(execution_id, gate, wake_at)

    def _next_message(
        self, state: ExecutionState, topics: tuple[str | None, ...], consumed: set[int]
    ) -> Message | None:
        return self.inbox.next_for(state.id, topics, consumed, state.generation)

    def _publish(self, state: ExecutionState, key: str, value: Any) -> None:
        self.published.set(state.id, key, value, state.generation)

    # -- states -----------------------------------------------------------------

    def checkout(self, execution_id: str) -> ExecutionState:
        """The execution's current state, for this caller alone (see StateCache): give
        it back (or drop it) when done.

        Raises:
            ExecutionNotFoundError: no such execution.
            InvalidIdError: the id is not a valid execution id.
        """
        stream_of(execution_id)
        return load(self.store, execution_id, self.cache.take(execution_id))

    def view(self, execution_id: str, read: Callable[[ExecutionState], Any]) -> Any:
        """`read` of the execution's current state."""
        state = self.checkout(execution_id)
        try:
            return read(state)
        finally:
            self.cache.give_back(state)

    def execution(self, execution_id: str) -> Execution:
        """The execution's current view; for a running run, who drives it and when that
        worker was last seen (see `Engine.get`)."""
        view: Execution = self.view(execution_id, Execution.of)
        if view.owner is None:
            return view
        seen = sighting(self.store, view.owner, execution_id, stream_of(execution_id))
        return attrs.evolve(view, owner_seen_at=seen.seen_at)

    def append(
        self,
        state: ExecutionState,
        events: list[Event],
        control: DriveControl | None = None,
        *,
        sync: bool = True,
    ) -> None:
        """Journal `events` at the state's position, after what the drive holds pending
        (unsynced with `sync` False: see `JournalStore.append`)."""
        stream = stream_of(state.id)
        now = self.clock()
        pending = control.pending if control is not None else []
        records = pending + [encode_event(e, now) for e in events]
        self.store.append(stream, state.position - len(pending), records, sync=sync)
        pending.clear()
        for event in events:
            state.apply(event)

    # -- driving ----------------------------------------------------------------

    def drive(self, state: ExecutionState, control: DriveControl | None = None) -> Drive[None]:
        """Re-run the flow from the top until it parks or ends, and journal how it ended.

        Raises:
            ConflictError: another writer moved the journal (this run stopped).
            NonDeterminismError, InvalidArgumentError: the code misused or diverged
                from the journal; the journal is left as it was.
        """
        if state.status is not Status.RUNNING:
            return
        control = control or DriveControl()
        definition = self.flows.pinned(state)
        host = self.host
        if host.tracing is not None and control.span is None and not control.replay_only:
            control.span = host.tracing.drive(state.id, state.flow, state.trace)
        try:
            if not state.code_hash:  # started by name, with no code: pinned at its first drive
                pin = ExecutionMigrated("", definition.code_hash, "pinned at its first drive")
                self.append(state, [pin], control)
            ending = yield from run_flow(definition, host, state, control)
            if ending is not None:
                self.append(state, [ending], control)
            elif control.pending:  # parked without new work: the resume still happened
                stream = stream_of(state.id)
                self.store.append(stream, state.position - len(control.pending), control.pending)
                control.pending.clear()
        except BaseException as exc:
            if control.span is not None:
                control.span.end(state.status.value, exc)
                control.span = None
            raise
        if control.span is not None:
            control.span.end(state.status.value)
            control.span = None

    def drive_owned(self, state: ExecutionState, control: DriveControl | None = None) -> Execution:
        """`driving_owned` on this thread."""
        return drive_here(self.driving_owned(state, control))

    def driving_owned(
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
        began_at = state.position
        fenced = False
        was_open = not state.status.finished
        watch = DRIVE_WATCH.get()
        if watch is not None:
            watch(1)
        try:
            with self.heartbeat.holding(state.id):
                yield from self.drive(state, control)
        except ConflictError:
            if control.pending:
                raise  # the resume itself lost the race: the caller's payload went nowhere
            state = load(self.store, state.id, None)
            fenced = state.status is Status.RUNNING and state.owner != self.worker_id
        finally:
            with self._drives_lock:
                if self._drives.get(state.id) is control:
                    del self._drives[state.id]
            if watch is not None:
                watch(-1)
        execution = Execution.of(state)
        if not fenced and state.status is Status.SUSPENDED:
            self._snapshot_if_long(state, began_at)
        self.cache.give_back(state)
        if was_open and execution.status is Status.FAILED and execution.error is not None:
            logger.info(
                "loom: %s failed: %s: %s",
                execution.id,
                execution.error.type,
                execution.error.message,
            )
        if fenced:  # the view says so: running, owned by the worker that took it over
            logger.warning(
                "loom: %s: %s took this run over during its drive here (this engine's "
                "lease lapsed?); it goes on there",
                execution.id,
                execution.owner,
            )
            seen = sighting(self.store, str(execution.owner), execution.id, stream_of(state.id))
            execution = attrs.evolve(execution, owner_seen_at=seen.seen_at)
        return execution

    def stop(self, execution_id: str) -> None:
        """Stop a drive of this engine in progress before its next step (a cancel)."""
        with self._drives_lock:
            control = self._drives.get(execution_id)
        if control is not None:
            control.stopped = True

    def drives_in_progress(self) -> int:
        """How many drives of this engine are in progress."""
        with self._drives_lock:
            return len(self._drives)

    @contextlib.contextmanager
    def run_lock(self, execution_id: str) -> Iterator[None]:
        """Hold a run's lock to resume it. From inside a drive (a step resuming
        another run), wait half a lease at most: two runs whose steps resume each
        other would otherwise wait for each other for ever.

        Raises:
            RunBusyError: the wait from inside a drive passed.
        """
        wait = self.lease / 2 if self.locks.holding_any() else None
        try:
            with self.locks.hold(execution_id, wait=wait):
                yield
        except LockBusyError:
            raise RunBusyError(execution_id, wait or 0.0) from None

    # -- owners -------------------------------------------------------------------

    def take_over(self, state: ExecutionState) -> bool:
        """Whether this engine may drive a running run now, claiming it first when
        another worker owned it (an append at the exact head: one taker wins, and the
        old owner's next append is refused)."""
        self.flows.pinned(state)  # a worker without the run's code never claims it
        owner, me = state.owner, self.worker_id
        if self.driven_now(state, besides=1):  # besides this recover
            return False
        try:  # a claim even of a run with no owner (1.16) or ours: it is a fresh sighting
            # Unsynced: the drive's next record is synced and makes it durable too; a
            # power loss that takes it stops every owner, so none is lost with it.
            self.append(state, [ExecutionClaimed(me, owner)], sync=False)
        except ConflictError:
            return False  # another taker, a cancel or the owner itself moved first
        if owner is not None and owner != me:
            self.counters.takeovers += 1
            logger.info("loom: %s taken over from %s", state.id, owner)
        return True

    def driven_now(self, state: ExecutionState, *, besides: int = 0) -> bool:
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
        seen = sighting(self.store, owner, state.id, stream_of(state.id))
        if seen.expired(self.clock(), self.lease):
            return False
        logger.debug(
            "loom: %s is running on %s (seen %.1f s ago): left to it",
            state.id,
            owner,
            self.clock() - (seen.seen_at or 0.0),
        )
        return True

    # -- after a drive ------------------------------------------------------------

    def settled(
        self, execution: Execution, delivered: Callable[[Execution], None] | None = None
    ) -> Execution:
        """Tell the listeners about a run that parked or ended; return its view after them
        (a listener may have moved it on, by resuming it, say). A finished run is then
        closed in the run index (or handed to `delivered` instead)."""
        if execution.status is Status.RUNNING:
            return execution
        if execution.status.finished:
            with self._finishes:
                self.finished_count += 1
                self._finishes.notify_all()
        then = delivered or self.close
        if not self.listeners:
            try:
                then(execution)
            except LoomError as exc:  # still open: the next recover() closes it
                logger.warning("loom: %s not closed in the run index: %s", execution.id, exc)
            return execution
        if not self.listeners.deliver(self.engine, execution, then):
            return execution  # queued for the delivery loop this call runs inside
        try:
            return self.execution(execution.id)
        except LoomError:
            return execution

    def wait_for_a_finish(self, seen: int, seconds: float) -> None:
        """Wait up to `seconds` for a drive of this engine to end a run, unless one
        has since `seen` (the count `finished_count` had): a handle waiting on a run
        driven here wakes at once, not at its next look."""
        with self._finishes:
            if self.finished_count == seen:
                self._finishes.wait(seconds)

    def _snapshot_if_long(self, state: ExecutionState, began_at: int) -> None:
        """Snapshot a run that parked, on a store whose reads cost a request each, once
        its journal grew past another `SNAPSHOT_EVERY` records: a later cold load (a
        resume by another process, a takeover) reads the snapshot and the records
        after it, not every record. The journal is left whole."""
        if (
            self.store.head_is_cheap
            or state.position // SNAPSHOT_EVERY <= began_at // SNAPSHOT_EVERY
        ):
            return
        try:
            snapshot(self.store, state, self.clock)
        except LoomError as exc:  # a load reads the whole journal instead, as before
            logger.warning("loom: %s: no snapshot written: %s", state.id, exc)

    def close(self, execution: Execution) -> None:
        """Close a finished run in the run index, once its listeners have all run."""
        if execution.status.finished:
            self.runs.closed(
                execution.id,
                execution.status,
                execution.flow,
                execution.generation,
                execution.parent,
            )


def check_reason(reason: object) -> None:
    """A cancel's or a migration's reason: a str, or None (the journal records it)."""
    if reason is not None and not isinstance(reason, str):
        raise InvalidArgumentError(f"a reason is a str or None, not {reason!r}")
    if reason is not None and not has_utf8(reason):
        raise InvalidArgumentError(f"a reason has a UTF-8 form (no lone surrogate): {reason!r}")
