"""Delivery: what comes to a run from outside its code (a resume of a gate, a message,
a due timer, a cancel), journaled once, and the drive on from there.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from typing import Any, Final

import attrs

from loom_kernel._coordination import TimerEntry
from loom_kernel._core import (
    MAX_ID_LENGTH,
    ConflictError,
    ExecutionCancelled,
    ExecutionNotFoundError,
    ExecutionResumed,
    ExecutionState,
    InvalidArgumentError,
    LoomError,
    NotSuspendedError,
    RunFinishedError,
    Status,
    StreamDeletedError,
    encode_event,
    stream_of,
    to_json,
)
from loom_kernel._engine._driver import Driver, check_reason
from loom_kernel._engine._each import raise_first
from loom_kernel._engine._enqueueing import Enqueueing
from loom_kernel._engine._locks import LockBusyError
from loom_kernel._engine._views import Execution
from loom_kernel._replay import (
    RESERVED_RESUME_KEYS,
    TIMER_GATE,
    Drive,
    DriveControl,
    Message,
    consumed_positions,
    drive_here,
    gate_payload,
    message_key,
    message_payload,
    timer_resume_key,
    validate_topic,
    wait_of,
)

__all__ = ["AlreadyDeliveredError", "Delivery", "waits_for_messages"]

logger = logging.getLogger("loom")


class AlreadyDeliveredError(Exception):
    """Inside the engine only: a resume whose dedupe key was already delivered."""


class _Busy:
    """A delivery that found the run's lock taken (see `Delivery.deliver`)."""


_BUSY: Final = _Busy()
#: Sends an engine makes to a run between two looks at its inbox for messages to compact.
_COMPACT_EVERY: Final = 64
#: Runs whose sends an engine counts (the least recently sent to go first).
_SENDS_KEPT: Final = 1024


