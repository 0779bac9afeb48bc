"""The decisions of a replay: what each ctx call is, given the journal folded so far.

`Replay` holds where a pass of a flow's code stands in its run (the next step index
and gate index) and decides, without any I/O, what a call is: a recorded step or gate
to replay, a new one to make, or a divergence or misuse that stops the drive. The
contexts (`_context`, `_async_context`) are thin faces over it: they run the step
functions and make the journal's reads and writes (`_writer`) where a decision says so.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar, Final, TypeVar

from loom_kernel._core import (
    CONVERTER,
    ExecutionState,
    InvalidArgumentError,
    LoomError,
    NonDeterminismError,
    SchemaError,
    StepFailedError,
    StepFrame,
    finite_number,
    has_utf8,
)
from loom_kernel._replay._flows import RetryPolicy
from loom_kernel._replay._host import DriveControl, Unwind
from loom_kernel._replay._waits import TIMER_GATE, Woken, timer_resume_key, validate_topic

__all__ = ["MAX_SLEEP", "NEW", "PATCH_PREFIX", "Replay"]

T = TypeVar("T")

_RESERVED_PREFIX: Final = "loom."
#: The name of the recorded marker of `ctx.patched(change)`.
PATCH_PREFIX: Final = "loom.patched:"
#: The longest sleep, in seconds: 100 years (longer is a mistake, not a plan).
MAX_SLEEP: Final = 100 * 365.25 * 86_400
#: What a claim of a gate, or of a patch marker, returns for a call with no record.
NEW: Final = object()


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


class Replay:
    """Where a pass of a flow's code stands in its run, and the decisions of its calls."""

    def __init__(self, state: ExecutionState, control: DriveControl) -> None:
        self._state = state
        self._control = control
        self._step_index = 0
        self._gate_index = 0
        self._inside_step: str | None = None  # sync flows: the step whose function runs
        self._halted: Unwind | None = None
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
    def generation(self) -> int:
        """Which run of its id this is: 1, or more once retention deleted earlier runs
        of the id (ids derived from the run's own, a child's say, include it from 2 on,
        so they never name what an earlier run of the id started)."""
        return self._state.generation

    @property
    def input(self) -> Any:
        """The execution's input."""
        return self._state.input

    @property
    def position(self) -> int:
        """The index the next step will take: a deterministic position in the run.

        The same code path reaches the same position on every re-run, so ids derived
        from it (a child's id, say) are the same after a crash.
        """
        return self._step_index

    # -- misuse -----------------------------------------------------------------

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

    def _before_new_gate(self) -> None:
        """Checks an async context makes before a new gate is journaled."""

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

    # -- steps ------------------------------------------------------------------

    def _claim_step(self, name: object) -> tuple[int, StepFrame | None]:
        """Take the next step index for a step named `name`: (index, its recorded
        frame, or None for a new step). Raises the stop of a divergence or misuse."""
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

    @staticmethod
    def _replayed(frame: StepFrame, returns: type[T] | None) -> Any:
        """A recorded step's value (or its recorded failure, raised)."""
        if frame.error is not None:
            raise StepFailedError(frame.name, frame.error.type, frame.error.message, frame.attempts)
        return frame.result if returns is None else CONVERTER.structure(frame.result, returns)

    @staticmethod
    def _next_attempt(policy: RetryPolicy, exc: Exception, attempt: int) -> float | None:
        """After failed attempt number `attempt`: the wait before the next, or None when
        the policy gives up (the failure is then journaled)."""
        if isinstance(exc, policy.retry_on) and attempt < policy.attempts:
            return policy.delay(attempt)
        return None

    # -- gates ------------------------------------------------------------------

    def _claim_gate(self, on: str) -> tuple[int, Any]:
        """Take the next gate index for a gate named `on`: (index, the recorded resume
        payload that passes it, or NEW for a gate with no record). Raises the stop of
        a divergence, a misuse, or a park at a recorded gate not resumed yet."""
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
        return gate, NEW

    def _gate_name(self, on: object) -> str:
        if not isinstance(on, str) or not on or on.startswith(_RESERVED_PREFIX) or not has_utf8(on):
            raise self._halt(
                InvalidArgumentError(
                    f"a gate name is a non-empty str (UTF-8, so no lone surrogate) not "
                    f"starting with 'loom.', not {on!r}"
                )
            )
        return on

    def _deadline(self, timeout: object) -> float | None:
        if timeout is None:
            return None
        try:
            return _seconds(timeout, "a timeout")
        except InvalidArgumentError as exc:
            raise self._halt(exc) from None

    def _sleep_seconds(self, duration: object) -> float:
        try:
            return _seconds(duration)
        except InvalidArgumentError as exc:
            raise self._halt(exc) from None

    def _topic(self, topic: object) -> str | None:
        try:
            return validate_topic(topic)
        except InvalidArgumentError as exc:
            raise self._halt(exc) from None

    def _first_of(
        self, gates: object, topics: object, timeout: object
    ) -> tuple[tuple[str, ...], tuple[str | None, ...], float | None]:
        """The gates, topics and deadline of a `wait_first`, checked."""
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
        return names, wanted, deadline

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

    # -- patches ----------------------------------------------------------------

    def _claim_patch(self, change: object) -> Any:
        """`ctx.patched(change)`: True or False for a run whose history decides it, or
        NEW when the marker is to be recorded (the run reaches it with the new code)."""
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
        frame = self._state.steps.get(self._step_index)
        if frame is not None and frame.name == PATCH_PREFIX + change:
            self._step_index += 1
            return True
        if self._history_ahead():
            return False  # history from before the change: it has no marker here
        return NEW

    # -- what the journal holds beyond this pass ----------------------------------

    def _unconsumed(self, what: str, index: int, found: str, next_up: str) -> NonDeterminismError:
        """A call with no record while the journal still records more: the code gained
        a call before something the run already did."""
        return NonDeterminismError(
            self._state.id, what, index, f"(nothing here: the journal has {next_up} next)", found
        )

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
