"""The kernel's error tree: every error Loom raises on purpose derives from LoomError."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CanonicalJSONError",
    "CodeVersionError",
    "ConflictError",
    "ExecutionEndedError",
    "ExecutionNotFoundError",
    "GateTimeoutError",
    "InvalidArgumentError",
    "InvalidIdError",
    "LoomError",
    "NonDeterminismError",
    "NotFoundError",
    "NotSuspendedError",
    "ResultTimeoutError",
    "RunBusyError",
    "RunFinishedError",
    "SchemaError",
    "StepFailedError",
    "StoreMisconfiguredError",
    "StoreUnavailableError",
    "StreamDeletedError",
    "TrimmedError",
    "UnknownFlowError",
    "publish_errors",
]


def _restore(cls: type[LoomError], args: tuple[object, ...], state: dict[str, object]) -> LoomError:
    """Rebuild a pickled error without calling its __init__ (whose signature varies)."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


def publish_errors(module: str, exported: Iterable[object]) -> None:
    """Name the exported error classes by the public module that exports them.

    Tracebacks, reprs and the journal's error records then say
    `loom_kernel.StepFailedError`, not the private module that defines it; pickle
    finds them there too.
    """
    for value in exported:
        if isinstance(value, type) and issubclass(value, BaseException):
            value.__module__ = module


class LoomError(Exception):
    """Root of every error the kernel and its stores raise on purpose.

    Every error of the tree survives pickling (across a process pool, say) with its
    message and attributes, whatever its constructor takes.
    """

    def __reduce__(self) -> tuple[object, ...]:
        return (_restore, (type(self), self.args, dict(self.__dict__)))


class InvalidArgumentError(LoomError, ValueError):
    """An argument is malformed (a negative position, an empty batch, a bad kind...)."""


class InvalidIdError(InvalidArgumentError):
    """An id (a stream name, a prefix) breaks the id rules; nothing was read or written.

    Attributes:
        value: the offending id, as given.
        reason: which rule it breaks.
    """

    def __init__(self, value: object, reason: str) -> None:
        self.value = value
        self.reason = reason
        super().__init__(f"invalid id {value!r}: {reason}")


