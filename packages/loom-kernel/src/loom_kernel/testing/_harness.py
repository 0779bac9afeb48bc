"""How the conformance kit gets stores from their author."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from loom_kernel._journal import JournalStore

__all__ = ["StoreHarness"]


@attrs.frozen
class StoreHarness:
    """What the kit needs to exercise a store.

    Attributes:
        open: returns a new, empty store each call.
        reopen: closes the given store and returns a new instance over the same data,
            to prove that what was written survives; None where the store cannot be
            reopened (a purely in-process store).
        name: how reports name the store.
    """

    open: Callable[[], JournalStore]
    reopen: Callable[[JournalStore], JournalStore] | None = None
    name: str = "store"
