"""The fold: an execution's state is a pure function of its journal."""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Iterable, Sequence
from itertools import groupby
from operator import attrgetter, itemgetter
from typing import Any, Final

import attrs

from loom_kernel._codec import CONVERTER, decode_envelope, parse_envelopes
from loom_kernel._errors import SchemaError
from loom_kernel._events import (
    EVENT_SCHEMA,
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
)
from loom_kernel._fast_steps import StepEnvelope, decode_steps
from loom_kernel._journal import Record, check_gapless

STEP_KIND: Final = StepCompleted.KIND
_KIND: Final = itemgetter(1)  # of a Record
_PAYLOAD: Final = itemgetter(2)
_DATA: Final = attrgetter("d")  # of a decoded step envelope

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
        steps: recorded steps by call index.
        gates: every recorded suspend, in order; gate i is resumed by payload i.
        result: the flow's return value, once completed.
        error: the uncaught error, once failed.
        cancel_reason: why it was cancelled, once cancelled.
        variables: fold keys: `_resumePayload` (latest), `_resumePayloads` (ordered,
            append-only) and `_migrations` (append-only audit).
        resume_keys: dedupe keys of the resumes delivered so far.
    """

    id: str
    position: int = 0
    status: Status = Status.RUNNING
    flow: str = ""
    code_hash: str = ""
    input: Any = None
    key: str | None = None
    parent: str | None = None
    steps: dict[int, StepFrame] = attrs.Factory(dict)
    gates: list[Gate] = attrs.Factory(list)
    result: Any = None
    error: ErrorInfo | None = None
    cancel_reason: str | None = None
    variables: dict[str, Any] = attrs.Factory(_variables)
    resume_keys: list[str] = attrs.Factory(list)

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

    def apply(self, event: Event) -> None:
        """Fold one more event into this state (in place; the journal's next position)."""
        self.position += 1
        if isinstance(event, StepCompleted):
            self.steps[event.index] = StepFrame(event.name, event.result, None, event.attempts)
        elif isinstance(event, ExecutionSuspended):
            self.gates.append(Gate(event.on, event.wake_at))
            self.status = Status.SUSPENDED
        elif isinstance(event, ExecutionResumed):
            self.variables[RESUME_PAYLOAD] = event.payload
            self.resume_payloads.append(event.payload)
            if event.key is not None:
                self.resume_keys.append(event.key)
            self.status = Status.RUNNING
        elif isinstance(event, ExecutionStarted):
            self.flow, self.code_hash, self.input = event.flow, event.code_hash, event.input
            self.key, self.parent = event.key, event.parent
            self.status = Status.RUNNING
        elif isinstance(event, StepFailed):
            self.steps[event.index] = StepFrame(event.name, None, event.error, event.attempts)
        elif isinstance(event, ExecutionCompleted):
            self.result, self.status = event.result, Status.COMPLETED
        elif isinstance(event, ExecutionFailed):
            self.error, self.status = event.error, Status.FAILED
        elif isinstance(event, ExecutionCancelled):
            self.cancel_reason, self.status = event.reason, Status.CANCELLED
        elif isinstance(event, ExecutionMigrated):
            self.variables[MIGRATIONS].append(
                {"from": event.from_hash, "to": event.to_hash, "reason": event.reason}
            )
            self.code_hash = event.to_hash

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
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SchemaError(f"malformed snapshot: {exc!r}") from exc
        except Exception as exc:  # cattrs groups its structuring errors
            raise SchemaError(f"malformed snapshot: {exc!r}") from exc
        return state


def fold_records(state: ExecutionState, records: list[Record], stream: str) -> None:
    """Fold stored records into `state` in place: the same as decoding each and applying it.

    A journal is mostly STEP_COMPLETED records; those written under the current schema
    go straight from their parsed payload into a frame, with the same checks the
    decoder makes, instead of through an event object. Everything else takes the
    general path (decode_envelope, upcasters, apply).

    Raises:
        SchemaError: a record is missing (the records are not exactly the positions
            after `state.position`), or one cannot be decoded.
    """
    check_gapless(records, state.position, stream)
    if decode_steps is not None and _fold_typed(state, records, stream, decode_steps):
        return
    envelopes = parse_envelopes(records, stream)
    steps = state.steps
    for record, envelope in zip(records, envelopes, strict=True):
        if record[1] == STEP_KIND:
            try:
                if envelope["v"] == EVENT_SCHEMA:
                    data = envelope["d"]
                    index, name, attempts = data["index"], data["name"], data["attempts"]
                    if (
                        type(index) is int
                        and type(name) is str
                        and type(attempts) is int
                        and len(data) == 4
                    ):
                        steps[index] = StepFrame(name, data["result"], None, attempts)
                        state.position += 1
                        continue
            except (KeyError, TypeError):
                pass  # the general path below names what is wrong
        state.apply(decode_envelope(record, envelope, stream))


def _fold_typed(
    state: ExecutionState,
    records: list[Record],
    stream: str,
    decode: Callable[[bytes], Sequence[StepEnvelope]],
) -> bool:
    """fold_records with the steps decoded by msgspec; False (nothing folded) when any
    step payload does not fit the current schema's shape exactly, for the general path
    to judge.

    A journal is runs of steps between a few other events. Every run of steps is
    decoded first, in one call each, so nothing is folded unless all fit; then each
    run goes into the frames at once, and the others through `apply`, in journal order.
    """
    runs: list[tuple[int, int, Sequence[StepEnvelope] | None]] = []
    position = 0
    for kind, run in groupby(map(_KIND, records)):
        end = position + len(list(run))
        if kind == STEP_KIND:
            try:
                decoded = decode(b"[" + b",".join(map(_PAYLOAD, records[position:end])) + b"]")
            except ValueError:
                return False
            if len(decoded) != end - position:  # a payload held more than one value
                return False
            runs.append((position, end, decoded))
        else:
            runs.append((position, end, None))
        position = end
    steps = state.steps
    for start, end, step_envelopes in runs:
        if step_envelopes is None:
            others = records[start:end]
            for record, envelope in zip(others, parse_envelopes(others, stream), strict=True):
                state.apply(decode_envelope(record, envelope, stream))
        else:
            steps.update(
                {
                    data.index: StepFrame(data.name, data.result, None, data.attempts)
                    for data in map(_DATA, step_envelopes)
                }
            )
            state.position += end - start
    return True


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
