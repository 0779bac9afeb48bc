"""The conformance kit: prove a journal store keeps the contract of docs/spi.md.

The kit needs the `testing` extra (`pip install loom-kernel[testing]`: hypothesis
and pytest); `FakeClock`, `sandbox` and the store harness need nothing more than the
kernel. In a store's test suite::

    from loom_kernel.testing import StoreContract

    class TestMyStore(StoreContract):
        def make_store(self):
            return MyStore(...)

That runs every example check, the racing-writers check, the fault-injection
checks (for stores that support them) and the stateful comparison against the
memory model. `verify_store` runs the same kit outside pytest and returns what failed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from loom_kernel._core import LoomError
from loom_kernel._spi._clock import FakeClock
from loom_kernel._spi._faults import Fault, SupportsFaultInjection
from loom_kernel.testing._checks import BAD_IDS, CHECKS, records
from loom_kernel.testing._harness import NotApplicable, StoreHarness
from loom_kernel.testing._interleave import Interleaving
from loom_kernel.testing._sandbox import Sandbox, sandbox

if TYPE_CHECKING:
    from loom_kernel.testing._contract import KitReport, StoreContract, verify_store
    from loom_kernel.testing._machine import DEFAULT_SETTINGS, run_store_machine, store_machine

#: The names that need the `testing` extra, by the module that holds them.
_OF_THE_EXTRA = {
    "KitReport": "_contract",
    "StoreContract": "_contract",
    "verify_store": "_contract",
    "DEFAULT_SETTINGS": "_machine",
    "run_store_machine": "_machine",
    "store_machine": "_machine",
}


class _MissingExtraError(LoomError, ImportError):
    """A part of the conformance kit was imported without the `testing` extra."""


def __getattr__(name: str) -> Any:
    module = _OF_THE_EXTRA.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        loaded = importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as exc:
        if exc.name not in ("hypothesis", "pytest"):
            raise
        raise _MissingExtraError(
            f"loom_kernel.testing.{name} needs the 'testing' extra ({exc.name} is not "
            f"installed): pip install 'loom-kernel[testing]'"
        ) from exc
    value = getattr(loaded, name)
    globals()[name] = value
    return value


__all__ = [
    "BAD_IDS",
    "CHECKS",
    "DEFAULT_SETTINGS",
    "FakeClock",
    "Fault",
    "Interleaving",
    "KitReport",
    "NotApplicable",
    "Sandbox",
    "StoreContract",
    "StoreHarness",
    "SupportsFaultInjection",
    "records",
    "run_store_machine",
    "sandbox",
    "store_machine",
    "verify_store",
]
