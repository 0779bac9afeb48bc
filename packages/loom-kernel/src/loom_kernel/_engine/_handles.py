"""Handles: what `enqueue` returns, to wait for a run a worker drives."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

from loom_kernel._core import (
    ExecutionEndedError,
    InvalidArgumentError,
    ResultTimeoutError,
    Status,
    finite_number,
)
from loom_kernel._engine._driver import Driver
from loom_kernel._engine._views import Execution
from loom_kernel._replay import in_a_thread

__all__ = ["RunHandle"]

#: How often `result` looks at the run: from the first wait, doubling up to the last.
_FIRST_WAIT: Final = 0.005
_LONGEST_WAIT: Final = 0.25


class RunHandle:
    """A run started by `Engine.enqueue` (or named by `Engine.handle`).

    Attributes:
        id: the execution id.
    """

    __slots__ = ("_driver", "id")

    def __init__(self, driver: Driver, execution_id: str) -> None:
        self._driver = driver
        self.id = execution_id

    def __repr__(self) -> str:
        return f"RunHandle({self.id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunHandle) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def get(self) -> Execution:
        """The run's current view (see `Engine.get`)."""
        return self._driver.execution(self.id)

    def wait(self, timeout: float | None = None) -> Execution:
        """Wait until the run has finished; its final view (completed, failed or cancelled).

        Args:
            timeout: seconds to wait at most; None waits as long as it takes.

        Raises:
            ResultTimeoutError: it had not finished when the time ran out.
            ExecutionNotFoundError: there is no such run.
        """
        looks = _Looks(self.id, timeout)
        while True:
            seen = self._driver.finished_count
            execution = self.get()
            if execution.status.finished:
                return execution
            self._driver.wait_for_a_finish(seen, looks.pause(execution))

    async def wait_async(self, timeout: float | None = None) -> Execution:
        """`wait`, for `async def` callers: it sleeps on the loop between looks."""
        looks = _Looks(self.id, timeout)
        while True:
            execution = await in_a_thread(self.get)
            if execution.status.finished:
                return execution
            await asyncio.sleep(looks.pause(execution))

    async def result_async(self, timeout: float | None = None) -> Any:
        """`result`, for `async def` callers (see `wait_async`)."""
        return self._outcome(await self.wait_async(timeout))

    def result(self, timeout: float | None = None) -> Any:
        """Wait until the run has finished and return what its flow returned.

        Args:
            timeout: seconds to wait at most; None waits as long as it takes.

        Raises:
            ResultTimeoutError: it had not finished when the time ran out (it goes on).
            ExecutionEndedError: it failed or was cancelled.
            ExecutionNotFoundError: there is no such run.
        """
        return self._outcome(self.wait(timeout))

    def _outcome(self, execution: Execution) -> Any:
        if execution.status is Status.COMPLETED:
            return execution.result
        if execution.status is Status.FAILED:
            error = execution.error
            raise ExecutionEndedError(
                self.id,
                execution.status.value,
                error.type if error else None,
                error.message if error else None,
            )
        raise ExecutionEndedError(self.id, execution.status.value, None, execution.cancel_reason)


class _Looks:
    """When a wait for a run looks again: every 5 ms, doubling up to every 250 ms,
    until `timeout` seconds (None: no end)."""

    def __init__(self, execution_id: str, timeout: float | None) -> None:
        if timeout is not None and (not finite_number(timeout) or timeout < 0):
            raise InvalidArgumentError(f"a timeout is a number of seconds >= 0, not {timeout!r}")
        self._id = execution_id
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._pause = _FIRST_WAIT

    def pause(self, execution: Execution) -> float:
        """How long to wait before the next look at a run not finished yet.

        Raises:
            ResultTimeoutError: the time is up.
        """
        pause = self._pause
        self._pause = min(pause * 2, _LONGEST_WAIT)
        if self._deadline is None:
            return pause
        left = self._deadline - time.monotonic()
        if left <= 0:
            assert self._timeout is not None
            raise ResultTimeoutError(self._id, execution.status.value, self._timeout)
        return min(pause, left)
