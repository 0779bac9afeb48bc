"""Fault injection: the seam a store may offer so the conformance kit can drive its failure
paths, and the one error a store raises inside itself for a write whose reply was lost."""

from __future__ import annotations

import enum
from collections import deque
from typing import Protocol, runtime_checkable

from loom_kernel._core import StoreUnavailableError

__all__ = ["AmbiguousWriteError", "Fault", "FaultInjection", "SupportsFaultInjection"]


class Fault(enum.Enum):
    """A transport fault to inject into a store's next append."""

    #: The write reaches the backend and lands, but its reply is lost: the store sees
    #: an ambiguous failure and must find out itself whether its write landed.
    LOST_REPLY = "lost_reply"
    #: The backend refuses the request before writing anything (a transient fault):
    #: the store raises StoreUnavailableError and nothing lands.
    UNAVAILABLE = "unavailable"


class AmbiguousWriteError(Exception):
    """Inside a store only: a write whose outcome is unknown (its reply was lost).

    A store raises it from its transport layer and catches it in its append, which
    must then find out whether the write landed (docs/spi.md, *Ambiguous failures*).
    It never escapes a store.
    """


@runtime_checkable
class SupportsFaultInjection(Protocol):
    """A store that can fail its next append on purpose, for the conformance kit."""

    def inject_fault(self, fault: Fault) -> None:
        """Make the next append meet `fault` (one fault per call, consumed in order)."""


class FaultInjection:
    """The fault-injection seam, for a store to inherit beside JournalStore.

    In its append, a store calls `_next_fault(stream)` first: it raises
    StoreUnavailableError for an injected UNAVAILABLE, and returns True when the
    write must land but lose its reply (the store then raises AmbiguousWriteError
    after writing, and resolves it as it resolves a real one).
    """

    _faults: deque[Fault]

    def inject_fault(self, fault: Fault) -> None:
        """Make the next append meet `fault` (see Fault)."""
        self._pending_faults().append(fault)

    def _pending_faults(self) -> deque[Fault]:
        try:
            return self._faults
        except AttributeError:
            self._faults = deque()
            return self._faults

    def _next_fault(self, stream: str) -> bool:
        """Consume the next injected fault: raise for UNAVAILABLE; True for LOST_REPLY."""
        # Read without _pending_faults: every append of every store asks, nearly always
        # of a store that never had a fault injected.
        faults: deque[Fault] | None = getattr(self, "_faults", None)
        if not faults:
            return False
        fault = faults.popleft()
        if fault is Fault.UNAVAILABLE:
            raise StoreUnavailableError(
                f"{type(self).__name__}: injected fault before appending to {stream!r}"
            )
        return fault is Fault.LOST_REPLY
