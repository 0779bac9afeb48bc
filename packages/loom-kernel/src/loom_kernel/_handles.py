"""Handles: what `enqueue` returns, to wait for a run a worker drives."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Final

from loom_kernel._errors import ExecutionEndedError, InvalidArgumentError, ResultTimeoutError
from loom_kernel._numbers import finite_number
from loom_kernel._state import Status

if TYPE_CHECKING:
    from loom_kernel._engine import Engine
    from loom_kernel._views import Execution

__all__ = ["RunHandle"]

#: How often `result` looks at the run: from the first wait, doubling up to the last.
_FIRST_WAIT: Final = 0.005
_LONGEST_WAIT: Final = 0.25


class RunHandle:
    """A run started by `Engine.enqueue` (or named by `Engine.handle`).

    Attributes:
        id: the execution id.
    """

    __slots__ = ("_engine", "id")

    def __init__(self, engine: Engine, execution_id: str) -> None:
        self._engine = engine
        self.id = execution_id

    def __repr__(self) -> str:
        return f"RunHandle({self.id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunHandle) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def get(self) -> Execution:
        """The run's current view (see `Engine.get`)."""
        return self._engine.get(self.id)

    def wait(self, timeout: float | None = None) -> Execution:
        """Wait until the run has finished; its final view (completed, failed or cancelled).

        Args:
            timeout: seconds to wait at most; None waits as long as it takes.

        Raises:
            ResultTimeoutError: it had not finished when the time ran out.
            ExecutionNotFoundError: there is no such run.
        """
        if timeout is not None and (not finite_number(timeout) or timeout < 0):
            raise InvalidArgumentError(f"a timeout is a number of seconds >= 0, not {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _FIRST_WAIT
        while True:
            execution = self.get()
            if execution.status.finished:
                return execution
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                assert timeout is not None
                raise ResultTimeoutError(self.id, execution.status.value, timeout)
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, _LONGEST_WAIT)

    async def wait_async(self, timeout: float | None = None) -> Execution:
        """`wait`, for `async def` callers: it sleeps on the loop between looks."""
        if timeout is not None and (not finite_number(timeout) or timeout < 0):
            raise InvalidArgumentError(f"a timeout is a number of seconds >= 0, not {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _FIRST_WAIT
        while True:
            execution = await asyncio.to_thread(self.get)
            if execution.status.finished:
                return execution
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                assert timeout is not None
                raise ResultTimeoutError(self.id, execution.status.value, timeout)
            await asyncio.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, _LONGEST_WAIT)

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
