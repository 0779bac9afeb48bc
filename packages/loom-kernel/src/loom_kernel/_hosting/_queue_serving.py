"""How a worker serves its engine's queues: admit runs as the free slots and each
queue's limits allow (a take at the partition's exact head, so two workers never
admit past a limit), say when a run is done, give back the admissions of runs their
taker no longer drives, and mend a partition that holds a damaged record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Final

from loom_kernel._coordination import (
    Queue,
    QueueFold,
    earlier_process_exited,
    exited_here,
    pick,
    rate_frees_at,
)
from loom_kernel._core import ConflictError, LoomError, SchemaError
from loom_kernel._engine import EngineParts, QueuedDrive
from loom_kernel._hosting._slots import Slots, Task, WorkerStats
from loom_kernel._replay import Drive

__all__ = ["QueueServing"]

logger = logging.getLogger("loom")

#: Takes one poll tries on a queue partition that other workers keep moving.
_TAKE_ATTEMPTS: Final = 4

#: The admissions this process made that are not done yet: (worker id, partition
#: stream, position of the take). An admission by a worker id of this process that is
#: not here was made by another process under the same id: an earlier one, whose
#: places are given back at once when its beats show it exited on this machine (else
#: after half a lease, as any worker's: two live processes under one id must not
#: each take what the other holds).
_admitted_here: set[tuple[str, str, int]] = set()
_admitted_lock = threading.Lock()


class QueueServing:
    """Serves the queues one worker admits runs from."""

    def __init__(
        self,
        parts: EngineParts,
        names: list[str],
        *,
        slots: Slots,
        stats: WorkerStats,
        stopping: threading.Event,
        beat: Callable[[], None],
    ) -> None:
        self._parts = parts
        self._book = parts.enqueueing.book
        self.names = names
        self._slots = slots
        self._stats = stats
        self._stopping = stopping
        self._beat = beat
        self._turn = 0  # which queue, and partition of each, a poll serves first
        self._due: float | None = None  # monotonic: when a rate's window next has room
        # Partitions where this worker's id holds no place an earlier process took.
        self._no_earlier: set[tuple[str, int]] = set()
        self._warned_shared_id = False

    def serve(self, *, sweep: bool) -> int:
        """Admit from each queue's partitions as many runs as the free slots and the
        queue's limits allow, and hand them to the slots; how many were handed. On a
        sweep, first give back the admissions of runs their taker no longer drives."""
        handed = 0
        self._due = None
        self._turn += 1
        names = self.names
        for offset in range(len(names)):  # each queue is served first in turn
            name = names[(self._turn + offset) % len(names)]
            queue = self._book.queues[name]
            count = queue.partitions
            for partition in [(self._turn + offset) % count for offset in range(count)]:
                try:
                    handed += self._serve_partition(queue, partition, sweep=sweep)
                except SchemaError as exc:
                    self._stats.failures += 1
                    logger.warning("loom: queue %s/%d: %s", name, partition, exc)
                    if exc.stream == self._book.stream(name, partition):
                        self._mend(name, partition)
                except LoomError as exc:
                    self._stats.failures += 1
                    logger.warning("loom: queue %s/%d: %s", name, partition, exc)
        return handed

    def until_due(self) -> float:
        """Seconds until a rate's window that held back runs this pass has room again
        (the next poll then admits them, not at its idle pace); infinity for none."""
        due = self._due
        return float("inf") if due is None else max(0.0, due - time.monotonic())

    def _mend(self, name: str, partition: int) -> None:
        """Rewrite a queue partition that holds a damaged record."""
        try:
            self._book.rewrite(name, partition)
        except LoomError as exc:
            logger.warning("loom: queue %s/%d not mended: %s", name, partition, exc)

    def _serve_partition(self, queue: Queue, partition: int, *, sweep: bool) -> int:
        if sweep or (queue.name, partition) not in self._no_earlier:
            fold = self._book.read(queue.name, partition)
            exited = self._held_before(fold) and self._earlier_exited()
            if sweep:
                self._reap(queue, partition, fold, earlier_exited=exited)
            elif exited:
                # Places this worker's id holds from an earlier process, which exited:
                # given back at once (one a visit of its run holds here now is left to
                # the next poll).
                self._reap(queue, partition, fold, only_earlier=True, earlier_exited=True)
            if not self._held_before(self._book.read(queue.name, partition)):
                self._no_earlier.add((queue.name, partition))  # none can come later
        admitted = self._admit(queue, partition, self._slots.free())
        for task in admitted:
            if not self._slots.submit(task, queue=True):  # a visit of it is in flight
                assert task.let_go is not None
                task.let_go()
        return len(admitted)

    def _admit(self, queue: Queue, partition: int, free: int) -> list[Task]:
        """Admit as many runs as `free` slots and the limits allow, with a take at the
        partition's exact head (folding it again when another process moved it); the
        tasks that drive them."""
        driver = self._parts.driver
        book = self._book
        me = driver.worker_id
        with book.holding(queue.name, partition):
            for _ in range(_TAKE_ATTEMPTS):
                if free <= 0 or self._stopping.is_set():
                    return []
                fold = book.refresh(queue.name, partition)
                cap, rate = queue.share(partition)
                now = driver.clock()
                chosen = pick(
                    fold,
                    cap=cap,
                    per_key=queue.per_key,
                    rate=rate,
                    now=now,
                    free=free,
                    hosts=driver.flows.hosts_code,
                    busy=self._slots.busy_with,
                    me=me,
                    present_since=now - driver.lease / 3,
                )
                if len(chosen) < free and fold.waiting:
                    self._note_rate(fold, rate, now)
                if not chosen:
                    self._say_present(queue, partition, fold, now)
                    return []
                try:
                    take = book.take(queue.name, partition, fold, chosen, driver.worker_id)
                except ConflictError:  # another process admitted or added: fold again
                    continue
                with _admitted_lock:
                    _admitted_here.add((driver.worker_id, fold.stream, take))
                return [self._queued_task(queue, partition, run, take) for run in chosen]
        return []

    def _note_rate(self, fold: QueueFold, rate: Any, now: float) -> None:
        """Runs wait that the rate's window held back: the next poll comes when it has
        room again (by the takers' clocks, which the window keeps)."""
        frees_at = rate_frees_at(fold, rate, now)
        if frees_at is not None:
            due = time.monotonic() + max(0.0, frees_at - now)
            self._due = due if self._due is None else min(self._due, due)

    def _say_present(self, queue: Queue, partition: int, fold: QueueFold, now: float) -> None:
        """This worker has free slots and was given no run from a partition where runs
        wait that it could drive (held back by the cap or its share): say so with a
        take of no run, at most every sixth of a lease, so the workers that hold the
        runs leave it its share (see `pick`). A worker without the code of any run
        waiting says nothing: it would only shrink the others' shares."""
        driver = self._parts.driver
        me = driver.worker_id
        hosts = driver.flows.hosts_code
        if not any(hosts(item.flow, item.code) for item in fold.waiting.values()):
            return  # nothing waits that it could drive: it shares nothing, and is not counted
        if fold.pollers.get(me, float("-inf")) > now - driver.lease / 6:
            return
        try:
            self._book.take(queue.name, partition, fold, [], me)
        except LoomError as exc:  # another writer moved first: the next poll says it
            logger.debug("loom: queue %s/%d: %s", queue.name, partition, exc)

    def _queued_task(self, queue: Queue, partition: int, execution_id: str, take: int) -> Task:
        drive = partial(self._drive_queued, queue, partition, execution_id, take)
        let_go = partial(self._let_go, queue.name, partition, execution_id, take)
        return Task(execution_id, drive, let_go, since=time.monotonic())

    def _drive_queued(
        self, queue: Queue, partition: int, execution_id: str, take: int
    ) -> Drive[None]:
        """Drive a run this worker admitted, then say it is done: waiting again if it
        is still running (let go at a stop, or its claim met a live owner or a passing
        fault). A drive that raised (a divergence, a store fault mid-drive) is done
        too; if the run is left running, a sweep puts it back on the queue half a
        lease after its last record, so a failing run is retried at that pace."""
        outcome = None
        try:
            outcome = yield from self._parts.enqueueing.drive_queued(execution_id)
            if outcome is QueuedDrive.LEFT_RUNNING:
                self._beat()  # says it no longer drives the run: the next taker claims it
        finally:
            self._stats.visited += 1
            requeue = outcome in (QueuedDrive.LEFT_RUNNING, QueuedDrive.NOT_NOW)
            unused = outcome in (QueuedDrive.NOT_NOW, QueuedDrive.VOID)
            self._finish(queue, partition, execution_id, take, requeue=requeue, unused=unused)
            self._forget_admission(queue.name, partition, take)

    def _finish(
        self,
        queue: Queue,
        partition: int,
        execution_id: str,
        take: int,
        *,
        requeue: bool,
        unused: bool,
    ) -> None:
        """Say a run this slot drove is done, then admit the next run for this slot
        when the limits allow, rather than leave the slot to the next poll; the slot's
        thread drives it next. The next run comes from the worker's queues in turn,
        starting after this one (a busy queue would keep every slot otherwise); a
        queue of several partitions is left to the polls, which serve its partitions
        in turn, for the same reason."""
        book = self._book
        done = book.done_record(execution_id, take, requeue=requeue, unused=unused)
        # Found work (a due timer, say) waits for the slot, or the run may need it
        # again at once.
        chain = not (requeue or self._slots.backlog_waits())
        try:
            with book.holding(queue.name, partition):
                book.append_at(queue.name, partition, book.refresh(queue.name, partition), [done])
        except LoomError as exc:  # another process moved it: the done wherever the head is
            logger.debug("loom: queue %s/%d: %s", queue.name, partition, exc)
            self._give_back(
                queue.name, partition, execution_id, take, requeue=requeue, unused=unused
            )
            self._slots.wake()  # the next poll admits for the free slots at once
            return
        try:
            admitted = self._admit_next(queue) if chain else []
        except LoomError as exc:  # a damaged partition, say: the polls say it and mend it
            logger.debug("loom: admitting after %s: %s", execution_id, exc)
            self._slots.wake()
            return
        if chain and not admitted:
            self._slots.wake()  # held back (a rate, a share): the poll knows until when
        self._slots.next_up(admitted)  # taken next by this slot's thread

    def _admit_next(self, after: Queue) -> list[Task]:
        """Admit one run for a slot that has just finished a run of `after`: from the
        first of the worker's queues, in turn from the one after it, that has one to
        admit (queues of several partitions are left to the polls)."""
        names = self.names
        start = names.index(after.name)
        for offset in range(1, len(names) + 1):
            queue = self._book.queues[names[(start + offset) % len(names)]]
            if queue.partitions == 1:
                admitted = self._admit(queue, 0, 1)
                if admitted:
                    return admitted
        return []

    def _let_go(self, name: str, partition: int, execution_id: str, take: int) -> None:
        """Give back the admission of a run this worker will not drive after all."""
        self._give_back(name, partition, execution_id, take, requeue=True, unused=True)
        self._forget_admission(name, partition, take)

    def _forget_admission(self, name: str, partition: int, take: int) -> None:
        """A take of this process whose runs are all done (or given back)."""
        stream = self._book.stream(name, partition)
        with _admitted_lock:
            _admitted_here.discard((self._parts.driver.worker_id, stream, take))

    def _give_back(
        self,
        name: str,
        partition: int,
        execution_id: str,
        take: int,
        *,
        requeue: bool,
        unused: bool = False,
    ) -> None:
        try:
            self._book.done(name, partition, execution_id, take, requeue=requeue, unused=unused)
        except LoomError as exc:  # a sweep's reaping gives the admission back
            self._stats.failures += 1
            logger.warning("loom: %s: its queue's done record: %s", execution_id, exc)

    def _earlier_exited(self) -> bool:
        """Whether the other process that last beat under this worker's id exited (a
        restart on this machine); warned of, once, when it may be alive."""
        driver = self._parts.driver
        if earlier_process_exited(driver.store, driver.worker_id):
            return True
        if not self._warned_shared_id:
            self._warned_shared_id = True
            logger.warning(
                "loom: queue places held under worker id %s by another process, which may "
                "be alive: given back only after half a lease (ids must be unique among "
                "live processes)",
                driver.worker_id,
            )
        return False

    def _held_before(self, fold: QueueFold) -> bool:
        """Whether the partition holds an admission by this worker's id that this
        process did not make (an earlier process under the same id made it)."""
        me = self._parts.driver.worker_id
        with _admitted_lock:
            return any(
                active.by == me and (me, fold.stream, active.take) not in _admitted_here
                for active in fold.active.values()
            )

    def _reap(
        self,
        queue: Queue,
        partition: int,
        fold: QueueFold,
        *,
        only_earlier: bool = False,
        earlier_exited: bool = False,
    ) -> bool:
        """Give back the admissions, older than half a lease, of runs their taker no
        longer drives (it crashed, stopped, or never claimed them), and, when
        `earlier_exited`, those an earlier process of this worker's id made, whatever
        their age; with `only_earlier`, only the latter. Whether any was given back."""
        driver = self._parts.driver
        horizon = driver.clock() - driver.lease / 2
        reaped = False
        me = driver.worker_id
        for execution_id, active in fold.active.items():
            # Its taker has had half a lease to claim it, by the clocks; or its taker
            # is a process of this machine that has exited, whatever the clocks say;
            # or it is this worker's id, under which an earlier process took it.
            if active.by == me and self._slots.busy_with(execution_id):
                continue
            if only_earlier and active.by != me:
                continue
            if active.at > horizon and not exited_here(active.by):
                if active.by != me or not earlier_exited:
                    continue
                with _admitted_lock:
                    if (me, fold.stream, active.take) in _admitted_here:
                        continue
            try:
                requeue = self._parts.enqueueing.queued_stale(execution_id, active.by)
            except SchemaError as exc:  # a run that cannot be read holds no place
                logger.warning("loom: %s: admitted, and cannot be read: %s", execution_id, exc)
                requeue = False
            except LoomError as exc:  # a passing fault: the next sweep looks again
                logger.warning("loom: %s: %s: %s", execution_id, type(exc).__name__, exc)
                continue
            if requeue is not None:
                logger.info("loom: %s: admitted by %s, no longer driven", execution_id, active.by)
                self._give_back(queue.name, partition, execution_id, active.take, requeue=requeue)
                reaped = True
        return reaped
