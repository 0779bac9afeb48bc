"""What executions look like from outside: views of their folded journals."""

from __future__ import annotations

from typing import Any

import attrs

from loom_kernel._core import ErrorInfo, Event, ExecutionState, InvalidArgumentError, Status
from loom_kernel._replay import wait_of

__all__ = ["Execution", "HistoryEntry", "InboxMessage"]


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
        waiting_on: the recorded name of the gate a suspended run is parked at
            ("loom.timer" for a sleep; see `gates` and `topics` for what wakes it).
        wake_at: for a sleeping run, when its timer is due; for a gate with a
            timeout, its deadline.
        key: the idempotency key, if any.
        parent: the execution that started it, if any.
        retry_of: the run this one starts again (`Engine.fork`), if any.
        generation: which run of its id it is: 1, or more once retention deleted
            earlier runs of the id (see docs/retention.md).
        code_hash: the pinned hash of the flow's code.
        position: how many journal records it has.
        cancel_reason: why it was cancelled, once cancelled.
        owner: while it runs, the worker driving it (see docs/running.md).
        owner_seen_at: when that worker was last seen alive (its last lease renewal
            or the run's last record, by its clock); filled in by `Engine.get`.
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
    cancel_reason: str | None = None
    owner: str | None = None
    owner_seen_at: float | None = None
    retry_of: str | None = None
    generation: int = 1

    @property
    def gates(self) -> tuple[str, ...]:
        """The gate names `Engine.resume(..., on=...)` may deliver to now: the parked
        gate's, or those of its `ctx.wait_first`; empty when it is not parked at one."""
        return () if (wait := self._wait()) is None else wait.gates

    @property
    def topics(self) -> tuple[str | None, ...]:
        """The topics a message sent now (`Engine.send`) wakes it on; empty when none."""
        return () if (wait := self._wait()) is None else wait.topics

    def _wait(self) -> Any:
        if self.waiting_on is None:
            return None
        try:
            return wait_of(self.waiting_on)
        except InvalidArgumentError:
            return None

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
            cancel_reason=state.cancel_reason,
            owner=state.owner if state.status is Status.RUNNING else None,
            retry_of=state.retry_of,
            generation=state.generation,
        )


@attrs.frozen
class HistoryEntry:
    """One decoded journal record."""

    position: int
    timestamp: float
    event: Event


@attrs.frozen
class RunSummary:
    """A run as `Engine.runs` lists it: what a listing shows, read from the run index
    for an ended run (no journal read) and from its journal for an open one.

    Attributes:
        id: the execution id.
        flow: the flow's name.
        status: running, suspended, completed, failed or cancelled.
        started_at: when it started (for an ended run, when its start was filed in the
            run index, just before its first record); None when not known.
        ended_at: when it ended (for an ended run, when the index filed its end, once
            its listeners had run); None while it is open.
        waiting_on: the gate a suspended run is parked at, if any.
        parent: the execution that started it, if any.
        generation: which run of its id it is (see `Execution.generation`).
    """

    id: str
    flow: str
    status: Status
    started_at: float | None
    ended_at: float | None
    waiting_on: str | None = None
    parent: str | None = None
    generation: int = 1


@attrs.frozen
class SentKey:
    """A dedupe key a message to a run was sent with, as `Engine.inbox_keys` shows it.

    Attributes:
        position: the inbox position of the message first sent with it.
        received: whether the run has read that message.
    """

    position: int
    received: bool


@attrs.frozen
class InboxMessage:
    """A message in a run's inbox, as `Engine.inbox` shows it.

    Attributes:
        position: its place in the inbox (1, 2, ...): the send order.
        topic: its topic (None: the default topic).
        key: its dedupe key, if it was sent with one.
        message: the message (JSON).
        sent_at: when it was sent, by the sender's clock.
        received: whether the run has read it (a `ctx.receive` or a `wait_first`).
    """

    position: int
    topic: str | None
    key: str | None
    message: Any
    sent_at: float
    received: bool
