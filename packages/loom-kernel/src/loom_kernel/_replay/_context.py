"""The replay context a sync flow receives, and what it shares with the async one.

`BaseContext` composes each ctx operation once, from its decision (`Replay`) and its
journal write (`RunWriter`): a recorded value, a gate, a published value, a patch
marker. `Context` is the sync face: it runs a step's function and waits between its
attempts on this thread. `AsyncContext` (`_async_context`) is the awaitable face over
the same operations.
"""

from __future__ import annotations

import inspect
import itertools
import random as _random
import uuid as _uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final, TypeVar

from loom_kernel._core import (
    PLAIN_TYPES,
    ExecutionState,
    GateTimeoutError,
    InvalidArgumentError,
    event_key_refusal,
    is_name,
    to_json,
)
from loom_kernel._replay._decisions import NEW, PATCH_PREFIX, Replay
from loom_kernel._replay._flows import RetryPolicy
from loom_kernel._replay._host import DriveControl, Host, Unwind
from loom_kernel._replay._waits import TIMER_GATE, Woken, first_gate, receive_gate
from loom_kernel._replay._writer import RunWriter

__all__ = ["EVENT_STEP_PREFIX", "BaseContext", "Context"]

T = TypeVar("T")

#: The name prefix of the recorded step of `ctx.set_event(key, ...)`.
EVENT_STEP_PREFIX: Final = "loom.event:"


class BaseContext(Replay):
    """What both contexts share: each operation composed of its decision and its write."""

    def __init__(
        self, host: Host, state: ExecutionState, control: DriveControl | None = None
    ) -> None:
        control = control or DriveControl()
        super().__init__(state, control)
        self._host = host
        self._writer = RunWriter(host, state, control, self._halt)

    @property
    def engine(self) -> Any:
        """The engine driving this run (to start other executions from a step)."""
        return self._host.engine

    def _recorded(self, name: str, produce: Callable[[], Any]) -> Any:
        """A value recorded as a step of its own (`ctx.now()`, a published value)."""
        index, frame = self._claim_step(name)
        if frame is not None:
            return frame.result
        self._writer.check_owner()
        return self._writer.record_step(index, name, produce(), 1, None)

    def _retry_delay(
        self, policy: RetryPolicy, index: int, name: str, exc: Exception, attempt: int
    ) -> float:
        """After a failed attempt: the wait before the next, or raise the journaled failure."""
        delay = self._next_attempt(policy, exc, attempt)
        if delay is None:
            raise self._writer.record_failure(index, name, exc, attempt) from exc
        return delay

    def _gate(
        self, on: str, wake_after: float | None, topics: tuple[str | None, ...] = ()
    ) -> tuple[int, Any]:
        """Pass a gate: (its index, payload) when the journal or the inbox covers it;
        else park (see `RunWriter.open_gate`)."""
        gate, payload = self._claim_gate(on)
        if payload is not NEW:
            return gate, payload
        self._before_new_gate()
        return gate, self._writer.open_gate(gate, on, wake_after, topics)

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
        return self._woken(gate, payload).value

    def _first_gate(self, gates: object, topics: object, timeout: object) -> Woken:
        names, wanted, deadline = self._first_of(gates, topics, timeout)
        gate, payload = self._gate(first_gate(names, wanted), deadline, wanted)
        return self._woken(gate, payload)

    def _sleep_gate(self, seconds: float) -> None:
        self._gate(TIMER_GATE, seconds)

    def _publish(self, key: object, value: Any) -> None:
        if not is_name(key):
            raise self._halt(InvalidArgumentError(event_key_refusal(key)))
        try:
            data = to_json(value, f"the value of event {key!r}")
        except InvalidArgumentError as exc:
            raise self._halt(exc) from None
        self._recorded(EVENT_STEP_PREFIX + key, lambda: self._writer.publish(key, data))

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
        claimed = self._claim_patch(change)
        if claimed is not NEW:
            return bool(claimed)
        return bool(self._recorded(PATCH_PREFIX + change, lambda: True))

    def now(self) -> float:
        """The current time (epoch seconds), journaled: a replay sees the same value."""
        value: float = self._recorded("loom.now", self._host.clock)
        return value

    def random(self) -> float:
        """A random float in [0, 1), journaled."""
        value: float = self._recorded("loom.random", _random.random)
        return value

    def uuid(self) -> str:
        """A random UUID string, journaled."""
        value: str = self._recorded("loom.uuid", lambda: str(_uuid.uuid4()))
        return value


class Context(BaseContext):
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
        index, frame = self._claim_step(name)
        if frame is not None:
            return self._replayed(frame, returns)
        writer = self._writer
        writer.check_owner()
        policy = retry or self._host.retry
        span = self._control.span
        counters = self._host.counters
        for attempt in itertools.count(1):
            counters.steps += 1
            self._inside_step = name
            try:
                try:
                    if span is None:
                        value = fn(*args, **kwargs)
                    else:
                        with span.step(index, name, attempt):
                            value = fn(*args, **kwargs)
                finally:
                    self._inside_step = None
            except Unwind:
                raise
            except Exception as exc:
                self._host.sleep(self._retry_delay(policy, index, name, exc, attempt))
                writer.check_owner()  # a cancel or a release meanwhile: no more attempts
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
            return writer.record_step(index, name, value, attempt, returns)
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
        self._sleep_gate(self._sleep_seconds(duration))
