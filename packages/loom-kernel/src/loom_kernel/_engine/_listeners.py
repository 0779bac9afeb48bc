"""Listeners: what an engine calls when a run parks or ends, one delivery at a time.

A listener may drive runs itself (orchestration resumes a parent when its child
ends), and that drive parks or ends a run too. Calling the listeners again from
inside a listener would nest one level per delivery: 200 children finishing one
after another would overflow the stack. So deliveries queue: the outermost call
empties the queue in a loop, and any call made meanwhile (in the same flow of
control, helper threads of async flows included) only adds to it.
"""

from __future__ import annotations

import contextvars
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Final

from loom_kernel._core import LoomError
from loom_kernel._engine._views import Execution

__all__ = ["LISTENER_GROUP", "AnyListener", "Listeners", "installed_listeners"]

#: A listener, called with the engine and a run's view (`Listener` types the engine).
AnyListener = Callable[[Any, Execution], None]
_Delivery = tuple[Execution, Callable[[Execution], None] | None]
LISTENER_GROUP: Final = "loom.listeners"
_installed: list[AnyListener] | None = None
_log = logging.getLogger("loom")


def installed_listeners() -> list[AnyListener]:
    """The listeners published in the `loom.listeners` entry-point group (loaded once)."""
    global _installed  # noqa: PLW0603 - a process-wide cache of installed plugins
    if _installed is None:
        from importlib.metadata import entry_points  # noqa: PLC0415 (a tenth of the import)

        _installed = [ep.load() for ep in entry_points(group=LISTENER_GROUP)]
    return list(_installed)


class Listeners:
    """An engine's listeners and its queue of deliveries."""

    def __init__(self, listeners: Iterable[AnyListener]) -> None:
        self._listeners: list[AnyListener] = []
        for listener in listeners:
            self.add(listener)
        self._queue: contextvars.ContextVar[deque[_Delivery] | None] = contextvars.ContextVar(
            f"loom_listener_queue_{id(self)}", default=None
        )

    def add(self, listener: AnyListener) -> None:
        """Add a listener (once)."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def deliver(
        self,
        engine: object,
        execution: Execution,
        delivered: Callable[[Execution], None] | None = None,
    ) -> bool:
        """Call every listener with `execution`, and with whatever they park or end.

        `delivered(execution)` is called once every listener has taken it without a
        LoomError (one that raised is called again by `recover()`).

        Returns:
            True when the deliveries ran now; False when this call only queued
            `execution` for a delivery loop already running in this flow of control.
        """
        queue = self._queue.get()
        if queue is not None:
            queue.append((execution, delivered))
            return False
        queue = deque([(execution, delivered)])
        token = self._queue.set(queue)
        unexpected: BaseException | None = None
        try:
            while queue:
                item, then = queue.popleft()
                taken = True
                for listener in self._listeners:
                    try:
                        listener(engine, item)
                    except LoomError as exc:  # recover() calls it again
                        taken = False
                        _log.warning(
                            "listener %r on %r: %s: %s", listener, item.id, type(exc).__name__, exc
                        )
                    except Exception as exc:  # a bug: raised once every delivery is made
                        taken = False
                        _log.exception("listener %r on %r failed", listener, item.id)
                        unexpected = unexpected or exc
                if taken and then is not None:
                    try:
                        then(item)
                    except LoomError as exc:  # recover() delivers it again
                        _log.warning(
                            "after delivery of %r: %s: %s", item.id, type(exc).__name__, exc
                        )
        finally:
            self._queue.reset(token)
        if unexpected is not None:
            raise unexpected
        return True