class Delivery:
    """Delivers resumes, messages, timers and cancels to the runs of one engine."""

    def __init__(self, driver: Driver, enqueueing: Enqueueing) -> None:
        self._driver = driver
        self._enqueueing = enqueueing
        self._sends: OrderedDict[str, int] = OrderedDict()  # since the last look, by run
        self._sends_lock = threading.Lock()

    # -- resumes ------------------------------------------------------------------

    def resume(self, execution_id: str, payload: Any, key: str | None, on: str | None) -> Execution:
        """See `Engine.resume`."""
        data = to_json(payload, "the resume payload")
        if key is not None and (not isinstance(key, str) or not key):
            raise InvalidArgumentError(f"a resume key is a non-empty str, not {key!r}")
        if key is not None and key.startswith(RESERVED_RESUME_KEYS):
            raise InvalidArgumentError(
                f"a resume key starting with {' or '.join(RESERVED_RESUME_KEYS)} is the "
                f"kernel's own (timers, messages), not {key!r}"
            )
        return drive_here(self.resuming(execution_id, data, key, timer=False, on=on))

    def resuming(
        self,
        execution_id: str,
        data: Any,
        key: str | None,
        *,
        timer: bool,
        on: str | None = None,
        settle: bool = True,
    ) -> Drive[Execution]:
        """Resume a parked run with `data` (a timer's wake, with `timer`) and drive it
        on. A resume whose key was delivered already returns the run's view (a timer's
        raises AlreadyDeliveredError: its poller counts only the wakes it made)."""
        driver = self._driver
        with driver.run_lock(execution_id):
            state = driver.checkout(execution_id)
            try:
                if timer and key != timer_resume_key(len(state.resume_payloads)):
                    # A timer of a gate another writer passed meanwhile: the run may be
                    # parked at a later gate with a deadline of its own.
                    raise AlreadyDeliveredError
                data = _check_parked(state, data, key, timer=timer, on=on)
            except AlreadyDeliveredError:
                execution = Execution.of(state)
                driver.cache.give_back(state)
                if timer:
                    raise  # the poller counts only the wakes it made
                return execution
            except LoomError:
                driver.cache.give_back(state)
                raise
            resumed = ExecutionResumed(data, key, driver.worker_id)
            if state.queue is not None:
                execution = self._enqueueing.wake_queued(state, resumed)
                return driver.settled(execution) if settle else execution
            if not driver.flows.hosts(state.flow):
                execution = self._wake_for_workers(state, resumed)
                return driver.settled(execution) if settle else execution
            # The resume is journaled with the drive's first new work, not before: a
            # replay that diverges before then journals nothing, and the run stays
            # parked at its gate for fixed code to take the same payload.
            control = DriveControl([encode_event(resumed, driver.clock())])
            state.apply(resumed)
            execution = yield from driver.driving_owned(state, control)
        return driver.settled(execution) if settle else execution

    def _wake_for_workers(self, state: ExecutionState, resumed: ExecutionResumed) -> Execution:
        """Journal the wake of a parked run this engine has no code for (held by the
        caller, who holds its lock), with no owner, and have every worker look at it.

        Raises:
            ConflictError: another writer moved the run first.
        """
        driver = self._driver
        try:
            driver.append(state, [attrs.evolve(resumed, by=None)])
        except BaseException:
            driver.cache.drop(state.id)
            raise
        execution = Execution.of(state)
        flow = state.flow
        driver.cache.give_back(state)
        try:
            driver.runs.nudged(execution.id, flow)
        except LoomError as exc:  # journaled: a worker's sweep finds it
            logger.warning("loom: %s: resumed, but no worker was told: %s", execution.id, exc)
        return execution

    # -- messages -----------------------------------------------------------------

    def send(
        self, execution_id: str, message: Any, topic: str | None, key: str | None, drive: bool
    ) -> int:
        """See `Engine.send`."""
        driver = self._driver
        stream_of(execution_id)
        topic = validate_topic(topic)
        if key is not None and (not isinstance(key, str) or not key or len(key) > MAX_ID_LENGTH):
            raise InvalidArgumentError(
                f"a message key is a non-empty str of at most {MAX_ID_LENGTH} characters, "
                f"not {key!r}"
            )
        data = to_json(message, "the message")
        status, generation = driver.view(
            execution_id, lambda state: (state.status, state.generation)
        )
        try:
            first = None if key is None else driver.inbox.sent(execution_id, key, generation)
            if first is not None:
                return first  # a resend: a no-op, whatever the run has done since
            if status.finished:
                raise RunFinishedError(execution_id, status.value)
            position = driver.inbox.append(execution_id, topic, key, data, generation)
            if key is not None:  # a racing resend may have landed first: that one counts
                position = driver.inbox.sent(execution_id, key, generation) or position
        except StreamDeletedError:
            # The run ended and retention deleted it meanwhile: say so (the view raises),
            # or, with the run still there, the inbox was deleted by other means.
            driver.view(execution_id, lambda state: state.generation)
            raise
        try:
            if drive and driver.locks.holding_any():
                # From inside a drive (a step): waiting for a run another drive holds
                # could wait for ever (its step may be sending to this run); the
                # delivery is made by whoever releases it.
                self._deliver_now_or_at_release(execution_id)
            elif drive:
                self.deliver(execution_id)
            else:
                view = driver.execution(execution_id)
                if view.status is Status.SUSPENDED and topic in view.topics:
                    driver.runs.nudged(execution_id, view.flow)
        except LoomError as exc:  # the message is sent: the wake is the run's business
            logger.warning("loom: %s: a message was sent, its wake failed: %s", execution_id, exc)
            with contextlib.suppress(LoomError):
                driver.runs.nudged(execution_id, driver.view(execution_id, lambda s: s.flow))
        state = driver.checkout(execution_id)
        try:
            consumed = consumed_positions(state.resume_keys)
            if state.status.finished and position not in consumed:
                raise RunFinishedError(execution_id, state.status.value, position)
            generation = state.generation
        finally:
            driver.cache.give_back(state)
        if self._compact_now(execution_id):
            try:  # `consumed` is what the committed journal says was read
                driver.inbox.compact(execution_id, consumed, generation)
            except LoomError as exc:  # the message is sent: a later send compacts
                logger.warning("loom: %s: its inbox was not compacted: %s", execution_id, exc)
        return position

    def _compact_now(self, execution_id: str) -> bool:
        """Whether this send is one to look at the run's inbox for messages to compact
        (one in `_COMPACT_EVERY` of the sends this engine makes to a run)."""
        with self._sends_lock:
            count = self._sends.pop(execution_id, 0) + 1
            self._sends[execution_id] = 0 if count >= _COMPACT_EVERY else count
            while len(self._sends) > _SENDS_KEPT:
                self._sends.popitem(last=False)
        return count >= _COMPACT_EVERY

    def _deliver_now_or_at_release(self, execution_id: str) -> None:
        """Deliver a waiting message now if the run's lock is free, else once it is
        released, by the thread that releases it (never waiting for it here)."""

        def attempt() -> None:
            try:
                if self.deliver(execution_id, wait=0.0) is not _BUSY:
                    return
            except LoomError as exc:
                logger.warning(
                    "loom: %s: a message was sent, its wake failed: %s", execution_id, exc
                )
                return
            if not self._driver.locks.after_release(execution_id, attempt):
                attempt()  # released meanwhile

        attempt()

    def deliver(
        self, execution_id: str, *, nudge: bool = True, wait: float | None = None
    ) -> Execution | _Busy | None:
        """`delivering` on this thread."""
        return drive_here(self.delivering(execution_id, nudge=nudge, wait=wait))

    def delivering(
        self, execution_id: str, *, nudge: bool = True, wait: float | None = None
    ) -> Drive[Execution | _Busy | None]:
        """Hand the first waiting message to the gate a run is parked at, if that gate
        takes it, and drive the run on; None when there was nothing to deliver here
        (see `_deliver_held`); `_BUSY` when the run's lock was not free within `wait`
        seconds (None: as long as it takes)."""
        try:
            with self._driver.locks.hold(execution_id, wait=wait):
                execution = yield from self.deliver_held(execution_id, nudge=nudge)
        except LockBusyError:
            return _BUSY
        return None if execution is None else self._driver.settled(execution)

    def deliver_held(self, execution_id: str, *, nudge: bool = True) -> Drive[Execution | None]:
        """`deliver` without calling the listeners. None when the run waits for no
        message that is there, when another writer moved it first (it reads the inbox
        itself from there), or when this engine lacks its flow's code: the run index
        then has the workers that have it look (with `nudge`: a visit from the index
        makes none, or each visit's nudge would bring the next)."""
        driver = self._driver
        with driver.locks.hold(execution_id):
            state = driver.checkout(execution_id)
            try:
                message = self._waiting_message(state)
                if (
                    message is not None
                    and state.queue is None
                    and not driver.flows.hosts_run(state)
                ):
                    if nudge:
                        driver.runs.nudged(execution_id, state.flow)
                    message = None
            except LoomError:
                driver.cache.give_back(state)
                raise
            if message is None:
                driver.cache.give_back(state)
                return None
            payload = message_payload(message.topic, message.position, message.message)
            resumed = ExecutionResumed(payload, message_key(message.position), driver.worker_id)
            if state.queue is not None:  # its queue's workers drive it on
                try:
                    return self._enqueueing.wake_queued(state, resumed)
                except ConflictError:
                    return None  # a sender, a timer or a cancel moved first
            control = DriveControl([encode_event(resumed, driver.clock())])
            state.apply(resumed)
            try:
                return (yield from driver.driving_owned(state, control))
            except ConflictError:
                return None  # a sender, a timer or the run itself moved first

    def _waiting_message(self, state: ExecutionState) -> Message | None:
        """The message the gate a run is parked at would take now, if any."""
        gate = state.pending_gate
        wait = None if gate is None else wait_of(gate.on)
        if wait is None or not wait.topics:
            return None
        consumed = consumed_positions(state.resume_keys)
        return self._driver.inbox.next_for(state.id, wait.topics, consumed, state.generation)

    # -- timers -------------------------------------------------------------------

    def fire_due_timers(self) -> list[str]:
        """See `Engine.fire_due_timers`."""
        now = self._driver.clock()
        woken, failures = self._driver.timers.fire_due(
            now, lambda entry: drive_here(self.fire(entry, now))
        )
        raise_first(failures)
        return woken

    def fire(self, entry: TimerEntry, now: float) -> Drive[bool | None]:
        """Wake one timer: True if woken, False if the hint is obsolete, None if not yet known.

        Decided and done under the run's lock, so two pollers of one engine never both
        count the same wake; across engines the resume's dedupe key decides. The
        listeners run after the lock is released, as after every drive.
        """
        with self._driver.locks.hold(entry.execution_id):
            due = self.timer_state(entry, now)
            if due is not True:
                return due
            # A message already in the inbox beats the deadline: it was sent before the
            # timer fired, whatever the clocks said.
            execution = yield from self.deliver_held(entry.execution_id)
            if execution is None:
                key = timer_resume_key(entry.gate)
                try:
                    execution = yield from self.resuming(
                        entry.execution_id, None, key, timer=True, settle=False
                    )
                except AlreadyDeliveredError:
                    return False  # another engine woke it meanwhile
                logger.info("loom: %s: its timer fired", entry.execution_id)
        self._driver.settled(execution)
        return True

    def timer_state(self, entry: TimerEntry, now: float) -> bool | None:
        """Whether a timer hint is due to wake its run now (see `_timer_due`); False
        for a run that does not exist."""
        try:
            due: bool | None = self._driver.view(
                entry.execution_id, lambda state: _timer_due(state, entry.gate, now)
            )
        except ExecutionNotFoundError:
            return False
        return due

    # -- cancels ------------------------------------------------------------------

    def cancel(self, execution_id: str, reason: str | None) -> Execution:
        """See `Engine.cancel`."""
        check_reason(reason)
        driver = self._driver
        while True:
            state = driver.checkout(execution_id)
            execution = Execution.of(state)
            if state.status.finished:
                driver.cache.give_back(state)
                return execution
            try:
                driver.append(state, [ExecutionCancelled(reason)])
            except ConflictError:
                continue  # the run moved on meanwhile: look again
            break
        execution = Execution.of(state)
        driver.cache.give_back(state)
        driver.stop(execution_id)
        return driver.settled(execution)


