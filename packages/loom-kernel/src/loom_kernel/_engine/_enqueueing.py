"""Enqueueing: runs started for a worker to drive, on an engine's queues or handed to
the slots of a worker of this engine, and the drives of the runs a queue admits.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Protocol

import attrs

from loom_kernel._coordination import (
    Queue,
    QueueBook,
    QueueView,
    abandoned_here,
    driving_here,
    last_record,
    sighting,
)
from loom_kernel._core import (
    ConflictError,
    ExecutionNotFoundError,
    ExecutionResumed,
    ExecutionState,
    InvalidArgumentError,
    LoomError,
    QueuePlace,
    Status,
    StoreUnavailableError,
    stream_of,
)
from loom_kernel._engine._driver import Driver
from loom_kernel._engine._handles import RunHandle
from loom_kernel._engine._starts import Starts
from loom_kernel._engine._views import Execution
from loom_kernel._replay import Drive, Flow

__all__ = ["Enqueueing", "LocalSlots", "QueuedDrive"]

logger = logging.getLogger("loom")


class LocalSlots(Protocol):
    """The slots of a worker running on this engine, as `enqueue` hands runs to them."""

    def reserve(self, execution_id: str, *, queue: bool) -> bool:
        """Take a free slot (or, with `queue`, a place in the worker's queue) for a run
        about to start; whether one was taken."""

    def unreserve(self, execution_id: str) -> None:
        """Give back what `reserve` took for a run that was not handed over."""

    def hand(
        self,
        execution_id: str,
        drive: Callable[[], Drive[None]],
        let_go: Callable[[], None],
        flow: str,
    ) -> bool:
        """Drive a reserved run in its slot (or queue it for the next); False when the
        worker is stopping (the reservation is given back)."""

    def wake(self) -> None:
        """Have the worker poll now."""


class QueuedDrive(enum.Enum):
    """What a queue admission came to: DRIVEN (until it parked or ended, or another
    writer took over), LEFT_RUNNING (driven, then let go running: it waits again),
    NOT_NOW (not driven: its claim met a live owner or a transient fault; it waits
    again, and the admission counts for no rate), VOID (not driven: the run had
    ended or parked; the admission counts for no rate)."""

    DRIVEN = "driven"
    LEFT_RUNNING = "left running"
    NOT_NOW = "not now"
    VOID = "void"


class Enqueueing:
    """Enqueues runs on one engine and drives the runs its queues admit."""

    def __init__(self, driver: Driver, starts: Starts, queues: Iterable[Queue]) -> None:
        self._driver = driver
        self._starts = starts
        self.book = QueueBook(driver.store, driver.clock, queues)
        self.slots: list[LocalSlots] = []  # of the running workers of this engine

    def enqueue(
        self,
        flow_name: str | Flow,
        input: Any,
        key: str | None,
        parent: str | None,
        *,
        queue: str | None,
        priority: int,
        queue_key: str | None,
    ) -> RunHandle:
        """See `Engine.enqueue`."""
        if queue is not None:
            place = self.book.queue(queue), priority, queue_key
            return self._enqueue_on(flow_name, input, key, parent, place)
        if type(priority) is not int or priority != 0 or queue_key is not None:
            raise InvalidArgumentError(
                f"a priority or a queue key needs a queue (queue=name), not priority={priority!r}"
                f" and queue_key={queue_key!r}"
            )
        return self._enqueue(flow_name, input, key, parent, inline_otherwise=False)

    def dispatch(
        self, flow_name: str | Flow, input: Any, key: str | None, parent: str | None
    ) -> RunHandle:
        """Hand a new run to a worker of this engine (a free slot or its queue), or,
        when none takes it (none runs, or it is stopping), start it inline."""
        return self._enqueue(flow_name, input, key, parent, inline_otherwise=True)

    def _enqueue_on(
        self,
        flow_name: str | Flow,
        input: Any,
        key: str | None,
        parent: str | None,
        where: tuple[Queue, int, str | None],
    ) -> RunHandle:
        """Start a run with no owner on a queue (with a priority and a key), then have
        it wait there for a worker."""
        driver = self._driver
        queue, priority, queue_key = where
        execution_id, event = self._starts.new_start(
            flow_name, input, key, parent, None, unhosted=True
        )
        place = queue.place(execution_id, priority, queue_key)
        event = attrs.evolve(event, queue=place)
        with driver.locks.hold(execution_id), driver.heartbeat.holding(execution_id):
            added = self._starts.append_start(event, execution_id)
            if added is not None:
                driver.cache.give_back(added)
        if added is not None:
            self.queue_up(place, execution_id, event.flow, event.code_hash)
        return RunHandle(driver, execution_id)

    def _enqueue(
        self,
        flow_name: str | Flow,
        input: Any,
        key: str | None,
        parent: str | None,
        *,
        inline_otherwise: bool,
    ) -> RunHandle:
        driver, starts = self._driver, self._starts
        # Without the flow's code here, neither this engine's workers nor an inline
        # start can drive it: the run waits for a worker that has it.
        hosted = not isinstance(flow_name, str) or driver.flows.hosts(flow_name)
        slots = list(self.slots) if hosted else []
        if inline_otherwise and hosted and not slots:
            return RunHandle(driver, starts.start(flow_name, input, key, parent).id)
        execution_id, event = starts.new_start(flow_name, input, key, parent, None, unhosted=True)
        taker = next((s for s in slots if s.reserve(execution_id, queue=False)), None)
        if taker is None:  # no free slot anywhere here: a place in a worker's queue
            taker = next((s for s in slots if s.reserve(execution_id, queue=True)), None)
        if taker is None and inline_otherwise and hosted:
            return RunHandle(driver, starts.start(flow_name, input, key, parent).id)
        if taker is not None:  # the run starts as this engine's own
            event = attrs.evolve(event, by=driver.worker_id)
        handoff = contextlib.ExitStack()
        added = handed = False
        try:
            with driver.locks.hold(execution_id), driver.heartbeat.holding(execution_id):
                started = starts.append_start(event, execution_id)
                added = started is not None
                state = started or ExecutionState(id=execution_id)
                if added and taker is not None:
                    # Held until the worker's drive holds it: no beat in between may
                    # say this worker dropped the run, or another could take it over.
                    handoff.enter_context(driver.heartbeat.holding(execution_id))
                elif added:
                    driver.cache.give_back(state)  # a worker of this engine starts from it
            if taker is not None and added:
                drive = partial(self._drive_handed, state, handoff)
                handed = taker.hand(execution_id, drive, handoff.close, event.flow)
        except BaseException:
            # The start failed (a start that landed although its append raised is this
            # engine's: a poll finds it), or an interrupt: nothing is handed over.
            if not handed:
                handoff.close()
                if taker is not None:
                    taker.unreserve(execution_id)
            raise
        if taker is not None and not handed:
            # A run with that key exists, or the worker is stopping: the run is left
            # to the polls, and the slot or place goes back.
            handoff.close()
            taker.unreserve(execution_id)
        if added and taker is None:  # once this engine no longer holds it
            for other in slots:
                other.wake()
        return RunHandle(driver, execution_id)

    def _drive_handed(self, state: ExecutionState, handoff: contextlib.ExitStack) -> Drive[None]:
        """Drive a run `enqueue` started as this engine's own and handed to a worker's
        free slot, as `start` would have inline: no claim, no poll."""
        driver = self._driver
        execution_id = state.id
        try:
            with driver.locks.hold(execution_id), driver.heartbeat.holding(execution_id):
                handoff.close()
                execution = yield from driver.driving_owned(state)
        finally:
            handoff.close()
        driver.settled(execution)

    def queue_up(self, place: QueuePlace, execution_id: str, flow: str, code: str) -> None:
        """Have a queued run whose start or wake landed wait on its queue, and wake
        this engine's workers. A failure is logged, not raised: what landed stands,
        and the sweeps add the run to its queue (see `ensure_queued`)."""
        try:
            self.book.add(place, execution_id, flow, code)
        except LoomError as exc:
            logger.warning("loom: %s not put on queue %r yet: %s", execution_id, place.name, exc)
        for slots in self.slots:
            slots.wake()

    def wake_queued(self, state: ExecutionState, resumed: ExecutionResumed) -> Execution:
        """Journal the wake of a parked queued run with no owner (held by the caller, who
        holds its lock), then have it wait on its queue: its workers drive it.

        Raises:
            ConflictError: another writer moved the run first.
        """
        assert state.queue is not None
        driver = self._driver
        try:
            driver.append(state, [attrs.evolve(resumed, by=None)])
        except BaseException:
            driver.cache.drop(state.id)
            raise
        execution = Execution.of(state)
        place, flow, code = state.queue, state.flow, state.code_hash
        driver.cache.give_back(state)
        self.queue_up(place, state.id, flow, code)
        return execution

    def ensure_queued(self, execution_id: str, place: QueuePlace, flow: str, code: str) -> None:
        """Put a queued run left running with no driver back on its queue, if it is
        neither waiting there nor admitted, and its writer (which adds it right after
        its start or wake) has had half a lease to do so."""
        driver = self._driver
        fold = self.book.read(place.name, place.partition)
        if execution_id in fold.waiting or execution_id in fold.active:
            return
        last = last_record(driver.store, stream_of(execution_id))
        if last is not None and driver.clock() - last.timestamp <= driver.lease / 2:
            return
        logger.info("loom: %s: putting it back on queue %r", execution_id, place.name)
        self.queue_up(place, execution_id, flow, code)

    def requeue_migrated(self, place: QueuePlace, execution_id: str, flow: str, code: str) -> None:
        """A queued run waiting on its queue, migrated: its entry there takes the new
        code (keeping its place), or workers with only the new code never admit it."""
        try:
            waiting = self.book.read(place.name, place.partition).waiting.get(execution_id)
        except LoomError as exc:
            logger.warning("loom: %s: its queue not told of its new code: %s", execution_id, exc)
            return
        if waiting is not None and waiting.code != code:
            self.queue_up(place, execution_id, flow, code)

    def drive_queued(self, execution_id: str) -> Drive[QueuedDrive]:
        """Drive a run a worker of this engine admitted from its queue: claim it, then
        drive it until it parks or ends.

        Returns:
            What the admission came to (see `QueuedDrive`).
        """
        driver = self._driver
        with driver.locks.hold(execution_id), driver.heartbeat.holding(execution_id):
            try:
                state = driver.checkout(execution_id)
            except ExecutionNotFoundError:
                return QueuedDrive.VOID
            if state.status is not Status.RUNNING:  # ended (a cancel), or parked already
                driver.cache.give_back(state)
                return QueuedDrive.VOID
            try:
                claimed = driver.take_over(state)
            except (ConflictError, StoreUnavailableError):
                driver.cache.drop(execution_id)
                return QueuedDrive.NOT_NOW
            except BaseException:
                driver.cache.drop(execution_id)
                raise
            if not claimed:  # a live owner holds it (one that let it go, not gone yet)
                driver.cache.give_back(state)
                return QueuedDrive.NOT_NOW
            execution = yield from driver.driving_owned(state)
        driver.settled(execution)
        if execution.status is Status.RUNNING and execution.owner == driver.worker_id:
            return QueuedDrive.LEFT_RUNNING  # let go at a stop, or stopped by a fault
        return QueuedDrive.DRIVEN

    def queued_stale(self, execution_id: str, taker: str) -> bool | None:
        """Whether a run admitted by worker `taker` (long enough ago) is no longer
        driven by it: None while it may be; else whether it should wait again (it is
        running: the taker never claimed it, or stopped)."""
        driver = self._driver
        try:
            status, owner = driver.view(execution_id, lambda state: (state.status, state.owner))
        except ExecutionNotFoundError:
            return False
        if status is not Status.RUNNING:
            return False
        if owner != taker:
            return True  # admitted half a lease ago and never claimed
        if owner == driver.worker_id:
            return None if driving_here(owner, execution_id) else True
        if abandoned_here(owner, execution_id):
            return True
        seen = sighting(driver.store, owner, execution_id, stream_of(execution_id))
        return True if seen.expired(driver.clock(), driver.lease) else None

    def view(self, name: str) -> QueueView:
        """See `Engine.queue`."""
        return self.book.view(name)
