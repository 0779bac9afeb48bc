"""The rule for the Engine's async API, in one place.

Every Engine call that reads or writes the store has an `_async` twin, with the same
arguments, result and errors, for `async def` callers: it makes the call on a thread
of Loom's own (one for each call in flight, never the loop's default executor's few,
see `_replay._threads`), so the caller's event loop is never held and no call waits
for another, and an async flow that a drive reaches runs its code on the caller's loop.
The calls that touch no store (`register`, `hosts`, `newest`, `stream_of`, `handle`,
`add_listener`) have none. Two twins are written by hand, because their sync call
would do I/O after it returns or wait on this thread: `executions_async` (a list, not a
lazy iterator) and `get_event_async` (it waits between looks on the loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from loom_kernel._replay import in_a_thread, on_loop

__all__ = ["async_twin"]

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


def async_twin(
    call: Callable[Concatenate[S, P], R],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
    """The `_async` twin of an Engine method (see the module's docstring)."""

    name = call.__name__

    async def twin(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        loop = asyncio.get_running_loop()
        method: Callable[P, R] = getattr(self, name)  # a subclass's override, if any
        return await in_a_thread(on_loop(loop, method), *args, **kwargs)

    twin.__name__ = f"{call.__name__}_async"
    twin.__qualname__ = f"{call.__qualname__}_async"
    twin.__doc__ = (
        f"`{call.__name__}`, for `async def` callers: made on a thread of Loom's own, so "
        "the caller's loop is never held (an async flow it drives runs on that loop). "
        f"Arguments, result and errors are those of `{call.__name__}`."
    )
    return twin
