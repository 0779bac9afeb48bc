"""Recovery and takeover: drive the runs left running (by a crash, or a worker that
stopped), call the listeners again for the runs still open, and rebuild the run index
from the journals when it is missing or damaged.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Final

from loom_kernel._coordination import (
    Closing,
    OpenHint,
    abandoned_here,
    execution_ids,
    first_timestamp,
    last_record,
    sighting,
)
from loom_kernel._core import (
    ExecutionDeleted,
    ExecutionNotFoundError,
    LoomError,
    SchemaError,
    Status,
    StreamDeletedError,
    stream_of,
)
from loom_kernel._engine._delivery import Delivery, waits_for_messages
from loom_kernel._engine._driver import Driver
from loom_kernel._engine._each import raise_first, try_each
from loom_kernel._engine._enqueueing import Enqueueing
from loom_kernel._engine._views import Execution
from loom_kernel._replay import Drive, drive_here

__all__ = ["NOT_STARTED", "Recovery"]

logger = logging.getLogger("loom")


class _Missing:
    """What `_recovering_one` returns for a run that does not exist."""


_MISSING: Final = _Missing()


class _NotStarted:
    """What `recover_hint` returns for a hint whose run may still start."""


NOT_STARTED: Final = _NotStarted()


class Recovery:
    """Recovers the runs of one engine's store."""

    def __init__(self, driver: Driver, enqueueing: Enqueueing, delivery: Delivery) -> None:
        self._driver = driver
        self._enqueueing = enqueueing
        self._delivery = delivery

    def recover(self) -> list[str]:
        """See `Engine.recover`."""
        runs = self._driver.runs
        try:
            hints = list(runs.open_runs()) if runs.built() else None
        except SchemaError as exc:
            logger.warning("loom: %s; recovering from every journal", exc)
            hints = None
        if hints is None:
            return self._recover_everything()
        driven, failures = try_each(hints, self.recover_open, "recover")
        raise_first(failures)
        return [execution_id for execution_id in driven if execution_id is not None]

    def recover_one(self, execution_id: str) -> list[str]:
        """See `Engine.recover` with an id."""
        stream_of(execution_id)
        outcome = drive_here(self._recovering_one(execution_id))
        if isinstance(outcome, _Missing):
            raise ExecutionNotFoundError(f"no execution {execution_id!r}")
        return [outcome] if isinstance(outcome, str) else []

    def recover_open(self, hint: OpenHint) -> str | None:
        """Visit one run the index holds open: drive it if it is left running and may
        be taken over, call the listeners again if it parked or ended, and drop the
        hint of a run that does not exist once its writer is gone.

        Returns:
            The run's id if it was driven.
        """
        outcome = drive_here(self.recover_hint(hint))
        return outcome if isinstance(outcome, str) else None

    def recover_hint(self, hint: OpenHint) -> Drive[str | _NotStarted | None]:
        """As `recover_open`, telling a run whose start has not landed yet (its writer
        may still be writing it) with NOT_STARTED."""
        execution_id = hint.execution_id
        outcome = yield from self._recovering_one(execution_id)
        if not isinstance(outcome, _Missing):
            return outcome
        if self.hint_abandoned(hint):
            self._driver.runs.dropped(execution_id)
            return None
        return NOT_STARTED

    def hint_abandoned(self, hint: OpenHint) -> bool:
        """Whether a hint's run can no longer start: deleted, or its writer is gone (known
        gone here, or not seen for a lease since the hint)."""
        driver = self._driver
        stream = stream_of(hint.execution_id)
        try:
            if driver.store.head(stream) > 0 and not _deleted(driver, hint.execution_id):
                return False  # it started since (a run's deletion is not a start)
        except StreamDeletedError:
            return True
        if hint.by is None:
            return driver.clock() - hint.at > driver.lease
        if abandoned_here(hint.by, hint.execution_id):
            return True
        seen = sighting(driver.store, hint.by, hint.execution_id, stream).seen_at
        last = hint.at if seen is None else max(seen, hint.at)
        return driver.clock() - last > driver.lease

    def _recover_everything(self) -> list[str]:
        """`recover()` by listing every journal, then bringing the run index up to what
        the listing found (see `RunIndex.rebuild`); the store is marked indexed only
        when every run could be looked at."""
        driver = self._driver
        still_open: dict[str, OpenHint] = {}
        ended: dict[str, tuple[str, Status, str]] = {}
        ended_at: dict[str, Closing] = {}  # when each ended and started, and more

        def file_ended(execution: Execution) -> None:
            if execution.status.finished:
                ended[execution.id] = (execution.id, execution.status, execution.flow)
                stream = stream_of(execution.id)
                last = last_record(driver.store, stream)
                at = driver.clock() if last is None else last.timestamp
                started = first_timestamp(driver.store, stream)
                ended_at[execution.id] = (at, execution.generation, started, execution.parent)

        def visit(execution_id: str) -> str | None:
            try:
                outcome = drive_here(self._recovering_one(execution_id, file_ended))
            finally:  # indexed as open even when its visit failed: it is not ended
                with contextlib.suppress(LoomError):
                    flow_name = driver.view(execution_id, lambda state: state.flow)
                    still_open[execution_id] = OpenHint(execution_id, flow_name, None, 0.0)
            return None if isinstance(outcome, _Missing) else outcome

        driven, failures = try_each(execution_ids(driver.store), visit, "recover")
        for execution_id in ended:
            still_open.pop(execution_id, None)
        try:
            driver.runs.index_ended(ended.values(), ended_at)
            driver.runs.rebuild(still_open.values(), ended, ended_at)
            if not failures:
                driver.runs.mark_built()
        except LoomError as exc:
            failures.append(exc)
        raise_first(failures)
        return [execution_id for execution_id in driven if execution_id is not None]

    def _recovering_one(
        self, execution_id: str, delivered: Callable[[Execution], None] | None = None
    ) -> Drive[str | _Missing | None]:
        """Drive one run if it is left running; its id if it was driven, None if not,
        _MISSING if there is no such run."""
        driver = self._driver
        driven = None
        with driver.locks.hold(execution_id), driver.heartbeat.holding(execution_id):
            try:
                state = driver.checkout(execution_id)
            except ExecutionNotFoundError:
                return _MISSING  # deleted since the listing, or never started
            queued = state.queue if state.status is Status.RUNNING else None
            code = state.code_hash
            if queued is not None:  # its queue's workers drive it, as the limits allow
                execution = Execution.of(state)
                driver.cache.give_back(state)
            elif (
                state.status is Status.RUNNING
                and driver.flows.hosts(state.flow)
                and driver.take_over(state)
            ):
                execution = yield from driver.driving_owned(state)
                driven = execution_id
            else:
                execution = Execution.of(state)
                driver.cache.give_back(state)
        if queued is not None:
            self._enqueueing.ensure_queued(execution_id, queued, execution.flow, code)
        driver.settled(execution, delivered)
        # A sender that appended its message and stopped before waking the run (the
        # listeners hear how the drive ends from `deliver`, once).
        if (
            execution.status is Status.SUSPENDED
            and waits_for_messages(execution.waiting_on)
            and (yield from self._delivery.delivering(execution_id, nudge=False)) is not None
        ):
            driven = execution_id
        return driven


def _deleted(driver: Driver, execution_id: str) -> bool:
    """Whether an id's journal ends at a deletion (no run of it started since)."""
    last = last_record(driver.store, stream_of(execution_id))
    return last is not None and last.kind == ExecutionDeleted.KIND
