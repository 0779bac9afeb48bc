"""The fold: an execution's state is a pure function of its journal."""

from __future__ import annotations

import copy
import enum
from collections.abc import Iterable, Sequence
from typing import Any, Final, Protocol

import attrs

from loom_kernel._core._codec import CONVERTER, decode_envelope, parse_envelopes
from loom_kernel._core._errors import SchemaError
from loom_kernel._core._events import (
    EVENT_SCHEMA,
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
)
from loom_kernel._core._fast_fold import STEP_FIELDS, STEP_KIND, step_runs
from loom_kernel._core._records import Record, check_gapless

_STEP_KEYS: Final = frozenset(STEP_FIELDS)

__all__ = [
    "RESUME_PAYLOAD",
    "RESUME_PAYLOADS",
    "ExecutionState",
    "Gate",
    "Status",
    "StepFrame",
    "fold",
    "fold_records",
]

#: The latest resume payload (kept for compatibility with pre-1.16 readers).
RESUME_PAYLOAD: Final = "_resumePayload"
#: Every resume payload in order, append-only (ADR 0057, schema 1.16.0).
RESUME_PAYLOADS: Final = "_resumePayloads"
#: Code migrations, append-only audit.
MIGRATIONS: Final = "_migrations"


class StepData(Protocol):
    """A decoded STEP_COMPLETED payload (a msgspec struct on the fast fold)."""

    @property
    def index(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def result(self) -> Any: ...
    @property
    def attempts(self) -> int: ...


class Status(enum.StrEnum):
    """Where an execution stands."""

    RUNNING = "running"
    SUSPENDED = "suspended"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """True for completed, failed and cancelled: nothing more will run."""
        return self in (Status.COMPLETED, Status.FAILED, Status.CANCELLED)


@attrs.define
class StepFrame:
    """A recorded step: its name and its result, or the error that exhausted its retries."""

    name: str
    result: Any = None
    error: ErrorInfo | None = None
    attempts: int = 1


@attrs.define
class Gate:
    """A recorded suspend: what it waits on, and for a timer when it wakes."""

    on: str
    wake_at: float | None = None


def _variables() -> dict[str, Any]:
    return {RESUME_PAYLOADS: [], MIGRATIONS: []}


@attrs.define
class ExecutionState:
    """The fold of an execution's journal.

    Attributes:
        id: the execution id.
        position: the journal position folded up to.
        status: running, suspended, completed, failed or cancelled.
        flow: the flow's registered name.
        code_hash: the pinned hash of the flow's code.
        input: the flow's input (JSON).
        key: the idempotency key it was started with, if any.
        parent: the execution that started it, if any.
        retry_of: the run this one starts again (`Engine.fork`), if any.
        trace: the trace context its start journaled (`loom_kernel.otel`), if any.
        steps: recorded steps by call index.
        gates: every recorded suspend, in order; gate i is resumed by payload i.
        result: the flow's return value, once completed.
        error: the uncaught error, once failed.
        cancel_reason: why it was cancelled, once cancelled.
        variables: fold keys: `_resumePayload` (latest), `_resumePayloads` (ordered,
            append-only) and `_migrations` (append-only audit).
        resume_keys: dedupe keys of the resumes delivered so far.
        owner: the worker driving the run while it is running (the `by` of its last
            start, resume or claim), else None.
        queue: the queue whose workers alone drive it, if it was enqueued on one.
        generation: which run of this id it is: 1, then one more for each run of the
            id that retention deleted before it started (EXECUTION_DELETED).
        deleted: whether the fold ended at a deletion: there is no run (until a start
            with the id begins generation `generation`).
    """

    id: str
    position: int = 0
    status: Status = Status.RUNNING
    flow: str = ""
    code_hash: str = ""
    input: Any = None
    key: str | None = None
    parent: str | None = None
    retry_of: str | None = None
    trace: str | None = None
    steps: dict[int, StepFrame] = attrs.Factory(dict)
    gates: list[Gate] = attrs.Factory(list)
    result: Any = None
    error: ErrorInfo | None = None
    cancel_reason: str | None = None
    variables: dict[str, Any] = attrs.Factory(_variables)
    resume_keys: list[str] = attrs.Factory(list)
    owner: str | None = None
    queue: QueuePlace | None = None
    generation: int = 1
    deleted: bool = False

    @property
    def resume_payloads(self) -> list[Any]:
        """The ordered resume payloads: gate i passes through with entry i."""
        payloads: list[Any] = self.variables[RESUME_PAYLOADS]
        return payloads

    @property
    def pending_gate(self) -> Gate | None:
        """The gate the run is parked at, or None when it is not suspended."""
        if self.status is not Status.SUSPENDED:
            return None
        return self.gates[len(self.resume_payloads)]

    def record_step(self, index: int, name: str, result: Any, attempts: int) -> None:
        """Fold one completed step: it becomes the frame at `index` (the journal's next
        position). Every path that folds or journals a step comes here or to
        `record_steps`."""
        self.steps[index] = StepFrame(name, result, None, attempts)
        self.position += 1

    def record_steps(self, steps: Sequence[StepData]) -> None:
        """`record_step` for each of a run of decoded steps, at once (the fast fold)."""
        self.steps.update(
            {step.index: StepFrame(step.name, step.result, None, step.attempts) for step in steps}
        )
        self.position += len(steps)

    def apply_records(self, records: Sequence[Record], stream: str) -> None:
        """Fold stored records by decoding each (upcasters, schema checks) and applying it.

        A completed step written under the current schema, in exactly its shape,
        skips building the event object: it goes straight to `record_step`.
        """
        for record, envelope in zip(records, parse_envelopes(records, stream), strict=True):
            current = type(envelope) is dict and envelope.get("v") == EVENT_SCHEMA
            if current and record[1] == STEP_KIND:
                data = envelope.get("d")
                if type(data) is dict and data.keys() == _STEP_KEYS:
                    index, name, attempts = data["index"], data["name"], data["attempts"]
                    if type(index) is int and type(name) is str and type(attempts) is int:
                        self.record_step(index, name, data["result"], attempts)
                        continue
            self.apply(decode_envelope(record, envelope, stream))

    def apply(self, event: Event) -> None:
        """Fold one more event into this state (in place; the journal's next position)."""
        if isinstance(event, StepCompleted):
            self.record_step(event.index, event.name, event.result, event.attempts)
            return
        self.position += 1
        if isinstance(event, ExecutionSuspended):
            self.gates.append(Gate(event.on, event.wake_at))
            self.status, self.owner = Status.SUSPENDED, None
        elif isinstance(event, ExecutionResumed):
            self.variables[RESUME_PAYLOAD] = event.payload
            self.resume_payloads.append(event.payload)
            if event.key is not None:
                self.resume_keys.append(event.key)
            self.status, self.owner = Status.RUNNING, event.by
        elif isinstance(event, ExecutionStarted):
            self.deleted = False
            self.flow, self.code_hash, self.input = event.flow, event.code_hash, event.input
            self.key, self.parent, self.queue = event.key, event.parent, event.queue
            self.retry_of, self.trace = event.retry_of, event.trace
            self.status, self.owner = Status.RUNNING, event.by
        elif isinstance(event, StepFailed):
            self.steps[event.index] = StepFrame(event.name, None, event.error, event.attempts)
        elif isinstance(event, ExecutionCompleted):
            self.result, self.status, self.owner = event.result, Status.COMPLETED, None
        elif isinstance(event, ExecutionFailed):
            self.error, self.status, self.owner = event.error, Status.FAILED, None
        elif isinstance(event, ExecutionCancelled):
            self.cancel_reason, self.status, self.owner = event.reason, Status.CANCELLED, None
        elif isinstance(event, ExecutionClaimed):
            self.owner = event.by
        elif isinstance(event, ExecutionMigrated):
            self.variables[MIGRATIONS].append(
                {"from": event.from_hash, "to": event.to_hash, "reason": event.reason}
            )
            self.code_hash = event.to_hash
        elif isinstance(event, ExecutionDeleted):
            self._start_over(event.generation)

    def _start_over(self, generation: int) -> None:
        """Become no run at this position: every field but the id and the position as
        a fresh state has it, the next generation's number, and `deleted`.

        Raises:
            SchemaError: the number is not past this state's generation.
        """
        if type(generation) is not int or generation <= self.generation:
            raise SchemaError(
                f"a deletion names generation {generation!r}, not one past {self.generation}",
                kind=ExecutionDeleted.KIND,
            )
        blank = ExecutionState(self.id, self.position, generation=generation, deleted=True)
        for field in attrs.fields(ExecutionState):
            setattr(self, field.name, getattr(blank, field.name))

    def copy(self) -> ExecutionState:
        """An independent copy (folding into it leaves this state alone)."""
        return copy.deepcopy(self)

    def to_snapshot(self) -> dict[str, Any]:
        """The state as JSON data, tagged with the schema it was written under."""
        data: dict[str, Any] = CONVERTER.unstructure(self)
        data["steps"] = [[index, frame] for index, frame in data["steps"].items()]
        return {"schema": EVENT_SCHEMA, "state": data}

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any]) -> ExecutionState:
        """Rebuild a state from `to_snapshot` data, including pre-1.16 snapshots.

        A snapshot written before schema 1.16.0 folded only `_resumePayload`; it is
        read as a one-entry `_resumePayloads` list (ADR 0057's legacy fallback).

        Raises:
            SchemaError: the snapshot is from a newer major schema or is malformed.
        """
        try:
            version = str(snapshot["schema"])
            data = dict(snapshot["state"])
            if int(version.split(".", maxsplit=1)[0]) > int(EVENT_SCHEMA.split(".")[0]):
                raise SchemaError("snapshot from a newer major schema", version=version)
            variables = dict(data.get("variables") or {})
            if RESUME_PAYLOADS not in variables:
                legacy = [variables[RESUME_PAYLOAD]] if RESUME_PAYLOAD in variables else []
                variables[RESUME_PAYLOADS] = legacy
            variables.setdefault(MIGRATIONS, [])
            data["variables"] = variables
            data["steps"] = {int(index): frame for index, frame in data.get("steps", [])}
            state: ExecutionState = CONVERTER.structure(data, cls)
        except SchemaError:
            raise
        except Exception as exc:  # KeyError, TypeError, ValueError, cattrs' error groups
            raise SchemaError(f"malformed snapshot: {exc!r}") from exc
        return state


def fold_records(state: ExecutionState, records: list[Record], stream: str) -> None:
    """Fold stored records into `state` in place: the same as decoding each and applying it.

    Runs of completed steps (most of any journal) go through the fast fold when
    msgspec is installed; otherwise, or when a payload does not fit it, through
    `ExecutionState.apply_records`. A property test holds both to the same fold.

    Raises:
        SchemaError: a record is missing (the records are not exactly the positions
            after `state.position`), or one cannot be decoded.
    """
    check_gapless(records, state.position, stream)
    runs = step_runs(records)
    if runs is None:
        state.apply_records(records, stream)
        return
    for start, end, steps in runs:
        if steps is None:
            state.apply_records(records[start:end], stream)
        else:
            state.record_steps(steps)


def fold(events: Iterable[Event], start: ExecutionState | str) -> ExecutionState:
    """Fold events into an execution state; pure (a given start state is not changed).

    Args:
        events: the journal's events in order, after `start`'s position.
        start: a snapshot state to continue from, or the execution id to fold from empty.

    Returns:
        The folded state.
    """
    state = ExecutionState(id=start) if isinstance(start, str) else start.copy()
    for event in events:
        state.apply(event)
    return state
