"""The Engine: drives flows against a store through the journal protocol."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any, Final

import attrs

from loom_kernel._codec import decode_events, encode_event
from loom_kernel._context import TIMER_GATE, AsyncContext, Context, Unwind, error_info, to_json
from loom_kernel._errors import (
    ConflictError,
    ExecutionNotFoundError,
    InvalidArgumentError,
    InvalidIdError,
    LoomError,
    NotSuspendedError,
    SchemaError,
    StreamDeletedError,
    TrimmedError,
    UnknownFlowError,
)
from loom_kernel._events import (
    ErrorInfo,
    Event,
    ExecutionCancelled,
    ExecutionCompleted,
    ExecutionFailed,
    ExecutionResumed,
    ExecutionStarted,
)
from loom_kernel._flows import Flow, RetryPolicy, flow
from loom_kernel._ids import validate_stream_id
from loom_kernel._journal import JournalStore, NewRecord
from loom_kernel._state import ExecutionState, Status, StepFrame, fold_records
from loom_kernel._timers import TimerIndex

__all__ = ["Engine", "Execution", "HistoryEntry", "Listener"]

Listener = Callable[["Engine", "Execution"], None]

EXECUTION_PREFIX: Final = "ex/"
SNAPSHOT_PREFIX: Final = "snap/"
SNAPSHOT_KIND: Final = "loom.snapshot"
_LOCK_STRIPES: Final = 64


@attrs.frozen
class Execution:
    """What an execution looks like from outside: a view of its folded journal.

    Attributes:
        id: the execution id (its idempotency key, when started with one).
        flow: the flow's name.
        status: running, suspended, completed, failed or cancelled.
        input: the flow's input.
        result: the flow's return value, once completed.
        error: the uncaught error (type and message), once failed.
        waiting_on: the gate a suspended run is parked at ("loom.timer" for a sleep).
        wake_at: for a sleeping run, when its timer is due.
        key: the idempotency key, if any.
        parent: the execution that started it, if any.
        code_hash: the pinned hash of the flow's code.
        position: how many journal records it has.
    """

    id: str
    flow: str
    status: Status
    input: Any
    result: Any
    error: ErrorInfo | None
    waiting_on: str | None
    wake_at: float | None
    key: str | None
    parent: str | None
    code_hash: str
    position: int

    @classmethod
    def of(cls, state: ExecutionState) -> Execution:
        """The view of a folded state."""
        gate = state.pending_gate
        return cls(
            id=state.id,
            flow=state.flow,
            status=state.status,
            input=state.input,
            result=state.result,
            error=state.error,
            waiting_on=gate.on if gate else None,
            wake_at=gate.wake_at if gate else None,
            key=state.key,
            parent=state.parent,
            code_hash=state.code_hash,
            position=state.position,
        )


@attrs.frozen
class HistoryEntry:
    """One decoded journal record."""

    position: int
    timestamp: float
    event: Event


_log = logging.getLogger("loom")

LISTENER_GROUP: Final = "loom.listeners"
_installed: list[Listener] | None = None


def installed_listeners() -> list[Listener]:
    """The listeners published in the `loom.listeners` entry-point group (loaded once)."""
    global _installed  # noqa: PLW0603 - a process-wide cache of installed plugins
    if _installed is None:
        _installed = [ep.load() for ep in entry_points(group=LISTENER_GROUP)]
    return list(_installed)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic collector while a journal is decoded and folded.

    A load allocates a few objects per record and frees none, so the collector runs
    again and again over a growing heap for nothing (measured with
    bench/bench_replay.py: a third of a 10,000-record cold load, and most of its
    variance). Whatever state the collector was in is restored.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _run_coroutine(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run an async flow to its end, in this thread or, under a running loop, in a helper."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-flow") as pool:
        return pool.submit(asyncio.run, coroutine).result()


class Engine:
    """Drives flows: starts, resumes, cancels and recovers executions on a store.

    Every method is safe to call from many threads; calls on the same execution are
    serialised within one engine, and across engines and processes the store's
    expected-head rule decides: one writer wins, the other gets ConflictError.

    Args:
        store: the journal store.
        flows: the flows this engine can run (Flow objects or plain functions).
        clock: returns the time in epoch seconds; inject a fake one in tests.
        sleep: waits between step retries; inject a no-op in tests.
        retry: the default step retry policy.
        cache_size: how many folded executions to keep in memory.
        listeners: called when a run parks or ends (see `add_listener`); by default,
            every listener installed in the `loom.listeners` entry-point group (so
            installing loom-orchestration makes every engine deliver child outcomes).
    """

    def __init__(
        self,
        store: JournalStore,
        flows: Iterable[Flow | Callable[..., Any]] = (),
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        retry: RetryPolicy | None = None,
        cache_size: int = 1024,
        listeners: Iterable[Listener] | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.sleep = sleep
        self.retry = retry or RetryPolicy()
        self.timers = TimerIndex(store, clock)
        self._flows: dict[str, Flow] = {}
        self._cache: OrderedDict[str, ExecutionState] = OrderedDict()
        self._cache_size = cache_size
        self._cache_lock = threading.Lock()
        self._locks = [threading.RLock() for _ in range(_LOCK_STRIPES)]
        self._listeners: list[Listener] = []
        for listener in installed_listeners() if listeners is None else listeners:
            self.add_listener(listener)
        for item in flows:
            self.register(item)

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(engine, execution)` whenever a run parks or ends here.

        Listeners run after the journal append that parked or ended the run, outside
        the engine's per-execution locks, and `recover()` calls them again for every
        parked or ended run, so a listener that a crash cut short gets another chance:
        write listeners to be idempotent. A LoomError a listener raises is swallowed
        (the next recover retries it); any other error propagates.
        """
        if listener not in self._listeners:
            self._listeners.append(listener)

    def _settled(self, execution: Execution) -> Execution:
        """Tell the listeners about a run that parked or ended; return its view after them
        (a listener may have moved it on, by resuming it, say)."""
        if execution.status is Status.RUNNING or not self._listeners:
            return execution
        for listener in self._listeners:
            try:
                listener(self, execution)
            except LoomError as exc:  # recover() calls it again
                _log.warning(
                    "listener %r on %r: %s: %s", listener, execution.id, type(exc).__name__, exc
                )
        try:
            return self.get(execution.id)
        except LoomError:
            return execution

    # -- registration and ids -------------------------------------------------

    def register(self, item: Flow | Callable[..., Any]) -> Flow:
        """Make a flow startable by name; a plain function is wrapped with `@flow`."""
        registered = item if isinstance(item, Flow) else flow(item)
        self._flows[registered.name] = registered
        return registered

    def _flow(self, name: str | Flow) -> Flow:
        key = name.name if isinstance(name, Flow) else name
        found = self._flows.get(key) if isinstance(key, str) else None
        if found is None:
            known = ", ".join(sorted(self._flows)) or "none"
            raise UnknownFlowError(f"no flow named {key!r} is registered (registered: {known})")
        return found

    @staticmethod
    def stream_of(execution_id: str) -> str:
        """The journal stream of an execution.

        Raises:
            InvalidIdError: the id is not a valid stream id.
        """
        if not isinstance(execution_id, str):
            raise InvalidIdError(execution_id, "an execution id is a str")
        try:
            return validate_stream_id(EXECUTION_PREFIX + execution_id)
        except InvalidIdError as exc:
            raise InvalidIdError(execution_id, exc.reason) from None

    def _lock(self, execution_id: str) -> threading.RLock:
        return self._locks[hash(execution_id) % _LOCK_STRIPES]

    # -- loading --------------------------------------------------------------

    def _remember(self, state: ExecutionState) -> None:
        with self._cache_lock:
            self._cache[state.id] = state
            self._cache.move_to_end(state.id)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def _forget(self, execution_id: str) -> None:
        with self._cache_lock:
            self._cache.pop(execution_id, None)

    def _load(self, execution_id: str) -> ExecutionState:
        stream = self.stream_of(execution_id)
        with self._cache_lock:
            state = self._cache.get(execution_id)
        with _gc_paused():
            return self._load_into(execution_id, stream, state)

    def _load_into(
        self, execution_id: str, stream: str, state: ExecutionState | None
    ) -> ExecutionState:
        if state is not None and state.status.finished:
            return state  # a finished run's journal never changes: no store round trip
        try:
            if state is not None:
                try:
                    tail = self.store.read(stream, state.position)
                except TrimmedError:
                    state = None
                else:
                    fold_records(state, tail, stream)
            if state is None:
                state = self._load_snapshot(execution_id) or ExecutionState(id=execution_id)
                fold_records(state, self.store.read(stream, state.position), stream)
        except StreamDeletedError:
            self._forget(execution_id)
            raise ExecutionNotFoundError(f"execution {execution_id!r} was deleted") from None
        if state.position == 0:
            raise ExecutionNotFoundError(f"no execution with id {execution_id!r}")
        self._remember(state)
        return state

    def _load_snapshot(self, execution_id: str) -> ExecutionState | None:
        stream = SNAPSHOT_PREFIX + execution_id
        head = self.store.head(stream)
        if head == 0:
            return None
        (record,) = self.store.read(stream, head - 1, 1)
        try:
            data = json.loads(record.payload)
        except ValueError as exc:
            raise SchemaError(f"snapshot is not JSON: {exc}", stream=stream, position=head) from exc
        return ExecutionState.from_snapshot(data)

    # -- driving ----------------------------------------------------------------

    def _append(self, state: ExecutionState, events: list[Event]) -> None:
        stream = self.stream_of(state.id)
        now = self.clock()
        self.store.append(stream, state.position, [encode_event(e, now) for e in events])
        for event in events:
            state.apply(event)

    def _drive(self, state: ExecutionState) -> None:
        """Re-run the flow from the top until it parks or ends.

        Raises:
            ConflictError: another writer moved the journal (this run stopped).
            NonDeterminismError, InvalidArgumentError: the code misused or diverged
                from the journal; the journal is left as it was.
        """
        if state.status is not Status.RUNNING:
            return
        definition = self._flow(state.flow)
        try:
            if definition.is_async:
                result = _run_coroutine(definition.fn(AsyncContext(self, state), state.input))
            else:
                result = definition.fn(Context(self, state), state.input)
        except Unwind as unwind:
            if unwind.error is not None:
                raise unwind.error from None
            return
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            self._append(state, [ExecutionFailed(error_info(exc))])
            return
        data = to_json(result, f"the result of flow {definition.name!r}")
        self._append(state, [ExecutionCompleted(data)])

    def _drive_quietly(self, state: ExecutionState) -> None:
        """Drive, treating a racing writer as the one now in charge of the run."""
        try:
            self._drive(state)
        except ConflictError:
            self._forget(state.id)

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
        definition = self._flow(flow_name)
        data = to_json(input, "the flow input")
        execution_id = key if key is not None else uuid.uuid4().hex
        stream = self.stream_of(execution_id)
        event = ExecutionStarted(definition.name, definition.code_hash, data, key, parent)
        with self._lock(execution_id):
            try:
                self.store.append(stream, 0, [encode_event(event, self.clock())])
            except ConflictError:
                return self.get(execution_id)
            except StreamDeletedError:
                raise ExecutionNotFoundError(
                    f"execution {execution_id!r} was deleted; its key cannot start another run"
                ) from None
            state = ExecutionState(id=execution_id)
            state.apply(event)
            self._remember(state)
            self._drive_quietly(state)
            execution = Execution.of(state)
        return self._settled(execution)

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
                the resume is refused instead of feeding that one.

        Raises:
            ExecutionNotFoundError: no such execution.
            NotSuspendedError: the run is not parked at a gate (running, finished, or
                asleep on a timer); nothing is buffered.
            ConflictError: another writer resumed or moved the run first.
            InvalidArgumentError: the payload is not JSON, or the key is not a str.
        """
        data = to_json(payload, "the resume payload")
        if key is not None and (not isinstance(key, str) or not key):
            raise InvalidArgumentError(f"a resume key is a non-empty str, not {key!r}")
        return self._resume(execution_id, data, key, timer=False, on=on)

    def _resume(
        self,
        execution_id: str,
        data: Any,
        key: str | None,
        *,
        timer: bool,
        on: str | None = None,
    ) -> Execution:
        with self._lock(execution_id):
            state = self._load(execution_id)
            if key is not None and key in state.resume_keys:
                return Execution.of(state)
            gate = state.pending_gate
            if gate is None:
                raise NotSuspendedError(execution_id, state.status)
            if (gate.on == TIMER_GATE) != timer:
                detail = (
                    f"it sleeps until {gate.wake_at}; fire_due_timers wakes it"
                    if gate.on == TIMER_GATE
                    else f"it waits on {gate.on!r}, not on a timer"
                )
                raise NotSuspendedError(execution_id, "suspended", detail)
            if on is not None and gate.on != on:
                raise NotSuspendedError(
                    execution_id, "suspended", f"it waits on {gate.on!r}, not {on!r}"
                )
            try:
                self._append(state, [ExecutionResumed(data, key)])
            except ConflictError:
                self._forget(execution_id)
                raise
            self._drive_quietly(state)
            execution = Execution.of(state)
        return self._settled(execution)

    def cancel(self, execution_id: str, reason: str | None = None) -> Execution:
        """End a run: it never starts another step. Cancelling a finished run changes nothing."""
        with self._lock(execution_id):
            while True:
                state = self._load(execution_id)
                if state.status.finished:
                    return Execution.of(state)
                try:
                    self._append(state, [ExecutionCancelled(reason)])
                except ConflictError:
                    self._forget(execution_id)
                    continue
                break
        return self._settled(Execution.of(state))

    def get(self, execution_id: str) -> Execution:
        """The execution's current view.

        Raises:
            ExecutionNotFoundError: no such execution.
        """
        with self._lock(execution_id):
            return Execution.of(self._load(execution_id))

    def state(self, execution_id: str) -> ExecutionState:
        """A copy of the execution's full folded state (frames, gates, variables)."""
        with self._lock(execution_id):
            return self._load(execution_id).copy()

    def frames(self, execution_id: str) -> Mapping[int, StepFrame]:
        """The execution's recorded steps by call index, read-only.

        A shallow copy (frames are not copied), so it is cheap and a run driven
        meanwhile does not change it under the caller.
        """
        with self._lock(execution_id):
            return MappingProxyType(dict(self._load(execution_id).steps))

    def history(self, execution_id: str) -> list[HistoryEntry]:
        """The decoded journal (from the last snapshot on, if the run was compacted)."""
        stream = self.stream_of(execution_id)
        try:
            try:
                records = self.store.read(stream)
            except TrimmedError as exc:
                records = self.store.read(stream, exc.floor)
        except StreamDeletedError:
            raise ExecutionNotFoundError(f"execution {execution_id!r} was deleted") from None
        if not records:
            raise ExecutionNotFoundError(f"no execution with id {execution_id!r}")
        events = decode_events(records, stream)
        return [
            HistoryEntry(r.position, r.timestamp, e) for r, e in zip(records, events, strict=True)
        ]

    def executions(self) -> Iterator[Execution]:
        """Every execution in the store, in id order."""
        after: str | None = None
        while names := self.store.streams(EXECUTION_PREFIX, after, 500):
            for name in names:
                try:
                    yield self.get(name.removeprefix(EXECUTION_PREFIX))
                except ExecutionNotFoundError:
                    continue
            after = names[-1]

    def recover(self) -> list[str]:
        """Drive every run left running (by a crash, or a process that stopped mid-run),
        and call the listeners again for every parked or ended run.

        A run that cannot be driven (its flow diverged from its journal, say) does not
        stop the others: every run is tried, then the first such error is raised.

        Returns:
            The ids of the executions it drove.
        """
        driven = []
        failures: list[LoomError] = []
        for view in list(self.executions()):
            execution = view
            if view.status is Status.RUNNING and view.flow in self._flows:
                try:
                    with self._lock(view.id):
                        state = self._load(view.id)
                        if state.status is Status.RUNNING:
                            self._drive_quietly(state)
                            driven.append(view.id)
                        execution = Execution.of(state)
                except LoomError as exc:
                    _log.warning("recover: execution %r: %s: %s", view.id, type(exc).__name__, exc)
                    failures.append(exc)
                    continue
            if self._listeners:
                self._settled(execution)
        if failures:
            raise failures[0]
        return driven

    def fire_due_timers(self) -> list[str]:
        """Wake every run whose timer is due by the engine's clock.

        A run that cannot be woken (its flow diverged from its journal, say) does not
        stop the others: every due timer is tried, then the first such error is raised.

        Returns:
            The ids of the executions it woke.
        """
        now = self.clock()
        woken: list[str] = []
        failures: list[LoomError] = []
        for stream, head, entries in self.timers.due_buckets(now):
            settled = True
            for entry in entries:
                if entry.wake_at > now:
                    settled = False
                    continue
                try:
                    outcome = self._fire(entry.execution_id, entry.gate, now)
                except (ConflictError, NotSuspendedError):
                    settled = False  # another worker moved the run: look again next time
                    continue
                except LoomError as exc:
                    _log.warning("timer of %r: %s: %s", entry.execution_id, type(exc).__name__, exc)
                    failures.append(exc)
                    settled = False
                    continue
                if outcome is None:
                    settled = False
                elif outcome:
                    woken.append(entry.execution_id)
            if settled:
                self.timers.settle(stream, head, now)
        if failures:
            raise failures[0]
        return woken

    def _fire(self, execution_id: str, gate: int, now: float) -> bool | None:
        """Wake one timer: True if woken, False if the hint is obsolete, None if not yet known."""
        with self._lock(execution_id):
            try:
                state = self._load(execution_id)
            except ExecutionNotFoundError:
                return False
            if state.status.finished:
                return False
            if gate >= len(state.gates):
                return None  # the hint is ahead of the journal: the suspend may still land
            if gate < len(state.resume_payloads):
                return False  # already woken
            recorded = state.gates[gate]
            if recorded.on != TIMER_GATE or recorded.wake_at is None or recorded.wake_at > now:
                return False  # a hint from an earlier attempt; the recorded wake has its own
            self._resume(execution_id, None, f"timer:{gate}", timer=True)
            return True

    def compact(self, execution_id: str) -> int:
        """Snapshot the folded state, then trim the journal below it (K10.4).

        The snapshot is written first, so a crash between the two writes loses
        nothing. Returns the position the snapshot covers.
        """
        with self._lock(execution_id):
            state = self._load(execution_id)
            stream = SNAPSHOT_PREFIX + execution_id
            payload = json.dumps(state.to_snapshot(), separators=(",", ":")).encode()
            while True:
                head = self.store.head(stream)
                try:
                    self.store.append(
                        stream, head, [NewRecord(SNAPSHOT_KIND, payload, self.clock())]
                    )
                except ConflictError:
                    continue
                break
            self.store.trim(stream, head + 1)
            self.store.trim(self.stream_of(execution_id), state.position + 1)
            return state.position
