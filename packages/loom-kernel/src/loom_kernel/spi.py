"""The storage SPI: what a store author needs (docs/spi.md is the contract).

    from loom_kernel.spi import JournalStore, NewRecord, Record

Subclass `JournalStore`, translate your backend's failures into the errors below, and
prove the store with the conformance kit in `loom_kernel.testing`.
"""

from loom_kernel._core._errors import (
    ConflictError,
    InvalidArgumentError,
    InvalidIdError,
    LoomError,
    SchemaError,
    StoreMisconfiguredError,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
)
from loom_kernel._core._ids import ID_ALPHABET, MAX_ID_LENGTH, validate_prefix, validate_stream_id
from loom_kernel._core._records import MAX_KIND_LENGTH, NewRecord, Record
from loom_kernel._spi._blob_collection import BlobsCollected, collect_blobs
from loom_kernel._spi._blobs import (
    DEFAULT_BLOB_THRESHOLD,
    BlobNotFoundError,
    BlobStore,
    MemoryBlobs,
    validate_blob_key,
)
from loom_kernel._spi._faults import (
    AmbiguousWriteError,
    Fault,
    FaultInjection,
    SupportsFaultInjection,
)
from loom_kernel._spi._fsspec_blobs import FsspecBlobs
from loom_kernel._spi._group_commit import GroupCommit, PendingAppend, SyncedOrNot
from loom_kernel._spi._journal import JournalStore
from loom_kernel._spi._registry import (
    ENTRY_POINT_GROUP,
    OpenStore,
    StoreFactory,
    installed_stores,
    register_store,
)
from loom_kernel._spi._wakes import WAKE_PREFIXES, SupportsWakeups

__all__ = [
    "DEFAULT_BLOB_THRESHOLD",
    "ENTRY_POINT_GROUP",
    "ID_ALPHABET",
    "MAX_ID_LENGTH",
    "MAX_KIND_LENGTH",
    "WAKE_PREFIXES",
    "AmbiguousWriteError",
    "BlobNotFoundError",
    "BlobStore",
    "BlobsCollected",
    "ConflictError",
    "Fault",
    "FaultInjection",
    "FsspecBlobs",
    "GroupCommit",
    "InvalidArgumentError",
    "InvalidIdError",
    "JournalStore",
    "LoomError",
    "MemoryBlobs",
    "NewRecord",
    "OpenStore",
    "PendingAppend",
    "Record",
    "SchemaError",
    "StoreFactory",
    "StoreMisconfiguredError",
    "StoreUnavailableError",
    "StreamDeletedError",
    "SupportsFaultInjection",
    "SupportsWakeups",
    "SyncedOrNot",
    "TrimmedError",
    "collect_blobs",
    "installed_stores",
    "register_store",
    "validate_blob_key",
    "validate_prefix",
    "validate_stream_id",
]
