"""Versions (K11): check that a run's history replays on other code, and migrate a
live run to it (`resume_as`), journaling the move in its `_migrations` audit.
"""

from __future__ import annotations

from loom_kernel._core import ExecutionMigrated, InvalidArgumentError, Status
from loom_kernel._engine._driver import Driver, check_reason
from loom_kernel._engine._enqueueing import Enqueueing
from loom_kernel._engine._views import Execution
from loom_kernel._replay import Flow, replay_check

__all__ = ["Versions"]


class Versions:
    """Checks and migrates the runs of one engine."""

    def __init__(self, driver: Driver, enqueueing: Enqueueing) -> None:
        self._driver = driver
        self._enqueueing = enqueueing

    def replay_check(self, execution_id: str, to: Flow | str | None) -> None:
        """See `Engine.replay_check`."""
        driver = self._driver
        state = driver.checkout(execution_id)
        try:
            replay_check(driver.flows.version(state.flow, to), driver.host, state)
        finally:
            driver.cache.give_back(state)

    def resume_as(self, execution_id: str, to: Flow | str, reason: str | None) -> Execution:
        """See `Engine.resume_as`."""
        check_reason(reason)
        driver = self._driver
        with driver.locks.hold(execution_id):
            state = driver.checkout(execution_id)
            try:
                if state.status.finished:
                    raise InvalidArgumentError(
                        f"execution {execution_id!r} is {state.status}: a finished run never "
                        "runs again, so there is nothing to migrate"
                    )
                target = driver.flows.version(state.flow, to)
                if (
                    target.code_hash != state.code_hash
                    and state.status is Status.RUNNING
                    and driver.driven_now(state)
                ):
                    raise InvalidArgumentError(
                        f"execution {execution_id!r} is being driven by {state.owner!r}: "
                        "its code cannot change under a drive in flight; migrate it once it "
                        "parks, or once its owner is gone (its lease runs out)"
                    )
                if target.code_hash != state.code_hash:
                    replay_check(target, driver.host, state)
                    migrated = ExecutionMigrated(state.code_hash, target.code_hash, reason)
                    driver.append(state, [migrated])
                execution = Execution.of(state)
                place, flow_name, code = state.queue, state.flow, state.code_hash
            except BaseException:
                driver.cache.drop(execution_id)
                raise
            driver.cache.give_back(state)
        if place is not None and execution.status is Status.RUNNING:
            self._enqueueing.requeue_migrated(place, execution_id, flow_name, code)
        return execution
