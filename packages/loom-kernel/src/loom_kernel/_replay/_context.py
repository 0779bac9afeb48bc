"""The replay context a flow receives: it answers from the journal and journals what is new."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import random as _random
import threading
import time
import uuid as _uuid
from collections.abc import Awaitable, Callable, Coroutine, Generator
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Final, TypeVar

import attrs

from loom_kernel._coordination._executions import stream_of
from loom_kernel._coordination._inbox import Inbox, Message
from loom_kernel._coordination._published import Published, event_key_refusal
from loom_kernel._coordination._timers import TIMER_GATE, TimerIndex, timer_resume_key
from loom_kernel._core._codec import (
    CONVERTER,
    PLAIN_TYPES,
    encode_event,
    encode_step_completed,
    load_json,
    to_json,
    to_json_text,
)
from loom_kernel._core._errors import (
    ConflictError,
    GateTimeoutError,
    InvalidArgumentError,
    LoomError,
    NonDeterminismError,
    SchemaError,
    StepFailedError,
)
from loom_kernel._core._events import (
    Event,
    ExecutionResumed,
    ExecutionSuspended,
    StepFailed,
    error_info,
)
from loom_kernel._core._ids import has_utf8, is_name
from loom_kernel._core._numbers import finite_number
from loom_kernel._core._state import ExecutionState, StepFrame
from loom_kernel._replay._flows import RetryPolicy
from loom_kernel._replay._servant import FLOW_LOOP, unwrap
from loom_kernel._replay._waits import (
    Woken,
    consumed_positions,
    first_gate,
    message_key,
    message_payload,
    receive_gate,
    validate_topic,
)
from loom_kernel._spi._journal import APPENDS, JournalStore, NewRecord

if TYPE_CHECKING:
    from loom_kernel._engine._facade import Engine
    from loom_kernel._replay._servant import Servant

__all__ = ["MAX_SLEEP", "AsyncContext", "Context", "DriveControl", "Runtime", "Unwind"]

T = TypeVar("T")

_RESERVED_PREFIX: Final = "loom."
#: The name of the recorded marker of `ctx.patched(change)`.
PATCH_PREFIX: Final = "loom.patched:"
#: The longest sleep, in seconds: 100 years (longer is a mistake, not a plan).
MAX_SLEEP: Final = 100 * 365.25 * 86_400
#: The name prefix of the recorded step of `ctx.set_event(key, ...)`.
EVENT_STEP_PREFIX: Final = "loom.event:"

#: In async flows: the context whose step function is running in this task, and the
#: step's name (a task gathered beside it is not inside it). A sync context keeps the
#: name on itself, which costs less per step.
_RUNNING_STEP: contextvars.ContextVar[tuple[object, str] | None] = contextvars.ContextVar(
    "loom_running_step", default=None
)


@attrs.frozen
class Runtime:
    """What a context needs from the engine that drives it.

    Attributes:
        engine: the engine itself, for `ctx.engine` (starting other flows from a step).
        store: the journal store.
        clock: the injected clock.
        sleep: waits between a sync step's retries.
        async_sleep: waits between an async step's retries, without blocking the loop.
        retry: the default retry policy.
        timers: the due-timer index a sleep writes its hint to.
        inbox: the run inboxes a receive reads.
        published: where `set_event` publishes.
        lease_in_doubt: whether the engine's lease may have run out (no renewal for
            half a lease): a drive then looks at the journal's head before its next
            step, even on a store where that costs a request.
    """

    engine: Engine
    store: JournalStore
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    async_sleep: Callable[[float], Awaitable[None]]
    retry: RetryPolicy
    timers: TimerIndex
    inbox: Inbox
    published: Published
    lease_in_doubt: Callable[[], bool]


#: Set by a worker around the drives it makes: once the event is set (the worker is
#: stopping and its grace is over), every drive made under it stops before its next
#: step, nested drives (a listener resuming a parent) included.
RELEASE: Final[contextvars.ContextVar[threading.Event | None]] = contextvars.ContextVar(
    "loom_release", default=None
)


class DriveControl:
    """What an engine and a drive in progress share.

    Attributes:
        stopped: true once a cancel's record is journaled (or the worker that made
            the drive released it), so the run stops before its next step even on a
            store whose head the context does not look at.
        pending: records already folded into the run's state but not yet journaled
            (a resume): they are journaled with the drive's first new work, so a
            replay that diverges before any journals nothing.
        replay_only: a replay-check: the drive stops, as if parked, at the first new
            work, having written nothing and run no new step.
    """

    __slots__ = ("_release", "_stopped", "pending", "replay_only")

    def __init__(
        self, pending: list[NewRecord] | None = None, *, replay_only: bool = False
    ) -> None:
        self._stopped = False
        self._release = RELEASE.get()
        self.pending: list[NewRecord] = pending or []
        self.replay_only = replay_only

    @property
    def stopped(self) -> bool:
        release = self._release
        return self._stopped or (release is not None and release.is_set())

    @stopped.setter
    def stopped(self, value: bool) -> None:
        self._stopped = value


_MISSING: Final = object()
#: Seconds after one of its appends landed during which a drive does not look at its
#: run's head before a new step, if nothing else in the process appended meanwhile
#: (see `_check_owner`): a flow's code between two steps takes microseconds, and the
#: look costs about a tenth of a step on SQLite.
_FRESH_HEAD: Final = 0.001
_monotonic: Final = time.monotonic


class Unwind(BaseException):
    """Internal: stops a flow's code. A BaseException so `except Exception` cannot swallow it.

    `error` is None when the run parked at a gate; otherwise the kernel error the
    caller gets (another writer moved the journal, non-determinism, a store fault).
    """

    def __init__(self, error: LoomError | None = None) -> None:
        super().__init__(error)
        self.error = error


def _seconds(duration: object, what: str = "a sleep") -> float:
    if isinstance(duration, timedelta):
        seconds = duration.total_seconds()
    elif finite_number(duration):
        seconds = float(duration)  # type: ignore[arg-type]
    else:
        raise InvalidArgumentError(
            f"{what} takes a finite number of seconds or a timedelta, not {duration!r}"
        )
    if seconds > MAX_SLEEP:
        raise InvalidArgumentError(
            f"{what} is at most {MAX_SLEEP:.0f} seconds (100 years), not {duration!r}"
        )
    return float(seconds)


class _Replay:
    """The bookkeeping both contexts share: call counters, frames, appends."""

    def __init__(
        self, runtime: Runtime, state: ExecutionState, control: DriveControl | None = None
    ) -> None:
        self._runtime = runtime
        self._state = state
        self._stream = stream_of(state.id)
        self._step_index = 0
        self._gate_index = 0
        self._control = control or DriveControl()
        self._inside_step: str | None = None  # sync flows: the step whose function runs
        self._halted: Unwind | None = None
        # When this drive's last append landed (monotonic), and the process's append
        # count just after it, or -1 if another append may have come in between.
        self._appended_at = -_FRESH_HEAD
        self._appends_then = -1
        self.replay_again = False

    @property
    def halted(self) -> Unwind | None:
        """How this drive stopped (a park or an error), if a ctx call stopped it.

        Code that swallows the stop (a task nobody awaits, `except BaseException`)
        cannot make the run go on: every later ctx call raises it again, and the
        engine ends the drive on it whatever the flow returns.
        """
        return self._halted

    def _replay_again(self) -> Unwind:
        """Stop this pass so the flow's code runs again from the top on the journal
        (async flows: it was about to see how concurrent steps finished)."""
        if self._halted is None:
            self._halted = Unwind()
            self.replay_again = True
        return self._halted

    def _halt(self, error: LoomError | None = None) -> Unwind:
        """Stop the drive: at a gate (no error) or on an error; the first stop holds,
        except that an error replaces a pass ending to run again (the error wins)."""
        if self._halted is None or (error is not None and self.replay_again):
            self._halted = Unwind(error)
            self.replay_again = False
        return self._halted

    @property
    def execution_id(self) -> str:
        """The id of the execution this context drives."""
        return self._state.id

    @property
    def input(self) -> Any:
        """The execution's input."""
        return self._state.input

    @property
    def engine(self) -> Engine:
        """The engine driving this run (to start other executions from a step)."""
        return self._runtime.engine

    @property
    def position(self) -> int:
        """The index the next step will take: a deterministic position in the run.

        The same code path reaches the same position on every re-run, so ids derived
        from it (a child's id, say) are the same after a crash.
        """
        return self._step_index

    def _append(self, events: list[Event]) -> None:
        now = self._runtime.clock()
        self._write([encode_event(event, now) for event in events])
        for event in events:
            self._state.apply(event)

    def _write(self, records: list[NewRecord]) -> None:
        """Append at the position this run has folded to, after whatever is pending;
        any store error stops the run."""
        pending = self._control.pending
        before = APPENDS.asked
        try:
            self._runtime.store.append(
                self._stream, self._state.position - len(pending), pending + records
            )
        except LoomError as exc:
            raise self._halt(exc) from None
        self._appended_at = _monotonic()
        after = APPENDS.asked
        self._appends_then = after if after == before + 1 else -1
        pending.clear()

    def _running_step(self) -> str | None:
        """The step whose function is running, when a ctx call comes from inside it."""
        return self._inside_step

    def _refuse_inside_step(self, call: str) -> None:
        """A ctx call from inside a step function would be journaled out of order."""
        running = self._running_step()
        if running is not None:
            raise self._halt(
                InvalidArgumentError(
                    f"{call} was called inside the function of step {running!r}: a step "
                    "function must not use ctx (its call would be journaled before the step "
                    "that contains it, and every replay would diverge); call ctx between "
                    "steps, or start another flow from the step"
                )
            )

    #: Whether `_before_claim` checks anything (an async context's does).
    _checks_claims: ClassVar[bool] = False

    def _before_claim(self, call: str) -> None:
        """Checks an async context makes before a call takes an index."""

    def _cut_short(self, name: str, exc: BaseException) -> None:
        """A step function ended by a BaseException (a cancel, an interrupt): stop the
        drive on it, since the journal cannot say whether the step's work happened."""
        self._halt(
            InvalidArgumentError(
                f"step {name!r} was cut short by {type(exc).__name__} before it finished "
                "(asyncio.wait_for, a cancelled task, an exception that is not an "
                "Exception): the journal could not say whether its work happened, so a "
                "replay could not match it; put timeouts inside the step function"
            )
        )

    def _claim_step(self, name: object) -> tuple[int, StepFrame | None]:
        if not isinstance(name, str) or not name or (not str.isascii(name) and not has_utf8(name)):
            raise self._halt(
                InvalidArgumentError(
                    f"a step name is a non-empty str (UTF-8, so no lone surrogate), not {name!r}"
                )
            )
        if self._halted is not None:
            raise self._halted
        # The call's text only when a check needs it: a new step is the hot path.
        if self._checks_claims:
            self._before_claim(f"ctx.step({name!r})")
        # A sync context's `_running_step()`, read inline (an async one checks claims).
        if self._inside_step is not None or (
            self._checks_claims and self._running_step() is not None
        ):
            self._refuse_inside_step(f"ctx.step({name!r})")
        index = self._step_index
        self._step_index += 1
        state = self._state
        frame = state.steps.get(index)
        if frame is not None and frame.name != name:
            raise self._halt(NonDeterminismError(state.id, "step", index, frame.name, name))
        if frame is None and len(state.gates) > self._gate_index:
            gate = state.gates[self._gate_index]
            raise self._halt(
                self._unconsumed("step", index, name, f"gate #{self._gate_index} {gate.on!r}")
            )
        return index, frame

    def _retry_delay(
        self, policy: RetryPolicy, index: int, name: str, exc: Exception, attempt: int
    ) -> float:
        """After a failed attempt: the wait before the next, or raise the journaled failure."""
        if isinstance(exc, policy.retry_on) and attempt < policy.attempts:
            return policy.delay(attempt)
        raise self._journal_failure(index, name, exc, attempt) from exc

    def _check_owner(self) -> None:
        """Before new work: the journal must still end where this run left it.

        A cancel, or another worker driving the same run, moves the head; then this
        run stops before it starts a step, instead of finding out at the next append.
        Skipped on stores whose head is a network round trip (`head_is_cheap`).
        """
        if self._control.replay_only:
            raise self._halt()  # a replay-check ends where recorded history does
        if self._control.pending:
            self._write([])  # the pending resume, at the exact head: the same check
            if self._control.stopped:  # released meanwhile: the resume landed, no step
                position = self._state.position
                raise self._halt(ConflictError(self._stream, position, position))
            return
        stopped = self._control.stopped
        if not stopped and not self._runtime.lease_in_doubt():
            if not self._runtime.store.head_is_cheap:
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
            head = self._runtime.store.head(self._stream)
        except LoomError as exc:
            raise self._halt(exc) from None
        if stopped or head != self._state.position:
            raise self._halt(ConflictError(self._stream, self._state.position, head))

    @staticmethod
    def _replayed(frame: StepFrame, returns: type[T] | None) -> Any:
        if frame.error is not None:
            raise StepFailedError(frame.name, frame.error.type, frame.error.message, frame.attempts)
        return frame.result if returns is None else CONVERTER.structure(frame.result, returns)

    def _journal_success(
        self, index: int, name: str, value: Any, attempts: int, returns: Any
    ) -> Any:
        try:
            text = to_json_text(value, f"the result of step {name!r}")
        except InvalidArgumentError as exc:
            raise self._halt(exc) from None
        data = load_json(text)
        self._write([encode_step_completed(index, name, text, attempts, self._runtime.clock())])
        # Without building the event: the write path of every step (a property test
        # holds it to a fresh fold).
        self._state.record_step(index, name, data, attempts)
        return data if returns is None else CONVERTER.structure(data, returns)

    def _journal_failure(
        self, index: int, name: str, exc: BaseException, attempts: int
    ) -> StepFailedError:
        info = error_info(exc)
        self._append([StepFailed(index, name, info, attempts)])
        return StepFailedError(name, info.type, info.message, attempts)

    def _recorded(self, name: str, produce: Callable[[], Any]) -> Any:
        index, frame = self._claim_step(name)
        if frame is not None:
            return frame.result
        self._check_owner()
        return self._journal_success(index, name, produce(), 1, None)

    def _gate(
        self, on: str, wake_after: float | None, topics: tuple[str | None, ...] = ()
    ) -> tuple[int, Any]:
        """Pass a gate: (its index, payload) when recorded resumes cover it; else park.

        `wake_after` is a sleep's length, or the deadline of any other gate. A gate that
        waits for messages on `topics` passes at once on one already in the inbox, and
        looks again once it has parked: a message sent meanwhile found the run running,
        so its sender left it to this run to read.
        """
        if self._halted is not None:
            raise self._halted
        self._refuse_inside_step("ctx.sleep" if on == TIMER_GATE else f"ctx.suspend({on!r})")
        gate = self._gate_index
        self._gate_index += 1
        state = self._state
        if gate < len(state.gates):
            recorded = state.gates[gate].on
            if recorded != on:
                raise self._halt(NonDeterminismError(state.id, "gate", gate, recorded, on))
            if gate < len(state.resume_payloads):
                return gate, state.resume_payloads[gate]
            raise self._halt()  # parked here already: wait for the resume
        later = [index for index in state.steps if index >= self._step_index]
        if later:
            step = state.steps[min(later)]
            raise self._halt(
                self._unconsumed("gate", gate, on, f"step #{min(later)} {step.name!r}")
            )
        self._before_new_gate()
        self._check_owner()
        if topics and (message := self._next_message(topics)) is not None:
            self._append([ExecutionSuspended(gate, on), self._delivery(message)])
            return gate, state.resume_payloads[gate]
        if wake_after is None:
            self._append([ExecutionSuspended(gate, on)])
        else:
            wake_at = self._runtime.clock() + wake_after
            if wake_after <= 0:
                self._append(
                    [
                        ExecutionSuspended(gate, on, wake_at),
                        ExecutionResumed(
                            None, timer_resume_key(gate), self._runtime.engine.worker_id
                        ),
                    ]
                )
                return gate, None
            try:
                self._runtime.timers.add(state.id, gate, wake_at)  # the hint, then the truth
            except LoomError as exc:  # a store fault stops the run; not the flow's failure
                raise self._halt(exc) from None
            self._append([ExecutionSuspended(gate, on, wake_at)])
        if topics and (message := self._next_message(topics)) is not None:
            self._append([self._delivery(message)])  # a sender that delivered first wins
            return gate, state.resume_payloads[gate]
        raise self._halt()

    def _next_message(self, topics: tuple[str | None, ...]) -> Message | None:
        """The first message in the run's inbox on one of `topics` it has not consumed."""
        state = self._state
        try:
            return self._runtime.inbox.next_for(
                state.id, topics, consumed_positions(state.resume_keys)
            )
        except LoomError as exc:
            raise self._halt(exc) from None

    def _delivery(self, message: Message) -> ExecutionResumed:
        """The resume that hands `message` to the gate the run parks at."""
        return ExecutionResumed(
            message_payload(message.topic, message.position, message.message),
            message_key(message.position),
            self._runtime.engine.worker_id,
        )

    def _timed_out(self, gate: int) -> bool:
        """Whether gate number `gate` (passed) was woken by its deadline."""
        return timer_resume_key(gate) in self._state.resume_keys

    def _woken(self, gate: int, payload: Any) -> Woken:
        """What woke a passed gate of a receive or a `wait_first`."""
        if self._timed_out(gate):
            return Woken("timeout")
        try:
            if "gate" in payload:
                return Woken("gate", str(payload["gate"]), payload["value"])
            return Woken("message", payload["topic"], payload["message"])
        except (TypeError, KeyError) as exc:
            raise self._halt(
                SchemaError(f"gate #{gate} of {self._state.id!r} was resumed with {payload!r}")
            ) from exc

    def _deadline(self, timeout: object) -> float | None:
        if timeout is None:
            return None
        try:
            return _seconds(timeout, "a timeout")
        except InvalidArgumentError as exc:
            raise self._halt(exc) from None

    def _topic(self, topic: object) -> str | None:
        try:
            return validate_topic(topic)
        except InvalidArgumentError as exc:
            raise self._halt(exc) from None

    def _suspend_gate(self, on: object, timeout: object) -> Any:
        name = self._gate_name(on)
        deadline = self._deadline(timeout)
        gate, payload = self._gate(name, deadline)
        if deadline is not None and self._timed_out(gate):
            raise GateTimeoutError(self._state.id, name, deadline)
        return payload

    def _receive_gate(self, topic: object, timeout: object) -> Any:
        name = self._topic(topic)
        gate, payload = self._gate(receive_gate(name), self._deadline(timeout), (name,))
        woken = self._woken(gate, payload)
        return woken.value

    def _first_gate(self, gates: object, topics: object, timeout: object) -> Woken:
        for what, value in (("gates", gates), ("topics", topics)):
            if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
                raise self._halt(InvalidArgumentError(f"{what} is a list or tuple, not {value!r}"))
        assert isinstance(gates, list | tuple)
        assert isinstance(topics, list | tuple)
        names = tuple(self._gate_name(gate) for gate in gates)
        wanted = tuple(self._topic(topic) for topic in topics)
        deadline = self._deadline(timeout)
        if len(set(names)) < len(names) or len(set(wanted)) < len(wanted):
            raise self._halt(InvalidArgumentError("a gate or a topic is named twice"))
        if not names and not wanted and deadline is None:
            raise self._halt(
                InvalidArgumentError("wait_first needs a gate, a topic or a timeout to end")
            )
        gate, payload = self._gate(first_gate(names, wanted), deadline, wanted)
        return self._woken(gate, payload)

    def _publish(self, key: object, value: Any) -> None:
        if not is_name(key):
            raise self._halt(InvalidArgumentError(event_key_refusal(key)))
        try:
            data = to_json(value, f"the value of event {key!r}")
        except InvalidArgumentError as exc:
            raise self._halt(exc) from None

        def publish() -> None:
            try:
                self._runtime.published.set(self._state.id, key, data)
            except LoomError as exc:
                raise self._halt(exc) from None

        self._recorded(EVENT_STEP_PREFIX + key, publish)

    def _unconsumed(self, what: str, index: int, found: str, next_up: str) -> NonDeterminismError:
        """A call with no record while the journal still records more: the code gained
        a call before something the run already did."""
        return NonDeterminismError(
            self._state.id, what, index, f"(nothing here: the journal has {next_up} next)", found
        )

    def _before_new_gate(self) -> None:
        """Checks an async context makes before a new gate is journaled."""

    def unconsumed(self) -> tuple[str, int, str] | None:
        """The first recorded call this drive did not reach: (kind, index, name), or None."""
        state = self._state
        later = [index for index in state.steps if index >= self._step_index]
        if later:
            return "step", min(later), state.steps[min(later)].name
        if self._gate_index < len(state.gates):
            return "gate", self._gate_index, state.gates[self._gate_index].on
        return None

    def _history_ahead(self) -> bool:
        """Whether the journal records a call at or after this point of the code."""
        state = self._state
        return (
            len(state.gates) > self._gate_index
            or self._step_index in state.steps
            or any(index >= self._step_index for index in state.steps)
        )

    def patched(self, change: str) -> bool:
        """Whether this run reaches this point with the code that has `change` (K11).

        True for a run that reaches the call with the new code (journaled, so its
        replays say True too); False while replaying history recorded before the
        change existed (nothing journaled). Branch on it to change a flow in place::

            if ctx.patched("fraud-check"):
                ctx.step("fraud_check", check, order)

        Raises:
            InvalidArgumentError: `change` is not a non-empty str.
        """
        if not isinstance(change, str) or not change or not has_utf8(change):
            raise self._halt(
                InvalidArgumentError(
                    f"a change id is a non-empty str (UTF-8, so no lone surrogate), not {change!r}"
                )
            )
        if self._halted is not None:
            raise self._halted
        self._before_claim(f"ctx.patched({change!r})")
        self._refuse_inside_step(f"ctx.patched({change!r})")
        name = PATCH_PREFIX + change
        frame = self._state.steps.get(self._step_index)
        if frame is not None and frame.name == name:
            self._step_index += 1
            return True
        if self._history_ahead():
            return False  # history from before the change: it has no marker here
        return bool(self._recorded(name, lambda: True))

    def _gate_name(self, on: object) -> str:
        if not isinstance(on, str) or not on or on.startswith(_RESERVED_PREFIX) or not has_utf8(on):
            raise self._halt(
                InvalidArgumentError(
                    f"a gate name is a non-empty str (UTF-8, so no lone surrogate) not "
                    f"starting with 'loom.', not {on!r}"
                )
            )
        return on

    def _sleep_seconds(self, duration: object) -> float:
        try:
            return _seconds(duration)
        except InvalidArgumentError as exc:
            raise self._halt(exc) from None

    def now(self) -> float:
        """The current time (epoch seconds), journaled: a replay sees the same value."""
        value: float = self._recorded("loom.now", self._runtime.clock)
        return value

    def random(self) -> float:
        """A random float in [0, 1), journaled."""
        value: float = self._recorded("loom.random", _random.random)
        return value

    def uuid(self) -> str:
        """A random UUID string, journaled."""
        value: str = self._recorded("loom.uuid", lambda: str(_uuid.uuid4()))
        return value


