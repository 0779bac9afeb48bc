"""Starting runs: a run's first record, written after its hint in the run index (K9:
a start by key lands once, however many processes race to write it).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any, Final

import attrs

from loom_kernel._coordination import finish_deletion, load
from loom_kernel._core import (
    ConflictError,
    Event,
    ExecutionClaimed,
    ExecutionMigrated,
    ExecutionNotFoundError,
    ExecutionStarted,
    ExecutionState,
    InvalidArgumentError,
    StepCompleted,
    StepFailed,
    StreamDeletedError,
    TrimmedError,
    decode_events,
    encode_event,
    new_execution_id,
    stream_of,
    to_json,
)
from loom_kernel._engine._driver import Driver
from loom_kernel._engine._views import Execution
from loom_kernel._replay import Flow, check_flow_name

__all__ = ["Starts", "fresh_execution_id"]

#: Starts by key tried when retention deletes the run found between looks.
_START_ATTEMPTS: Final = 3
#: The kernel's own steps (a published value, ...) start with this: never reused.
KERNEL_STEP_PREFIX: Final = "loom."

logger = logging.getLogger("loom")


class Starts:
    """Starts runs of one engine."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    def start(
        self, flow_name: str | Flow, input: Any, key: str | None, parent: str | None
    ) -> Execution:
        """Start a run and drive it here until it parks or ends (see `Engine.start`)."""
        driver = self._driver
        execution_id, event = self.new_start(flow_name, input, key, parent, driver.worker_id)
        with driver.locks.hold(execution_id), driver.heartbeat.holding(execution_id):
            state, attempts = None, 0
            while state is None:
                state = self.append_start(event, execution_id)
                if state is not None:
                    break
                try:
                    return driver.execution(execution_id)
                except ExecutionNotFoundError:
                    # Retention deleted the run between the look and the view: the
                    # start is the id's next run (a journal retired by other means
                    # raises from append_start itself).
                    attempts += 1
                    if attempts == _START_ATTEMPTS:
                        raise
            execution = driver.drive_owned(state)
        return driver.settled(execution)

    def fork(self, old_id: str, from_step: int, key: str | None) -> Execution:
        """Start an ended run again as a new run (see `Engine.fork`)."""
        if isinstance(from_step, bool) or not isinstance(from_step, int) or from_step < 0:
            raise InvalidArgumentError(
                f"from_step is a whole number of 0 or more, not {from_step!r}"
            )
        driver = self._driver
        old = driver.execution(old_id)
        if not old.status.finished:
            raise InvalidArgumentError(
                f"{old_id} is {old.status.value}: only a run that ended (failed, cancelled or "
                "completed) is started again"
            )
        reused = self._first_steps(old_id, from_step)
        hosted = driver.flows.hosts(old.flow)
        execution_id, event = self.new_start(
            old.flow, old.input, key, None, driver.worker_id if hosted else None, unhosted=True
        )
        event = attrs.evolve(event, retry_of=old_id)
        if not hosted:  # no code here: the first worker that has it drives it
            self.append_start(event, execution_id, reused)
            return driver.execution(execution_id)
        with driver.locks.hold(execution_id), driver.heartbeat.holding(execution_id):
            state = self.append_start(event, execution_id, reused)
            if state is None:
                return driver.execution(execution_id)
            execution = driver.drive_owned(state)
        return driver.settled(execution)

    def _first_steps(self, old_id: str, count: int) -> list[StepCompleted | StepFailed]:
        """The outcomes of an ended run's first `count` steps, to be reused as they are.

        Raises:
            InvalidArgumentError: they are not all before the run's first gate, timer,
                message or end (a reused step would stand where the new run may go
                otherwise), one of them is the kernel's own (a published value, a
                child's start: its effect would not happen again), or the journal was
                compacted below them.
        """
        if count == 0:
            return []
        stream = stream_of(old_id)
        try:
            records = self._driver.store.read(stream)
        except TrimmedError:
            raise InvalidArgumentError(
                f"{old_id}'s journal was compacted: its steps can only be run again (from_step=0)"
            ) from None
        steps: list[StepCompleted | StepFailed] = []
        for event in decode_events(records, stream)[1:]:
            if isinstance(event, StepCompleted | StepFailed) and event.index == len(steps):
                if event.name.startswith(KERNEL_STEP_PREFIX):
                    break
                steps.append(event)
                if len(steps) == count:
                    return steps
            elif not isinstance(event, ExecutionClaimed | ExecutionMigrated):
                break
        raise InvalidArgumentError(
            f"from_step is at most {len(steps)} for {old_id}: its first {count} steps are not "
            "all its own steps before its first gate, timer, message or end"
        )

    def new_start(
        self,
        flow_name: str | Flow,
        input: Any,
        key: str | None,
        parent: str | None,
        by: str | None,
        *,
        unhosted: bool = False,
    ) -> tuple[str, ExecutionStarted]:
        """The id and the EXECUTION_STARTED of a new run (nothing journaled yet).

        With `unhosted`, a flow name this engine hosts no code of starts a run pinned to
        no code yet (code hash ""): a process that only starts runs (a web tier) needs no
        flow code, and the first worker that drives the run pins it to its newest
        version of the flow (see `Driver.drive`).

        Raises:
            UnknownFlowError: no such flow is registered (and `unhosted` is false, or
                the flow was given as a Flow this engine lacks).
            InvalidArgumentError: the name is not a valid flow name, or the input is
                not JSON.
        """
        flows = self._driver.flows
        if unhosted and isinstance(flow_name, str) and not flows.hosts(flow_name):
            name, code = check_flow_name(flow_name), ""
        else:
            definition = flows.newest(flow_name)
            name, code = definition.name, definition.code_hash
        data = to_json(input, "the flow input")
        execution_id = new_execution_id(key) if key is not None else fresh_execution_id()
        tracing = self._driver.host.tracing
        trace = None if tracing is None else tracing.current()
        return execution_id, ExecutionStarted(name, code, data, key, parent, by, trace=trace)

    def append_start(
        self, event: ExecutionStarted, execution_id: str, then: Sequence[Event] = ()
    ) -> ExecutionState | None:
        """Index the run (the hint first), then journal its start (and `then`, in the
        same append). None when a run with that id exists already; else the new run's
        state, folded.

        A start with the id of a run that retention deleted is the id's next run
        (generation): it first completes the deletion (the deleted run's inbox and
        published values go), then appends its start after the deletion's record, so
        it never sees what the deleted run recorded.

        Raises:
            ExecutionNotFoundError: the journal's name was retired (a store's own
                `delete`, not retention): no run can be started with the id.
        """
        driver = self._driver
        stream = stream_of(execution_id)
        queue = None if event.queue is None else event.queue.name
        state = ExecutionState(id=execution_id)
        try:
            if event.key is not None and driver.store.head(stream) > 0:
                state = load(driver.store, execution_id, None, deleted=True)
                if not state.deleted:
                    return None  # a start by key of a run that exists: no second hint
                finish_deletion(driver.store, state, driver.clock)
            hinted = time.monotonic()
            # Unsynced: the start, synced just after it, makes it durable too.
            driver.runs.opened(execution_id, event.flow, driver.worker_id, queue, sync=False)
            now = driver.clock()
            records = [encode_event(item, now) for item in (event, *then)]
            driver.store.append(stream, state.position, records)
        except ConflictError:
            return None
        except StreamDeletedError:
            raise ExecutionNotFoundError(
                f"execution {execution_id!r} was deleted; its key cannot start another run"
            ) from None
        for item in (event, *then):
            state.apply(item)
        if time.monotonic() - hinted > driver.lease / 2:
            # Paused between the hint and the start (a frozen VM, say): another worker
            # may have judged the hint abandoned and dropped it. Write it again.
            driver.runs.opened(execution_id, event.flow, driver.worker_id, queue)
        logger.info("loom: %s started (%s)", execution_id, event.flow)
        return state


def fresh_execution_id() -> str:
    """The id of a run started without a key: a version 7 UUID's 32 hex digits (RFC
    9562: the Unix time in milliseconds, then 74 random bits).

    Ids made later sort after earlier ones (within a millisecond, at random), so the
    journals of new runs land side by side in a store that keeps streams in name
    order (SQLite's clustered records b-tree) instead of at random places all over
    it. Nothing relies on that order: a clock that jumps back only costs locality (a
    clock before 1970 counts as 1970).
    """
    millis = max(time.time_ns() // 1_000_000, 0) & _MILLIS
    value = millis << 80 | int.from_bytes(os.urandom(10))
    return f"{value & _UUID7_CLEAR | _UUID7_SET:032x}"


#: The 48 bits of milliseconds a version 7 UUID holds.
_MILLIS: Final = (1 << 48) - 1
#: Where the version (7) and the variant (0b10) go, cleared, then set.
_UUID7_CLEAR: Final = ~((0xF << 76) | (0x3 << 62)) & ((1 << 128) - 1)
_UUID7_SET: Final = (0x7 << 76) | (0x2 << 62)
