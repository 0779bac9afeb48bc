"""How a worker finds the runs to visit: the open runs of the run index.

A run not seen open before (one `enqueue` started, a start whose process died) is
visited at once; every open run is visited again on a sweep, every half lease, so a
run whose owner stopped is taken over within about one and a half leases. A visit is
`Recovery.recover_hint`: the run is claimed at the journal's exact head (one worker
wins) and driven until it parks or ends.
"""

from __future__ import annotations

import logging
import threading
from functools import partial
from typing import Final

from loom_kernel._coordination import OpenHint, driving_here, partition_of
from loom_kernel._core import LoomError, SchemaError
from loom_kernel._engine import NOT_STARTED, EngineParts
from loom_kernel._hosting._slots import Slots, Task, WorkerStats
from loom_kernel._replay import Drive

__all__ = ["OpenRunVisits"]

logger = logging.getLogger("loom")

#: How many polls in a row look again at a run whose start had not landed; after
#: that its writer may be gone, and the sweeps look at it (and drop its hint).
_NOT_STARTED_LOOKS: Final = 5


class OpenRunVisits:
    """The visits one worker makes to the runs the index holds open."""

    def __init__(self, parts: EngineParts, slots: Slots, stats: WorkerStats) -> None:
        self._parts = parts
        self._slots = slots
        self._stats = stats
        self._lock = threading.Lock()
        # partition -> the open hints seen in it (a run let go is hinted afresh)
        self._known: dict[str, set[OpenHint]] = {}
        # runs whose hint was visited before their start landed -> times looked at
        self._not_started: dict[str, int] = {}
        self._heads: dict[str, int] = {}  # partition -> its head when last read
        self.repair = False  # an index partition could not be read: recover() rewrites it

    def visit_open(self, *, sweep: bool) -> int:
        """Hand the open runs to visit to the slots; how many were handed over.

        Between sweeps only runs not seen open before are visited, and on a store whose
        heads cost nothing a partition is read only when its head moved since it was
        last read. A partition that cannot be read (a damaged index record) does not
        stop the others; the next sweep has `recover()` rewrite the index.
        """
        driver = self._parts.driver
        runs = driver.runs
        handed = 0
        for run in self._slots.looks_asked():
            partition = partition_of(run)
            known = self._known.get(partition, set())
            known -= {hint for hint in known if hint.execution_id == run}
            self._heads.pop(partition, None)
        for partition in runs.partitions():
            try:
                if not sweep and self._unchanged(partition):
                    continue
                head, hints = runs.open_in(partition)
            except SchemaError as exc:
                self._stats.failures += 1
                self.repair = True
                logger.warning("loom: run index partition %s: %s", partition, exc)
                continue
            except LoomError as exc:
                self._stats.failures += 1
                logger.warning("loom: run index partition %s: %s", partition, exc)
                continue
            known = self._known.setdefault(partition, set())
            known &= set(hints)
            deferred = False
            for hint in hints:
                if not sweep and hint in known:
                    continue
                if not sweep and hint.queue is not None:
                    known.add(hint)  # its queue's add is how it is found; sweeps look too
                    continue
                if driving_here(driver.worker_id, hint.execution_id):
                    # This engine drives it inline, or is still writing its start
                    # (an enqueue): not seen yet, and the partition is read again.
                    deferred = True
                    continue
                fresh = hint not in known  # a sweep's look at a known hint is no news
                known.add(hint)
                task = Task(hint.execution_id, partial(self._visit, hint))
                if self._slots.submit(task, queue=True, look_again=fresh):
                    handed += 1
            if deferred:
                self._heads.pop(partition, None)
            else:
                self._heads[partition] = head
        return handed

    def indexed(self) -> bool:
        """Whether the store's runs are all indexed (else `repair_index` makes it so)."""
        try:
            return self._parts.driver.runs.built()
        except LoomError as exc:
            logger.warning("loom: the run index marker: %s: %s", type(exc).__name__, exc)
            return True  # looked at again at the next sweep

    def repair_index(self) -> None:
        """Have `recover()` rewrite the run index from the journals (a store written
        before the index, or a damaged index record)."""
        self.repair = False
        logger.info("loom: indexing runs from the journals (recover)")
        try:
            self._parts.recovery.recover()
        except LoomError as exc:
            self._stats.failures += 1
            logger.warning("loom: recover: %s: %s", type(exc).__name__, exc)

    def _unchanged(self, partition: str) -> bool:
        """Whether a partition surely holds nothing new since it was last read."""
        driver = self._parts.driver
        return driver.store.head_is_cheap and driver.runs.head(partition) == self._heads.get(
            partition
        )

    def _visit(self, hint: OpenHint) -> Drive[None]:
        try:
            outcome = yield from self._parts.recovery.recover_hint(hint)
            if outcome is NOT_STARTED:
                self._look_again(hint.execution_id)
                return
            with self._lock:
                self._not_started.pop(hint.execution_id, None)
        finally:
            self._stats.visited += 1

    def _look_again(self, execution_id: str) -> None:
        """A run whose hint was read before its start landed (another process's
        `enqueue` between its two writes): the next few polls look at it again,
        instead of the next sweep."""
        with self._lock:
            looks = self._not_started.get(execution_id, 0) + 1
            if looks > _NOT_STARTED_LOOKS:
                self._not_started.pop(execution_id, None)
                return  # its writer may be gone: the sweeps look at it from now on
            self._not_started[execution_id] = looks
        # Queued for the next poll only once its visit is no longer in flight (when
        # its task ends), or that poll could find it in flight and skip it.
        self._slots.look_again(execution_id)
