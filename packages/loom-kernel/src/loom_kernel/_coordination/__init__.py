"""The coordination streams: everything the runtime keeps on the journal SPI besides a
run's own journal (the run index, queues, due timers, leases and heartbeats, inboxes,
published values, snapshots), each a fold over streams of its own. It imports the
core, the SPI and the replay layer's gate names.
"""

from loom_kernel._coordination._deletion import delete_ended, finish_deletion
from loom_kernel._coordination._executions import (
    SNAPSHOT_KIND,
    compact,
    execution_ids,
    load,
    snapshot,
)
from loom_kernel._coordination._inbox import Inbox
from loom_kernel._coordination._leases import (
    DEFAULT_LEASE,
    MAX_LEASE,
    WORKERS_PREFIX,
    Heartbeat,
    abandoned_here,
    default_worker_id,
    driving_here,
    earlier_process_exited,
    exited_here,
    last_record,
    sighting,
)
from loom_kernel._coordination._published import Published
from loom_kernel._coordination._queue_book import QueueBook
from loom_kernel._coordination._queues import Queue, QueueFold, QueueView, pick, rate_frees_at
from loom_kernel._coordination._run_index import (
    ENDED,
    Closing,
    EndedEntry,
    OpenHint,
    RunIndex,
    partition_of,
)
from loom_kernel._coordination._streams import first_timestamp
from loom_kernel._coordination._timer_floor import FLOOR_KIND, FLOOR_STREAM
from loom_kernel._coordination._timers import OVERDUE, QUARANTINE, SEAL_KIND, TimerEntry, TimerIndex

__all__ = [
    "DEFAULT_LEASE",
    "ENDED",
    "FLOOR_KIND",
    "FLOOR_STREAM",
    "MAX_LEASE",
    "OVERDUE",
    "QUARANTINE",
    "SEAL_KIND",
    "SNAPSHOT_KIND",
    "WORKERS_PREFIX",
    "Closing",
    "EndedEntry",
    "Heartbeat",
    "Inbox",
    "OpenHint",
    "Published",
    "Queue",
    "QueueBook",
    "QueueFold",
    "QueueView",
    "RunIndex",
    "TimerEntry",
    "TimerIndex",
    "abandoned_here",
    "compact",
    "default_worker_id",
    "delete_ended",
    "driving_here",
    "earlier_process_exited",
    "execution_ids",
    "exited_here",
    "finish_deletion",
    "first_timestamp",
    "last_record",
    "load",
    "partition_of",
    "pick",
    "rate_frees_at",
    "sighting",
    "snapshot",
]