class Context(_Replay):
    """What a sync flow receives as `ctx`."""

    def step(
        self,
        name: str,
        fn: Callable[..., T],
        *args: Any,
        retry: RetryPolicy | None = None,
        returns: type[T] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run `fn(*args, **kwargs)` once, journal its result, and return it; on replay,
        return the journaled result without running `fn`.

        The result must have a JSON form (attrs classes and dataclasses do); the step
        returns that JSON form, or `returns`-typed data rebuilt from it, the same way on
        the first run and on every replay.

        Raises:
            StepFailedError: `fn` kept failing through the retry policy.
            InvalidArgumentError: the name is not a str, or the result is not JSON.
        """
        # The replay hot path, inline (measured: a call less per replayed step is a
        # fifth of a 10,000-step resume's re-run); anything unusual is claimed below.
        frame = self._state.steps.get(self._step_index)
        if frame is not None and frame.name == name and frame.error is None and returns is None:
            self._step_index += 1
            return frame.result
        # A sync context checks the owner of a new step at once.
        index, frame = self._claim_step(name)
        if frame is not None:
            return self._replayed(frame, returns)
        self._check_owner()
        policy = retry or self._runtime.retry
        for attempt in itertools.count(1):
            self._inside_step = name
            try:
                try:
                    value = fn(*args, **kwargs)
                finally:
                    self._inside_step = None
            except Unwind:
                raise
            except Exception as exc:
                self._runtime.sleep(self._retry_delay(policy, index, name, exc, attempt))
                self._check_owner()  # a cancel or a release meanwhile: no more attempts
                continue
            except BaseException as exc:
                self._cut_short(name, exc)
                raise
            if type(value) not in PLAIN_TYPES and inspect.isawaitable(value):
                if inspect.iscoroutine(value):
                    value.close()
                raise self._halt(
                    InvalidArgumentError(
                        f"step {name!r} returned an awaitable in a sync flow; "
                        "make the flow `async def`"
                    )
                )
            return self._journal_success(index, name, value, attempt, returns)
        raise AssertionError("unreachable")  # pragma: no cover

    def suspend(self, on: str, timeout: float | timedelta | None = None) -> Any:
        """A gate: park the run until `engine.resume` delivers a payload, and return it.

        The i-th suspend of a re-run passes through with the i-th recorded payload.

        Args:
            on: the gate's name (not starting with "loom.").
            timeout: seconds (or a timedelta) after which the gate gives up: it is
                then woken by the timers (a worker, or `fire_due_timers`), not by a
                thread that sleeps.

        Raises:
            GateTimeoutError: the timeout passed first (the flow may catch it).
        """
        return self._suspend_gate(on, timeout)

    def receive(self, topic: str | None = None, timeout: float | timedelta | None = None) -> Any:
        """The next message sent to this run on `topic` (`engine.send`), in send order;
        parks the run until one arrives. A message is received once: a replay reads
        the same ones.

        Args:
            topic: the topic (None: the default topic).
            timeout: seconds (or a timedelta) to wait at most.

        Returns:
            The message, or None when the timeout passed first.
        """
        return self._receive_gate(topic, timeout)

    def wait_first(
        self,
        gates: list[str] | tuple[str, ...] = (),
        topics: list[str | None] | tuple[str | None, ...] = (),
        timeout: float | timedelta | None = None,
    ) -> Woken:
        """Park until the first of: a resume of one of `gates` (`engine.resume(id,
        payload, on=gate)`), a message on one of `topics`, or the timeout; replays
        exactly (what came first is journaled).

        Returns:
            What came first: `Woken(kind="gate" | "message" | "timeout", name, value)`.
        """
        return self._first_gate(gates, topics, timeout)

    def set_event(self, key: str, value: Any) -> None:
        """Publish `value` under `key` for `engine.get_event(id, key)` to read, without
        the run's journal (progress, a status for a web page). Journaled as a step."""
        self._publish(key, value)

    def sleep(self, duration: float | timedelta) -> None:
        """A timer gate: park the run until `engine.fire_due_timers` finds it due."""
        self._gate(TIMER_GATE, self._sleep_seconds(duration))


def _cancel_tasks_of(
    coroutines: list[Coroutine[Any, Any, Any]],
) -> list[Coroutine[Any, Any, Any]]:
    """Cancel the tasks made around coroutines that never started (`ensure_future`,
    `create_task` with no await after): cancelled before their first run, such a task
    closes its coroutine without running it, and ends cancelled, with nothing logged
    (a coroutine closed under it would make it fail: "Task exception was never
    retrieved").

    Returns:
        The coroutines no task holds, which the caller closes.
    """
    left = set(coroutines)
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # no loop runs here: no task can hold them
        tasks = set()
    for task in tasks:
        coroutine = task.get_coro()
        if coroutine in left:
            task.cancel()
            left.discard(coroutine)
    return [coroutine for coroutine in coroutines if coroutine in left]


class _Resumptions:
    """Awaits a coroutine, calling `check` each time the event loop resumes it.

    `check` returns a stop to throw into the coroutine instead of resuming it, or None.
    """

    __slots__ = ("_check", "_coroutine")

    def __init__(
        self, coroutine: Coroutine[Any, Any, Any], check: Callable[[], Unwind | None]
    ) -> None:
        self._coroutine = coroutine
        self._check = check

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine = self._coroutine
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = coroutine.send(value) if error is None else coroutine.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = yield yielded
            except BaseException as exc:  # a cancel or close: handed to the flow's code
                error = exc
            if error is None:
                error = self._check()


class AsyncContext(_Replay):
    """What an `async def` flow receives as `ctx`: the same journal, awaitable calls.

    The rule in async flows: `step`, `suspend` and `sleep` return awaitables, and each
    must be awaited before the flow parks or returns (an un-awaited one would silently
    not happen, so it is refused). `now`, `random` and `uuid` are plain calls, as in a
    sync flow. Every ctx call is made by the flow's own code (its own task); steps may
    run concurrently when that code gathers them (`asyncio.gather(ctx.step(...),
    ctx.step(...))`). The flow's code never sees how new concurrent steps finished:
    when it would (it resumes after one finished elsewhere), the pass ends, the steps
    still running finish and are journaled, and the code runs again from the top on
    the journal, where every step is recorded and they finish in the order they were
    called. So what the code decides never depends on timing. Gates are awaited by
    the flow's own task, one at a time.
    """

    def __init__(
        self, runtime: Runtime, state: ExecutionState, control: DriveControl | None = None
    ) -> None:
        super().__init__(runtime, state, control)
        self._task: asyncio.Task[Any] | None = None
        self._unstarted: dict[object, tuple[str, Coroutine[Any, Any, Any]]] = {}
        self._in_flight: set[int] = set()  # new steps whose functions are running
        self._quiet: asyncio.Future[None] | None = None  # done when none is running
        self._own_step = False  # the flow's own task is running a new step's function
        self._finished_elsewhere = False  # a new step finished in another task
        self._replaying: dict[int, asyncio.Future[None] | None] = {}  # see _in_call_order
        # On a loop of another thread's (see Servant), that thread makes the blocking
        # calls; `_lock` keeps them and the loop's own journaling ctx calls (ctx.now)
        # one at a time, and `_halt_lock` (never held over a call to the store) keeps
        # a stop from one thread from overwriting the other's.
        self._servant: Servant | None = None
        self._lock = threading.RLock()
        self._halt_lock = threading.Lock()
        self._ended = False  # the pass is over: a task it left may not journal

    def served_by(self, servant: Servant) -> None:
        """Have `servant` (the drive's thread) make this run's blocking calls."""
        self._servant = servant

    def _halt(self, error: LoomError | None = None) -> Unwind:
        with self._halt_lock:
            return super()._halt(error)

    def _replay_again(self) -> Unwind:
        with self._halt_lock:
            return super()._replay_again()

    def _recorded(self, name: str, produce: Callable[[], Any]) -> Any:
        with self._lock:  # on the loop, even beside a servant: ctx.now() is no awaitable
            return super()._recorded(name, produce)

    def patched(self, change: str) -> bool:
        """As `Context.patched` (it reads the recorded steps a servant may be adding to)."""
        with self._lock:
            return super().patched(change)

    def _begin_step(self, name: object, returns: type[Any] | None) -> tuple[int, Any]:
        """Replay a recorded step or claim a new one: (index, replayed value or _MISSING).

        The common replay (a recorded, successful, untyped step of the same name) is
        answered inline in `step` before this is called; this is the checked path. The
        owner of a new step is checked when its coroutine starts (`_new_step`), off the
        loop.
        """
        index, frame = self._claim_step(name)
        if frame is not None:
            return index, self._replayed(frame, returns)
        return index, _MISSING

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, a call that reads or writes the journal: on the servant's thread
        when there is one (the loop goes on meanwhile), else here.

        The call cannot be cancelled (see `Servant.call`), as it could not be when it
        held the loop: the code never sees a call fail that the journal records.
        """
        servant = self._servant
        if servant is None:
            return fn(*args)
        # In this task's context: what the call would see here (the running step).
        outcome = await servant.call(self._locked, fn, *args, context=contextvars.copy_context())
        result: T = unwrap(outcome)
        return result

    def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            return fn(*args)

    async def run(self, flow: Coroutine[Any, Any, Any]) -> Any:
        """Run the flow's coroutine as the task its ctx calls must come from; however
        the pass ends, the new steps it started finish and are journaled first."""
        self._task = asyncio.current_task()
        try:
            result = await _Resumptions(flow, self._on_resume)
            self._refuse_unawaited("returned")
            if self._in_flight:
                raise self._replay_again()
            return result
        finally:
            self._task = None
            self._ended = True
            for _what, coroutine in self._unstarted.values():
                coroutine.close()
            stopped = False
            while self._in_flight:  # even when the loop cancels this task as it closes
                self._quiet = asyncio.get_running_loop().create_future()
                try:
                    await asyncio.shield(self._quiet)
                except asyncio.CancelledError:
                    stopped = True
            if stopped:
                raise asyncio.CancelledError

    def _on_resume(self) -> Unwind | None:
        """The loop resumes the flow's code after new steps ran elsewhere: end the pass."""
        if self._own_step or not (self._in_flight or self._finished_elsewhere):
            return None
        return self._replay_again()

    def _running_step(self) -> str | None:
        running = _RUNNING_STEP.get()
        return running[1] if running is not None and running[0] is self else None

    _checks_claims = True

    def _before_claim(self, call: str) -> None:
        task = self._task
        if task is None:
            self._refuse_after_the_pass(call)
            return
        servant = self._servant
        if servant is not None and servant.serving_here():
            return  # a call the flow's own task handed over (set_event's), checked there
        try:
            current = asyncio.current_task()
        except RuntimeError:  # another thread, with no loop
            current = None
        if current is task:
            return
        self._refuse_inside_step(call)
        raise self._halt(
            InvalidArgumentError(
                f"{call} was called in another task than the flow's own (a coroutine run "
                "by asyncio.gather, create_task or wait): which position it takes would "
                "depend on timing, so a replay could not match it; call ctx in the flow "
                "itself (asyncio.gather(ctx.step(...), ctx.step(...)) runs steps "
                "concurrently), and make a branch of several steps one step or a child flow"
            )
        )

    def _track(
        self, what: str, make: Callable[[object], Coroutine[Any, Any, T]]
    ) -> Coroutine[Any, Any, T]:
        token = object()
        coroutine = make(token)
        self._unstarted[token] = (what, coroutine)
        return coroutine

    def _refuse_unawaited(self, before: str) -> None:
        if not self._unstarted:
            return
        what, _ = next(iter(self._unstarted.values()))
        coroutines = [coroutine for _what, coroutine in self._unstarted.values()]
        self._unstarted.clear()
        for coroutine in _cancel_tasks_of(coroutines):
            coroutine.close()  # it will never run: no "never awaited" warning on top
        raise self._halt(
            InvalidArgumentError(
                f"{what} was called but never awaited before the flow {before}: in an async "
                "flow every ctx.step, ctx.suspend and ctx.sleep must be awaited (an "
                "un-awaited call does not happen, and a replay could not tell)"
            )
        )

    def _before_new_gate(self) -> None:
        if self._servant is None:  # else made on the loop, before the gate is handed over
            self._refuse_new_gate_now()

    def _refuse_new_gate_now(self) -> None:
        """A new gate waits for no step: an unawaited one is refused, and one still
        running ends the pass (it is journaled, and the code runs again)."""
        self._refuse_unawaited("parked")
        if self._in_flight:
            raise self._replay_again()

    def _checks_before_handing_a_gate(self, call: str) -> None:
        """With a servant: the checks of the loop's own bookkeeping `_before_new_gate`
        makes, made here, on the loop, before a new gate goes to the drive's thread
        (after the one `_gate` makes before it: a gate inside a step never waits for
        that step to end)."""
        if self._servant is not None and self._gate_index >= len(self._state.gates):
            self._refuse_inside_step(call)
            self._refuse_new_gate_now()

    def _refuse_after_the_pass(self, call: str) -> None:
        """A ctx call from a task the flow left running once its pass was over."""
        if self._ended:
            raise self._halt(
                InvalidArgumentError(
                    f"{call} was called after the flow's pass ended, by a task it left "
                    "running: a run journals only what its own code does while it runs; "
                    "await every task the flow starts"
                )
            )

    def _gate_in_own_task(self, call: str) -> None:
        if self._halted is not None:
            raise self._halted
        if self._task is None:
            self._refuse_after_the_pass(call)
        if self._task is not None and asyncio.current_task() is not self._task:
            raise self._halt(
                InvalidArgumentError(
                    f"{call} was awaited in another task than the flow's own (asyncio.gather, "
                    "asyncio.wait, create_task): gates cannot race each other or a timer, "
                    "because which one wins is not journaled; await gates one at a time in "
                    "the flow itself"
                )
            )

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        retry: RetryPolicy | None = None,
        returns: type[T] | None = None,
        **kwargs: Any,
    ) -> Coroutine[Any, Any, Any]:
        """As `Context.step`, awaitable; `fn` may be sync or async.

        A step takes its position when `ctx.step` is called, in the flow's own code,
        so steps gathered concurrently replay correctly whatever order they finished in.
        """
        what = f"ctx.step({name!r})"
        self._before_claim(what)
        # The replay hot path, as in Context.step.
        index = self._step_index
        frame = self._state.steps.get(index)
        if frame is not None and frame.name == name and frame.error is None and returns is None:
            self._step_index += 1
            return self._track(what, lambda token: self._replayed_step(token, index, frame.result))
        try:
            index, replayed = self._begin_step(name, returns)
        except Exception as exc:  # a recorded failure: raised where the step is awaited
            failure = exc
            return self._track(what, lambda token: self._replayed_step(token, index, None, failure))
        if replayed is not _MISSING:
            return self._track(what, lambda token: self._replayed_step(token, index, replayed))
        call = partial(fn, *args, **kwargs)
        policy = retry or self._runtime.retry
        return self._track(
            what,
            lambda token: self._new_step(token, index, name, call, policy=policy, returns=returns),
        )

    async def _replayed_step(
        self, token: object, index: int, result: Any, failure: Exception | None = None
    ) -> Any:
        self._unstarted.pop(token, None)
        if asyncio.current_task() is not self._task:
            await self._in_call_order(index)
        if failure is not None:
            raise failure
        return result

    async def _in_call_order(self, index: int) -> None:
        """Recorded steps running concurrently finish in the order they were called
        (whatever order asyncio started their tasks in), so code that watches them
        finish (asyncio.as_completed) sees the same order on every replay."""
        waiting = self._replaying
        waiting[index] = None
        try:
            await asyncio.sleep(0)  # siblings scheduled beside this one start too
            if min(waiting) != index:
                turn = waiting[index] = asyncio.get_running_loop().create_future()
                await turn
        finally:
            del waiting[index]
            if waiting:
                following = waiting[min(waiting)]
                if following is not None and not following.done():
                    following.set_result(None)

    def _seen_if_stopped(self, task: asyncio.Task[Any]) -> None:
        """A task of the flow's own making ran a step, and ended: once the drive has
        stopped, what it ended with goes nowhere (the flow may never await it), so it
        is taken as seen, and asyncio logs no "Task exception was never retrieved"."""
        if self._halted is not None and not task.cancelled():
            task.exception()

    async def _new_step(
        self,
        token: object,
        index: int,
        name: str,
        call: Callable[[], Any],
        *,
        policy: RetryPolicy,
        returns: type[Any] | None,
    ) -> Any:
        self._unstarted.pop(token, None)
        task = asyncio.current_task()
        if task is not None and task is not self._task:
            task.add_done_callback(self._seen_if_stopped)
        if self._halted is not None:
            raise self._halted  # the drive stopped before this step began
        if self._control.replay_only:
            raise self._halt()  # a replay-check ends at the first new work, at once
        own = asyncio.current_task() is self._task
        self._in_flight.add(index)
        self._own_step = self._own_step or own
        try:
            await self._blocking(self._check_owner)
            value = await self._attempts(index, name, call, policy, returns)
        finally:
            self._in_flight.discard(index)
            if own:
                self._own_step = False
            else:
                self._finished_elsewhere = True
            if not self._in_flight and self._quiet is not None and not self._quiet.done():
                self._quiet.set_result(None)
        if own and (self._in_flight or self._finished_elsewhere):
            raise self._replay_again()
        return value

    async def _attempts(
        self,
        index: int,
        name: str,
        call: Callable[[], Any],
        policy: RetryPolicy,
        returns: type[T] | None,
    ) -> Any:
        servant = None if inspect.iscoroutinefunction(call) else self._servant
        for attempt in itertools.count(1):
            running = _RUNNING_STEP.set((self, name))
            try:
                try:
                    if servant is None:
                        value = call()
                    else:  # a sync function: on the drive's thread, never holding the loop
                        copied = contextvars.copy_context()
                        # A flow it drives inline gets a loop of its own, as it would
                        # have under this loop, so this loop closing does not stop it.
                        copied.run(FLOW_LOOP.set, None)
                        value = unwrap(await servant.call(call, context=copied))
                    if inspect.isawaitable(value):
                        value = await value
                finally:
                    _RUNNING_STEP.reset(running)
            except Unwind:
                raise
            except Exception as exc:
                await self._runtime.async_sleep(
                    await self._blocking(self._retry_delay, policy, index, name, exc, attempt)
                )
                await self._blocking(self._check_owner)  # a cancel or a release meanwhile
                continue
            except BaseException as exc:
                self._cut_short(name, exc)
                raise
            return await self._blocking(self._journal_success, index, name, value, attempt, returns)
        raise AssertionError("unreachable")  # pragma: no cover

    def suspend(
        self, on: str, timeout: float | timedelta | None = None
    ) -> Coroutine[Any, Any, Any]:
        """As `Context.suspend`, awaitable; awaited by the flow's own task."""
        call = f"ctx.suspend({on!r})"
        return self._track(
            call, lambda token: self._own(token, call, self._suspend_gate, on, timeout)
        )

    def receive(
        self, topic: str | None = None, timeout: float | timedelta | None = None
    ) -> Coroutine[Any, Any, Any]:
        """As `Context.receive`, awaitable; awaited by the flow's own task."""
        call = f"ctx.receive({topic!r})"
        return self._track(
            call, lambda token: self._own(token, call, self._receive_gate, topic, timeout)
        )

    def wait_first(
        self,
        gates: list[str] | tuple[str, ...] = (),
        topics: list[str | None] | tuple[str | None, ...] = (),
        timeout: float | timedelta | None = None,
    ) -> Coroutine[Any, Any, Woken]:
        """As `Context.wait_first`, awaitable; awaited by the flow's own task."""
        call = "ctx.wait_first(...)"
        return self._track(
            call, lambda token: self._own(token, call, self._first_gate, gates, topics, timeout)
        )

    def set_event(self, key: str, value: Any) -> Coroutine[Any, Any, None]:
        """As `Context.set_event`, awaitable; awaited by the flow's own task."""
        call = f"ctx.set_event({key!r})"
        return self._track(
            call, lambda token: self._own(token, call, self._publish, key, value, gate=False)
        )

    async def _own(
        self, token: object, call: str, fn: Callable[..., T], *args: Any, gate: bool = True
    ) -> T:
        """Make a gate's call (or `set_event`'s, with `gate` false) in the flow's own
        task (as a suspend is)."""
        self._unstarted.pop(token, None)
        self._gate_in_own_task(call)
        if gate:
            self._checks_before_handing_a_gate(call)
        return await self._blocking(fn, *args)

    def sleep(self, duration: float | timedelta) -> Coroutine[Any, Any, None]:
        """As `Context.sleep`, awaitable; awaited by the flow's own task."""
        return self._track(f"ctx.sleep({duration!r})", lambda token: self._sleep(token, duration))

    async def _sleep(self, token: object, duration: float | timedelta) -> None:
        self._unstarted.pop(token, None)
        self._gate_in_own_task("ctx.sleep")
        seconds = self._sleep_seconds(duration)
        self._checks_before_handing_a_gate("ctx.sleep")
        await self._blocking(self._gate, TIMER_GATE, seconds)
