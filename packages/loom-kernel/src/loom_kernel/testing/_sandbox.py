"""An engine, a fake clock and a memory store in one call: the setup of a flow test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from loom_kernel._engine._facade import Engine
from loom_kernel._replay._flows import Flow
from loom_kernel._spi._clock import FakeClock
from loom_kernel._spi._journal import JournalStore
from loom_kernel._spi._memory_store import MemoryStore

__all__ = ["Sandbox", "sandbox"]


def _no_wait(_seconds: float) -> None:
    """Retries in tests do not wait for real time."""


@attrs.frozen
class Sandbox:
    """A store and a clock that engines share, like processes sharing a database.

    Attributes:
        store: the store (a fresh memory store unless one was given).
        clock: the clock every engine reads; `clock.advance(60)` moves time.
        engine: the first engine.
    """

    store: JournalStore
    clock: FakeClock
    engine: Engine
    _flows: tuple[Flow | Callable[..., Any], ...]
    _options: dict[str, Any]

    def new_engine(self, **options: Any) -> Engine:
        """Another engine over the same store and clock (a second process, say), with
        the same flows; `options` override the sandbox's engine options."""
        return Engine(self.store, self._flows, clock=self.clock, **{**self._options, **options})


def sandbox(
    *flows: Flow | Callable[..., Any],
    store: JournalStore | None = None,
    clock: FakeClock | None = None,
    **options: Any,
) -> Sandbox:
    """Set up a flow test in one call::

        box = sandbox(approval)
        run = box.engine.start("approval", order)
        box.clock.advance(3600)
        box.engine.fire_due_timers()

    Args:
        flows: the flows the engines run.
        store: the store (default: a new private memory store).
        clock: the clock (default: a FakeClock at 1,700,000,000).
        options: Engine options (`retry`, `listeners`, `cache_size`...); retries never
            wait for real time unless `sleep` is given.
    """
    options.setdefault("sleep", _no_wait)
    shared_store = store if store is not None else MemoryStore()
    shared_clock = clock if clock is not None else FakeClock()
    first = Engine(shared_store, flows, clock=shared_clock, **options)
    return Sandbox(shared_store, shared_clock, first, tuple(flows), dict(options))
