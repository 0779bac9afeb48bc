"""How the conformance kit gets stores from their author."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from loom_kernel._spi._journal import JournalStore

__all__ = ["NotApplicable", "StoreHarness"]


class NotApplicable(Exception):  # noqa: N818 - a verdict, not an error
    """A check that cannot apply to a store (no fault-injection seam, no reopen...).

    The kit reports it as not applicable, never as passed.
    """


@attrs.frozen
class StoreHarness:
    """What the kit needs to exercise a store.

    Attributes:
        open: returns a new, empty store each call.
        reopen: closes the given store and returns a new instance over the same data,
            to prove that what was written survives; None where the store cannot be
            reopened (a purely in-process store).
        twin: returns a second, open instance over the same data as the given store
            (what another process would open), to prove that the contract holds
            between instances, not only within one; None where there can be only one.
        name: how reports name the store.
    """

    open: Callable[[], JournalStore]
    reopen: Callable[[JournalStore], JournalStore] | None = None
    twin: Callable[[JournalStore], JournalStore] | None = None
    name: str = "store"