def _check_parked(
    state: ExecutionState, data: Any, key: str | None, *, timer: bool, on: str | None
) -> Any:
    """Whether the run's pending gate takes this resume; the payload to record."""
    if key is not None and key in state.resume_keys:
        raise AlreadyDeliveredError
    gate = state.pending_gate
    if gate is None:
        raise NotSuspendedError(state.id, state.status)
    if timer:
        if gate.wake_at is None:
            raise NotSuspendedError(state.id, "suspended", f"it waits on {gate.on!r}")
        return None  # a deadline: what the gate records is the timer's key
    if gate.on == TIMER_GATE:
        detail = f"it sleeps until {gate.wake_at}; fire_due_timers wakes it"
        raise NotSuspendedError(state.id, "suspended", detail)
    try:
        wait = wait_of(gate.on)
    except InvalidArgumentError as exc:
        raise NotSuspendedError(state.id, "suspended", str(exc)) from None
    assert wait is not None
    if not wait.gates:
        topics = ", ".join(repr(topic) for topic in wait.topics)
        detail = f"it waits for a message on {topics}; engine.send delivers it"
        raise NotSuspendedError(state.id, "suspended", detail)
    if on is None and len(wait.gates) > 1:
        detail = f"it waits on any of {list(wait.gates)}: say which with on="
        raise NotSuspendedError(state.id, "suspended", detail)
    name = wait.gates[0] if on is None else on
    if name not in wait.gates:
        shown = gate.on if not wait.named else f"any of {list(wait.gates)}"
        raise NotSuspendedError(state.id, "suspended", f"it waits on {shown!r}, not {on!r}")
    return gate_payload(name, data) if wait.named else data


def _timer_due(state: ExecutionState, gate: int, now: float) -> bool | None:
    """Whether timer gate `gate` is due to be woken now: True; False when the hint is
    obsolete; None when the journal does not show the gate yet."""
    if state.status.finished:
        return False
    if gate >= len(state.gates):
        return None  # the hint is ahead of the journal: the suspend may still land
    if gate < len(state.resume_payloads):
        return False  # already woken
    recorded = state.gates[gate]
    # A hint from an earlier attempt is obsolete; the recorded wake has its own.
    return recorded.wake_at is not None and recorded.wake_at <= now


def waits_for_messages(on: str | None) -> bool:
    """Whether a run parked at gate `on` waits for messages."""
    try:
        wait = None if on is None else wait_of(on)
    except InvalidArgumentError:
        return False
    return wait is not None and bool(wait.topics)
