"""The journal writes of a drive: the one place a context reads or writes the store.

A context decides what a call is (`_decisions`); when the call is new, the writer
records it: it looks at the journal's head before new work (a cancel or another
writer stops the run first), appends at the exact position the run has folded to
(after a pending resume), and folds what it appended into the run's state. Any store
error stops the drive, with the journal as it was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Final

from loom_kernel._core import (
    CONVERTER,
    ConflictError,
    Event,
    ExecutionResumed,
    ExecutionState,
    ExecutionSuspended,
    InvalidArgumentError,
    LoomError,
    NewRecord,
    StepFailed,
    StepFailedError,
    encode_event,
    encode_step_completed,
    error_info,
    load_json,
    stream_of,
    to_json_text,
)
from loom_kernel._replay._host import DriveControl, Host, Unwind
from loom_kernel._replay._waits import (
    Message,
    consumed_positions,
    message_key,
    message_payload,
    timer_resume_key,
)
from loom_kernel._spi import APPENDS

__all__ = ["RunWriter"]

logger = logging.getLogger("loom")

#: Seconds after one of its appends landed during which a drive does not look at its
#: run's head before a new step, if nothing else in the process appended meanwhile
#: (see `check_owner`): a flow's code between two steps takes microseconds, and the
#: look costs about a tenth of a step on SQLite.
_FRESH_HEAD: Final = 0.001
_monotonic: Final = time.monotonic


class RunWriter:
    """Records a drive's new calls in its run's journal."""

    def __init__(
        self,
        host: Host,
        state: ExecutionState,
        control: DriveControl,
        halt: Callable[[LoomError | None], Unwind],
    ) -> None:
        self._host = host
        self._state = state
        self._control = control
        self._halt = halt
        self._stream = stream_of(state.id)
        # When this drive's last append landed (monotonic), and the process's append
        # count just after it, or -1 if another append may have come in between.
        self._appended_at = -_FRESH_HEAD
        self._appends_then = -1

    def append(self, events: list[Event]) -> None:
        """Journal `events` and fold them into the run's state."""
        now = self._host.clock()
        self.write([encode_event(event, now) for event in events])
        for event in events:
            self._state.apply(event)

    def write(self, records: list[NewRecord]) -> None:
        """Append at the position this run has folded to, after whatever is pending;
        any store error stops the run."""
        pending = self._control.pending
        before = APPENDS.asked
        try:
            self._host.store.append(
                self._stream, self._state.position - len(pending), pending + records
            )
        except LoomError as exc:
            raise self._halt(exc) from None
        self._appended_at = _monotonic()
        after = APPENDS.asked
        self._appends_then = after if after == before + 1 else -1
        pending.clear()

    def check_owner(self) -> None:
        """Before new work: the journal must still end where this run left it.

        A cancel, or another worker driving the same run, moves the head; then this
        run stops before it starts a step, instead of finding out at the next append.
        Skipped on stores whose head is a network round trip (`head_is_cheap`).
        """
        control = self._control
        if control.replay_only:
            raise self._halt(None)  # a replay-check ends where recorded history does
        if control.pending:
            self.write([])  # the pending resume, at the exact head: the same check
            if control.stopped:  # released meanwhile: the resume landed, no step
                position = self._state.position
                raise self._halt(ConflictError(self._stream, position, position))
            return
        host = self._host
        stopped = control.stopped
        if not stopped and not host.lease_in_doubt():
            if not host.store.head_is_cheap:
                return  # renewed within half a lease: nobody can have taken the run
            if (
                APPENDS.asked == self._appends_then
                and _monotonic() - self._appended_at < _FRESH_HEAD
            ):
                # This drive's own append landed at the head an instant ago and nothing
                # in this process has appended since (a cancel by the flow's own code
                # would have): another process's move since is found by the step's
                # append, as a move an instant later would be.
                return
        try:
            head = host.store.head(self._stream)
        except LoomError as exc:
            raise self._halt(exc) from None
        if stopped or head != self._state.position:
            raise self._halt(ConflictError(self._stream, self._state.position, head))

    def record_step(self, index: int, name: str, value: Any, attempts: int, returns: Any) -> Any:
        """Journal a step's result; the value the step returns (its JSON form, or
        `returns`-typed data rebuilt from it, as every replay returns it).

        A result that cannot be journaled (it has no JSON form, or it is over the
        store's largest record) fails the step, journaled, at once: no retry and no
        later drive could journal it, and each would run the step's effect again.
        """
        try:
            text = to_json_text(value, f"the result of step {name!r}", str_keys=False)
        except InvalidArgumentError as exc:
            raise self.record_failure(index, name, exc, attempts) from exc
        record = encode_step_completed(index, name, text, attempts, self._host.clock())
        limit = self._host.store.largest_payload
        if limit is not None and len(record.payload) > limit:
            too_big = InvalidArgumentError(
                f"the result of step {name!r} is {len(record.payload):,} bytes journaled, "
                f"over the store's limit of {limit:,} bytes a record (keep large payloads "
                "out of the journal: store them elsewhere and return a reference)"
            )
            raise self.record_failure(index, name, too_big, attempts) from None
        data = load_json(text)
        self.write([record])
        # Without building the event: the write path of every step (a property test
        # holds it to a fresh fold).
        self._state.record_step(index, name, data, attempts)
        return data if returns is None else CONVERTER.structure(data, returns)

    def record_failure(
        self, index: int, name: str, exc: BaseException, attempts: int
    ) -> StepFailedError:
        """Journal a step's failure; the error the step raises (as every replay does)."""
        info = error_info(exc)
        self.append([StepFailed(index, name, info, attempts)])
        logger.info(
            "loom: %s: step %r failed after %d attempt(s): %s: %s",
            self._state.id,
            name,
            attempts,
            info.type,
            info.message,
        )
        return StepFailedError(name, info.type, info.message, attempts)

    def open_gate(
        self, gate: int, on: str, wake_after: float | None, topics: tuple[str | None, ...]
    ) -> Any:
        """Journal a new gate; the payload it passes with at once (a message already in
        the inbox, a timer already due), else the stop of the park.

        `wake_after` is a sleep's length, or the deadline of any other gate. A gate that
        waits for messages on `topics` passes at once on one already in the inbox, and
        looks again once it has parked: a message sent meanwhile found the run running,
        so its sender left it to this run to read.
        """
        state = self._state
        self.check_owner()
        if topics and (message := self._next_message(topics)) is not None:
            self.append([ExecutionSuspended(gate, on), self._delivery(message)])
            return state.resume_payloads[gate]
        if wake_after is None:
            self.append([ExecutionSuspended(gate, on)])
        else:
            wake_at = self._host.clock() + wake_after
            if wake_after <= 0:
                woken = ExecutionResumed(None, timer_resume_key(gate), self._host.worker_id())
                self.append([ExecutionSuspended(gate, on, wake_at), woken])
                return None
            try:
                self._host.add_timer(state.id, gate, wake_at)  # the hint, then the truth
            except LoomError as exc:  # a store fault stops the run; not the flow's failure
                raise self._halt(exc) from None
            self.append([ExecutionSuspended(gate, on, wake_at)])
        if topics and (message := self._next_message(topics)) is not None:
            self.append([self._delivery(message)])  # a sender that delivered first wins
            return state.resume_payloads[gate]
        raise self._halt(None)

    def publish(self, key: str, value: Any) -> None:
        """Publish a value of `ctx.set_event` (before the step that records the call)."""
        try:
            self._host.publish(self._state, key, value)
        except LoomError as exc:
            raise self._halt(exc) from None

    def _next_message(self, topics: tuple[str | None, ...]) -> Message | None:
        """The first message in the run's inbox on one of `topics` it has not consumed."""
        state = self._state
        try:
            return self._host.next_message(state, topics, consumed_positions(state.resume_keys))
        except LoomError as exc:
            raise self._halt(exc) from None

    def _delivery(self, message: Message) -> ExecutionResumed:
        """The resume that hands `message` to the gate the run parks at."""
        return ExecutionResumed(
            message_payload(message.topic, message.position, message.message),
            message_key(message.position),
            self._host.worker_id(),
        )
