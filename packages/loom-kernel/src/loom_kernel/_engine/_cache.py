"""The engine's cache of folded executions, lent out to one user at a time.

A folded state is brought up to date by folding into it in place, so two threads
must never hold the same one. `take` removes a state from the cache and gives it to
its caller alone; `give_back` returns it. While a drive holds a run's state, a
reader in another thread finds nothing here and folds its own copy from the store,
so a read never waits for a drive (and a step can look at its own run).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from loom_kernel._core import ExecutionState

__all__ = ["StateCache"]


class StateCache:
    """At most `size` folded executions, least recently used dropped first."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._states: OrderedDict[str, ExecutionState] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, execution_id: str) -> ExecutionState | None:
        """Remove and return the cached state of an execution, if there is one."""
        with self._lock:
            return self._states.pop(execution_id, None)

    def give_back(self, state: ExecutionState) -> None:
        """Cache `state`, unless a copy folded further is already there."""
        if self._size <= 0:
            return
        with self._lock:
            present = self._states.get(state.id)
            if present is None or present.position <= state.position:
                self._states[state.id] = state
            self._states.move_to_end(state.id)
            while len(self._states) > self._size:
                self._states.popitem(last=False)

    def drop(self, execution_id: str) -> None:
        """Forget an execution."""
        with self._lock:
            self._states.pop(execution_id, None)
