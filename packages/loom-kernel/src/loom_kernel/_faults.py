"""Fault-injection seam a store may expose so the conformance kit can drive its failure paths."""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

__all__ = ["Fault", "SupportsFaultInjection"]


class Fault(enum.Enum):
    """A transport fault to inject into a store's next append."""

    #: The write reaches the backend and lands, but its reply is lost: the store sees
    #: an ambiguous failure and must find out itself whether its write landed.
    LOST_REPLY = "lost_reply"
    #: The backend refuses the request before writing anything (a transient fault):
    #: the store raises StoreUnavailableError and nothing lands.
    UNAVAILABLE = "unavailable"


@runtime_checkable
class SupportsFaultInjection(Protocol):
    """A store that can fail its next append on purpose, for the conformance kit."""

    def inject_fault(self, fault: Fault) -> None:
        """Make the next append meet `fault` (one fault per call, consumed in order)."""
