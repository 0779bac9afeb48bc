"""The conformance kit: prove a journal store keeps the contract of docs/spi.md.

Needs the `testing` extra (hypothesis and pytest). In a store's test suite::

    from loom_kernel.testing import StoreContract

    class TestMyStore(StoreContract):
        def make_store(self):
            return MyStore(...)

That runs every example check, the racing-writers check, the fault-injection
checks (for stores that support them) and the stateful comparison against the
memory model. `verify_store` runs the same kit outside pytest and returns what failed.
"""

from loom_kernel._spi._clock import FakeClock
from loom_kernel._spi._faults import Fault, SupportsFaultInjection
from loom_kernel.testing._checks import BAD_IDS, CHECKS, records
from loom_kernel.testing._contract import KitReport, StoreContract, verify_store
from loom_kernel.testing._harness import NotApplicable, StoreHarness
from loom_kernel.testing._interleave import Interleaving
from loom_kernel.testing._machine import DEFAULT_SETTINGS, run_store_machine, store_machine
from loom_kernel.testing._sandbox import Sandbox, sandbox

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