class CanonicalJSONError(InvalidArgumentError):
    """A value cannot be written as canonical JSON (a cycle, NaN, a non-str key, too deep...).

    Attributes:
        path: where in the value the problem is, as a JSONPath-like string ("$.a[3]").
        reason: what is wrong there.
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot write canonical JSON at {path}: {reason}")


class ConflictError(LoomError):
    """An append found the stream's head elsewhere than expected; nothing was written.

    Attributes:
        stream: the stream appended to.
        expected: the head the caller expected.
        actual: the head the store found (best knowledge at the time of the refusal).
    """

    def __init__(self, stream: str, expected: int, actual: int) -> None:
        self.stream = stream
        self.expected = expected
        self.actual = actual
        super().__init__(f"conflict on stream {stream!r}: expected head {expected}, found {actual}")


class NotFoundError(LoomError):
    """Something looked up by name or id does not exist."""


class StreamDeletedError(NotFoundError):
    """The stream was deleted; its name is retired so its positions are never reused.

    Attributes:
        stream: the deleted stream.
        head: its head when it was deleted.
    """

    def __init__(self, stream: str, head: int) -> None:
        self.stream = stream
        self.head = head
        super().__init__(
            f"stream {stream!r} was deleted at head {head}; "
            "a deleted stream's name is retired and its positions are never reused"
        )


class TrimmedError(NotFoundError):
    """A read asked for records that compaction already dropped.

    Attributes:
        stream: the stream read.
        after: the position the caller asked to read after.
        floor: the last trimmed position; reads must start at or after it.
    """

    def __init__(self, stream: str, after: int, floor: int) -> None:
        self.stream = stream
        self.after = after
        self.floor = floor
        super().__init__(
            f"stream {stream!r} is trimmed up to position {floor}: "
            f"cannot read after {after} (read after {floor} or later, from a snapshot)"
        )


class SchemaError(LoomError):
    """A record cannot be decoded: unknown kind, newer major schema, or a malformed payload.

    Attributes:
        kind: the record's kind.
        version: the schema version the record carries (None when unreadable).
        stream: the stream the record came from (None when unknown).
        position: the record's position (None when unknown).
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str | None = None,
        version: str | None = None,
        stream: str | None = None,
        position: int | None = None,
    ) -> None:
        self.kind = kind
        self.version = version
        self.stream = stream
        self.position = position
        where = []
        if stream is not None:
            where.append(f"stream {stream!r}")
        if position is not None:
            where.append(f"position {position}")
        if kind is not None:
            where.append(f"kind {kind!r}")
        if version is not None:
            where.append(f"schema {version}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class StoreUnavailableError(LoomError):
    """A transient fault in the store's backend (I/O error, timeout, throttling, a lock).

    The operation may be retried. For an append, the store has already done what it
    could to learn whether the write landed; when it raises this error the write did
    not land or could not be confirmed, so callers must re-read before retrying.
    """


class StoreMisconfiguredError(LoomError):
    """The store refuses on purpose and will go on refusing until its setup changes.

    Missing or wrong credentials, a permission denied, a bucket or directory that
    does not exist, a read-only database, a file that is not a database. Retrying
    cannot help, so callers should stop and report it; the message says what to fix.
    Nothing was written.
    """


class UnknownFlowError(NotFoundError):
    """No flow of that name is registered with the engine."""


class ExecutionNotFoundError(NotFoundError):
    """No execution has that id."""


class NotSuspendedError(LoomError):
    """A resume reached a run that is not parked at a gate (running, finished, or on a timer).

    Suspends and resumes strictly alternate (ADR 0057): a payload is never buffered
    for a later gate.

    Attributes:
        execution_id: the execution.
        status: its status when the resume was refused.
    """

    def __init__(self, execution_id: str, status: str, detail: str = "") -> None:
        self.execution_id = execution_id
        self.status = status
        super().__init__(
            f"execution {execution_id!r} is {status}, not parked at a gate"
            + (f": {detail}" if detail else "")
        )


class NonDeterminismError(LoomError):
    """A re-run of a flow diverged from its journal; the journal was left untouched.

    Attributes:
        execution_id: the execution.
        what: "step" or "gate": the sequence the call is in.
        index: the position of the call in its sequence (steps or gates).
        recorded: what the journal recorded there.
        found: what the code asked for this time.
    """

    def __init__(self, execution_id: str, what: str, index: int, recorded: str, found: str) -> None:
        self.execution_id = execution_id
        self.what = what
        self.index = index
        self.recorded = recorded
        self.found = found
        super().__init__(
            f"non-determinism in execution {execution_id!r}: {what} #{index} was recorded as "
            f"{recorded!r} but the code now asks for {found!r}; the flow's code changed "
            "between runs, or it branches on something that is not journaled "
            "(see docs/determinism.md)"
        )


class CodeVersionError(LoomError):
    """A run is pinned to code this engine does not have; nothing was journaled.

    An execution pins its flow's code hash at start (K11). Driving it with other code
    is refused: keep the old version registered beside the new one, or migrate the
    run with `Engine.resume_as` once its history replays on the new code.

    Attributes:
        execution_id: the execution.
        flow: the flow's name.
        pinned: the code hash the run is pinned to.
        registered: the code hashes of that flow this engine has.
    """

    def __init__(self, execution_id: str, flow: str, pinned: str, registered: list[str]) -> None:
        self.execution_id = execution_id
        self.flow = flow
        self.pinned = pinned
        self.registered = registered
        have = ", ".join(registered) or "none"
        super().__init__(
            f"execution {execution_id!r} of flow {flow!r} is pinned to code {pinned!r}, and "
            f"this engine has {have}; keep that version registered beside the new one "
            f"(engine.register(old_flow, newest=False)), or migrate the run once its history "
            f"replays on "
            f"the new code: engine.resume_as({execution_id!r}, ...) (docs/versioning.md)"
        )


class StepFailedError(LoomError):
    """A step exhausted its retry policy. Raised inside the flow, which may catch it.

    Attributes:
        step: the step's name.
        error_type: the qualified type name of the step's last error.
        error_message: its message.
        attempts: how many times the step ran.
    """

    def __init__(self, step: str, error_type: str, error_message: str, attempts: int) -> None:
        self.step = step
        self.error_type = error_type
        self.error_message = error_message
        self.attempts = attempts
        super().__init__(
            f"step {step!r} failed after {attempts} attempt(s): {error_type}: {error_message}"
        )


class ExecutionEndedError(LoomError):
    """A run a caller waited on for its result failed or was cancelled.

    Attributes:
        execution_id: the execution.
        status: "failed" or "cancelled".
        error_type: for a failed run, the qualified type name of its uncaught error.
        error_message: for a failed run, that error's message; for a cancelled one,
            the reason given, if any.
    """

    def __init__(
        self, execution_id: str, status: str, error_type: str | None, error_message: str | None
    ) -> None:
        self.execution_id = execution_id
        self.status = status
        self.error_type = error_type
        self.error_message = error_message
        what = f": {error_type}: {error_message}" if error_type else ""
        if not error_type and error_message:
            what = f": {error_message}"
        super().__init__(f"execution {execution_id!r} {status}{what}")


class ResultTimeoutError(LoomError, TimeoutError):
    """A run did not finish within the time a caller waited for its result.

    Attributes:
        execution_id: the execution (it goes on; wait again, or look with `get`).
        status: its status when the wait ended.
        timeout: the seconds the caller waited.
    """

    def __init__(self, execution_id: str, status: str, timeout: float) -> None:
        self.execution_id = execution_id
        self.status = status
        self.timeout = timeout
        super().__init__(
            f"execution {execution_id!r} is still {status} after {timeout:g} s; it goes on"
        )


class GateTimeoutError(LoomError, TimeoutError):
    """A gate's timeout passed before a resume came (`ctx.suspend(on, timeout=...)`).
    Raised inside the flow, which may catch it; a replay raises it at the same gate.

    Attributes:
        execution_id: the execution.
        gate: the gate's name.
        timeout: the seconds it waited.
    """

    def __init__(self, execution_id: str, gate: str, timeout: float) -> None:
        self.execution_id = execution_id
        self.gate = gate
        self.timeout = timeout
        super().__init__(
            f"execution {execution_id!r}: gate {gate!r} was not resumed within {timeout:g} s"
        )


class RunBusyError(LoomError):
    """A resume made inside a drive (from a step) found the run it resumes held by
    another drive of this engine for longer than it waits: the two may be waiting for
    each other (run A's step resumes B while B's step resumes A). Raised in the step,
    which fails (and is retried by its policy); nothing was journaled.

    Attributes:
        execution_id: the run resumed.
        waited: the seconds the resume waited.
    """

    def __init__(self, execution_id: str, waited: float) -> None:
        self.execution_id = execution_id
        self.waited = waited
        super().__init__(
            f"execution {execution_id!r} was held by another drive of this engine for "
            f"{waited:g} s: a resume from inside a step waits no longer (the runs may be "
            "waiting for each other); nothing was journaled"
        )


class RunFinishedError(LoomError):
    """A message was sent to a run that has finished: nothing will ever read it.

    Attributes:
        execution_id: the execution.
        status: "completed", "failed" or "cancelled".
        position: the message's place in the run's inbox when it was appended there
            before the run finished (a send racing the run's end), else None.
    """

    def __init__(self, execution_id: str, status: str, position: int | None = None) -> None:
        self.execution_id = execution_id
        self.status = status
        self.position = position
        race = (
            f"; the message (inbox position {position}) landed as it finished, unread"
            if position is not None
            else "; nothing was sent"
        )
        super().__init__(f"execution {execution_id!r} is {status}: it reads no more messages{race}")
