"""Every error of the tree survives pickling and is shown by its public name."""

from __future__ import annotations

import pickle
from typing import Any

import loom_kernel
import loom_orchestration
import pytest
from loom_kernel import (
    BlobNotFoundError,
    CanonicalJSONError,
    CodeVersionError,
    ConflictError,
    Context,
    Engine,
    ExecutionEndedError,
    ExecutionNotFoundError,
    GateTimeoutError,
    InvalidArgumentError,
    InvalidIdError,
    LoomError,
    MemoryStore,
    NonDeterminismError,
    NotFoundError,
    NotSuspendedError,
    ResultTimeoutError,
    RetryPolicy,
    RunBusyError,
    RunFinishedError,
    SchemaError,
    StepFailedError,
    StoreMisconfiguredError,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
    UnknownFlowError,
    flow,
)
from loom_kernel.testing import NotApplicable
from loom_orchestration import (
    ChainEndedError,
    ChainNotFoundError,
    ChildCancelledError,
    ChildFailedError,
    ChildIdTakenError,
    ScheduleExistsError,
    ScheduleNotFoundError,
    SupervisorEscalationError,
)

EXAMPLES: list[LoomError] = [
    LoomError("plain"),
    InvalidArgumentError("bad"),
    InvalidIdError("a//b", "has an empty segment"),
    CanonicalJSONError("$.a[1]", "NaN"),
    ConflictError("ex/a", 3, 5),
    NotFoundError("gone"),
    StreamDeletedError("ex/a", 4),
    TrimmedError("ex/a", 1, 6),
    SchemaError("broken", kind="K", version="1.0.0", stream="ex/a", position=2),
    StoreUnavailableError("down"),
    StoreMisconfiguredError("no bucket"),
    BlobNotFoundError("no blob sha256:00"),
    UnknownFlowError("no flow"),
    ExecutionNotFoundError("no run"),
    NotSuspendedError("a", "running", "detail"),
    NonDeterminismError("a", "step", 3, "charge", "refund"),
    CodeVersionError("a", "approval", "version:1", ["version:2"]),
    StepFailedError("charge", "builtins.ValueError", "no", 3),
    ExecutionEndedError("a", "failed", "builtins.ValueError", "no"),
    ResultTimeoutError("a", "running", 2.5),
    GateTimeoutError("a", "approve", 60.0),
    RunFinishedError("a", "completed"),
    RunFinishedError("a", "completed", 3),
    RunBusyError("a", 15.0),
    ChildIdTakenError("p/c0", "p", None, "approval"),
    ChildFailedError("p/c0", "builtins.ValueError", "no"),
    ChildCancelledError("p/c0", "by hand"),
    SupervisorEscalationError("too many restarts"),
    ScheduleNotFoundError("no schedule 'nightly'"),
    ScheduleExistsError("schedule 'nightly' exists already"),
    ChainNotFoundError("no chain 'sentinel'"),
    ChainEndedError("sentinel", "sentinel@4", "completed"),
    ChainEndedError("sentinel", "sentinel@4", "failed", 17),
]


def _subclasses(cls: type[BaseException]) -> set[type[BaseException]]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found


def test_every_public_error_class_has_an_example() -> None:
    public = {
        cls
        for cls in _subclasses(LoomError) | {LoomError}
        if not cls.__name__.startswith("_") and cls.__module__.split(".")[0].startswith("loom_")
    }
    assert public <= {type(error) for error in EXAMPLES} | {NotApplicable}


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda error: type(error).__name__)
def test_every_error_round_trips_through_pickle(error: LoomError) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert str(again) == str(error)
    assert again.args == error.args
    assert vars(again) == vars(error)


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda error: type(error).__name__)
def test_errors_are_named_by_their_public_module(error: LoomError) -> None:
    cls = type(error)
    assert cls.__module__ in ("loom_kernel", "loom_orchestration")
    namespace = loom_kernel if cls.__module__ == "loom_kernel" else loom_orchestration
    assert getattr(namespace, cls.__name__) is cls


def test_the_journal_records_an_error_by_its_public_name() -> None:
    @flow
    def doomed(ctx: Context, _input: Any) -> Any:
        def fail() -> None:
            raise ValueError("no")

        return ctx.step("fail", fail)

    engine = Engine(MemoryStore(), [doomed], retry=RetryPolicy(attempts=1), listeners=[])
    failed = engine.start("doomed")
    assert failed.error is not None
    assert failed.error.type == "loom_kernel.StepFailedError"
    assert engine.frames(failed.id)[0].error.type == "ValueError"  # type: ignore[union-attr]
