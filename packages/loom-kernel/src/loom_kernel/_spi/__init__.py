"""The storage SPI and what the kernel is given from outside: `JournalStore` (the
checked operations a store implements), the fault-injection seam, the `memory://`
reference store, stores by URL scheme, blobs, group commit, wake-ups, and the fake
clock. It imports only the
core.
"""

from loom_kernel._spi._blob_collection import BlobsCollected, collect_blobs
from loom_kernel._spi._clock import FakeClock
from loom_kernel._spi._faults import AmbiguousWriteError
from loom_kernel._spi._journal import APPENDS, JournalStore
from loom_kernel._spi._registry import installed_stores, open_store, store_factory
from loom_kernel._spi._wakes import SupportsWakeups

__all__ = [
    "APPENDS",
    "AmbiguousWriteError",
    "BlobsCollected",
    "FakeClock",
    "JournalStore",
    "SupportsWakeups",
    "collect_blobs",
    "installed_stores",
    "open_store",
    "store_factory",
]
