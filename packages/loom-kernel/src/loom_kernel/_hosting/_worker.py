"""The worker: fires due timers and drives the runs no one else is driving.

A worker polls two indexes kept on the journal: the timer buckets, and the run index
(the runs still open, by partition). A run it has not seen open before (one
`enqueue` started, a start whose process died) is visited at once; every open run is
visited again on a sweep, every half lease, so a run whose owner stopped is taken over
within about one and a half leases. A visit is `Engine.recover_open`: the run is
claimed at the journal's exact head (one worker wins) and driven until it parks or
ends. At most `concurrency` runs are driven at once. A sync flow's drive holds a
thread of the worker's pool; an async flow's begins there and goes on on the worker's
one event loop (`drive_on_loop`): its code runs as a task, its journal writes and sync
step functions are made on the pool one after another (so the loop never waits on a
disk), and it holds no thread while its code awaits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING, Any, Final, TextIO

import attrs

from loom_kernel._coordination._leases import driving_here, exited_here
from loom_kernel._coordination._queues import Queue, QueueFold, pick
from loom_kernel._coordination._run_index import OpenHint, partition_of
from loom_kernel._coordination._timers import TimerEntry
from loom_kernel._core._errors import (
    ConflictError,
    ExecutionNotFoundError,
    InvalidArgumentError,
    LoomError,
    SchemaError,
)
from loom_kernel._core._numbers import finite_number
from loom_kernel._core._state import Status
from loom_kernel._engine._facade import NOT_STARTED, QueuedDrive
from loom_kernel._replay._context import RELEASE
from loom_kernel._replay._driving import Drive, FlowPass, drive_here, drive_on_loop
from loom_kernel._replay._servant import FLOW_LOOP, LoopStoppedError, LoopThread, Outcome

if TYPE_CHECKING:
    from loom_kernel._engine._facade import Engine

__all__ = ["Worker", "WorkerStats"]

logger = logging.getLogger("loom")

#: Seconds between polls at the busiest: on a store whose heads cost nothing, and on
#: one where each costs a request (an S3 poll is some 24 LISTs).
_FASTEST_POLL: Final = 0.05
_FASTEST_POLL_COSTLY: Final = 1.0
#: The longest idle poll by default: a store whose heads cost a request (S3) is polled
#: less often when there is nothing to do (see docs/running.md for what it costs).
_IDLE_POLL_CHEAP: Final = 1.0
_IDLE_POLL_COSTLY: Final = 60.0
_STATUS_EVERY: Final = 1.0
#: How many polls in a row look again at a run whose start had not landed; after
#: that its writer may be gone, and the sweeps look at it (and drop its hint).
_NOT_STARTED_LOOKS: Final = 5
#: Runs `enqueue` hands to a worker whose slots are all busy wait in its own queue,
#: held as this engine's, at most this many per slot and for at most this long; then
#: they are let go for any worker to take.
_HANDED_PER_SLOT: Final = 16
_HANDED_WAIT: Final = 1.0
#: Takes one poll tries on a queue partition that other workers keep moving.
_TAKE_ATTEMPTS: Final = 4


@attrs.frozen
class _Task:
    """Work on one run: a visit, a timer's wake, the drive of a run `enqueue` handed
    over, or of a run admitted from a queue (with `let_go`, which gives up the hold on
    it if it is not driven, and, for a handed run, its flow, to hint it afresh)."""

    execution_id: str
    run: Callable[[], Drive[object]]
    let_go: Callable[[], None] | None = None
    flow: str = ""
    since: float = 0.0


@attrs.define
class WorkerStats:
    """What a worker has done since it started.

    Attributes:
        visited: open runs it looked at.
        driven: runs it drove (claimed and ran until they parked or ended).
        timers: timers it fired.
        failures: visits or timer firings that raised (each is logged).
        in_flight: runs being driven now.
    """

    visited: int = 0
    driven: int = 0
    timers: int = 0
    failures: int = 0
    in_flight: int = 0


class Worker:
    """Drives a store's work on its own: due timers, enqueued runs, and runs whose
    owner stopped (an expired lease).

    `run()` blocks until `stop()` or a signal; `start()` runs it on a background
    thread of this process (one line beside an application that calls `start`
    inline). Any number of workers, in any number of processes or machines, may
    share a store: every run is claimed at the journal's exact head, so one drives it.

    Args:
        engine: the engine to drive with (its flows, store, worker id and lease).
        concurrency: how many runs it drives at once.
        idle_poll: the longest wait between two polls when there is nothing to do;
            by default 1 s, or 60 s on a store whose reads cost requests (S3). An
            `enqueue` on the same engine wakes it at once.
        grace: on `stop()` (or a first SIGTERM/SIGINT), how long the runs in flight
            may go on to park or end before they are released at their next step.
        queues: the names of the engine's queues whose runs it admits and drives; by
            default all of them (see docs/queues.md).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        concurrency: int = 8,
        idle_poll: float | None = None,
        grace: float = 30.0,
        queues: Iterable[str] | None = None,
    ) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise InvalidArgumentError(f"concurrency is an int of 1 or more, not {concurrency!r}")
        for name, value in (("idle_poll", idle_poll), ("grace", grace)):
            if value is not None and (not finite_number(value) or value < 0):
                raise InvalidArgumentError(f"{name} is a number of seconds >= 0, not {value!r}")
        known = engine._queues.queues
        self.queues = list(known) if queues is None else list(queues)
        for name in self.queues:
            engine._queues.queue(name)  # raises for a queue the engine lacks
        self.engine = engine
        self.concurrency = concurrency
        default = _IDLE_POLL_CHEAP if engine.store.head_is_cheap else _IDLE_POLL_COSTLY
        self.idle_poll = default if idle_poll is None else float(idle_poll)
        self.grace = float(grace)
        self.stats = WorkerStats()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._ready = threading.Event()  # set once run() takes work
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        # partition -> the open hints seen in it (a run let go is hinted afresh)
        self._known: dict[str, set[OpenHint]] = {}
        # runs whose hint was visited before their start landed -> times looked at
        self._not_started: dict[str, int] = {}
        self._look_again_next: set[str] = set()  # runs the next poll looks at again
        # runs to look at again once their task in flight ends (not started, or seen
        # open by a poll while a task of theirs was in flight)
        self._look_again_after: set[str] = set()
        self._heads: dict[str, int] = {}  # partition -> its head when last read
        self._backlog: deque[_Task] = deque()  # work found while every slot was busy
        self._released = threading.Event()  # set once the grace on stop is over
        self._released_runs: list[str] = []  # the runs in flight then
        self._repair = False  # an index partition could not be read: recover() rewrites it
        self._queued: set[str] = set()  # their ids
        self._handed: set[str] = set()  # of those, runs enqueue handed over (or will)
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None  # while it runs
        self._flows: LoopThread | None = None  # where async flows run, while it runs
        self._on_loop = 0  # drives handed to the loop (see `_to_loop`) not ended yet
        self._loop_idle = threading.Event()  # set while that is none
        self._loop_idle.set()
        self._threads_left = False  # threads its async flows started outlived its stop
        self._signals = 0
        self._turn = 0  # which queue, and partition of each, a poll serves first

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> Worker:
        """Run the worker on a daemon thread of this process; returns self once it
        takes work (an `enqueue` right after is handed to its slots)."""
        if self._thread is not None:
            raise InvalidArgumentError("this worker is running already")
        self._thread = threading.Thread(
            target=self.run, kwargs={"handle_signals": False}, name="loom-worker", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        return self

    def stop(self, grace: float | None = None) -> None:
        """Stop taking work, let the runs in flight park or end for up to `grace`
        seconds (the worker's own by default), release the rest at their next step,
        and return once nothing is driven. A released run is taken over at once by
        the next worker that looks (its owner's last beat drops it)."""
        if grace is not None:
            self.grace = float(grace)
        self._stopping.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        elif self._thread is None:
            self._stopped.wait()

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def run(self, *, handle_signals: bool = True, status: TextIO | None = None) -> None:
        """Poll and drive until `stop()` (or, with `handle_signals` on the main thread,
        SIGTERM or SIGINT: the first stops gracefully, a second at once).

        Args:
            handle_signals: install SIGTERM/SIGINT handlers while it runs (only on the
                main thread).
            status: where to print a one-line live status (a terminal), if anywhere.
        """
        try:
            previous = self._install_signals() if handle_signals else {}
        except BaseException:
            self._ready.set()  # start() returns, and finds the worker stopped
            raise
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="loom-drive")
        per_loop = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor's size
        self._flows = LoopThread("loom-flows", self.concurrency * per_loop)
        with self._lock:
            self._pool = pool
        self.engine._local_workers.append(self)
        self._ready.set()
        logger.info(
            "loom: worker %s started (concurrency %d)", self.engine.worker_id, self.concurrency
        )
        try:
            self._poll_until_stopped(pool, status)
            self._let_go_handed(everything=True)  # not held through the grace
            self._wind_down()
        finally:
            self.engine._local_workers.remove(self)
            with self._lock:
                self._pool = None
            # The drives on the loop end (released at their next step) before the pool
            # that makes their calls shuts down, and before the loop closes.
            self._loop_idle.wait()
            pool.shutdown(wait=True)
            self._flows.close()
            try:
                self._let_go_handed(everything=True)
                if self._release_lease():
                    self._nudge_released()
                self._threads_left = not self._flows.join_threads(self.grace)
            finally:  # a second signal exits at once until here
                for number, handler in previous.items():
                    signal.signal(number, handler)
                if status is not None:
                    status.write("\n")
                logger.info("loom: worker %s stopped: %s", self.engine.worker_id, self.stats)
                self._stopped.set()

    # -- polling ----------------------------------------------------------------

    def _poll_until_stopped(self, pool: ThreadPoolExecutor, status: TextIO | None) -> None:
        sweep_every = self.engine.lease / 2
        next_sweep = next_timers = next_repair = 0.0
        fastest = _FASTEST_POLL if self.engine.store.head_is_cheap else _FASTEST_POLL_COSTLY
        fastest = min(fastest, self.idle_poll)
        pause = fastest
        shown = 0.0
        while not self._stopping.is_set():
            now = time.monotonic()
            sweep = now >= next_sweep
            if sweep and not self._repair:
                self._repair = not self._indexed()  # a store from before the run index
            if sweep:
                next_sweep = now + sweep_every
            if self._repair and now >= next_repair:  # at once, then at most once a sweep
                next_repair = now + sweep_every
                self._repair_index()
            self._let_go_handed()
            busy = self._visit_open(pool, sweep=sweep)
            if now >= next_timers:  # at most every `fastest` seconds, however busy
                next_timers = now + fastest
                busy += self._fire_timers(pool)  # due already: before the queues' runs
            busy += self._serve_queues(pool, sweep=sweep)
            if status is not None and now - shown >= _STATUS_EVERY:
                shown = now
                self._show(status)
            pause = fastest if busy else min(max(pause * 2, fastest), self.idle_poll)
            wait = min(pause, max(0.0, next_sweep - time.monotonic()) or pause)
            self._wake.wait(min(wait, max(self._until_let_go(), fastest)))
            self._wake.clear()
            spacing = now + fastest - time.monotonic()  # a wake-up polls no sooner than this
            if spacing > 0:
                self._stopping.wait(spacing)

    # -- queues -----------------------------------------------------------------

    def _serve_queues(self, pool: ThreadPoolExecutor, *, sweep: bool) -> int:
        """Admit from each queue's partitions as many runs as the free slots and the
        queue's limits allow, and hand them to the pool; how many were handed. On a
        sweep, first give back the admissions of runs their taker no longer drives."""
        handed = 0
        self._turn += 1
        names = list(self.queues)
        for offset in range(len(names)):  # each queue is served first in turn
            name = names[(self._turn + offset) % len(names)]
            queue = self.engine._queues.queues[name]
            count = queue.partitions
            for partition in [(self._turn + offset) % count for offset in range(count)]:
                try:
                    handed += self._serve_partition(pool, queue, partition, sweep=sweep)
                except SchemaError as exc:
                    self.stats.failures += 1
                    logger.warning("loom: queue %s/%d: %s", name, partition, exc)
                    if exc.stream == self.engine._queues.stream(name, partition):
                        self._mend(name, partition)
                except LoomError as exc:
                    self.stats.failures += 1
                    logger.warning("loom: queue %s/%d: %s", name, partition, exc)
        return handed

    def _mend(self, name: str, partition: int) -> None:
        """Rewrite a queue partition that holds a damaged record."""
        try:
            self.engine._queues.rewrite(name, partition)
        except LoomError as exc:
            logger.warning("loom: queue %s/%d not mended: %s", name, partition, exc)

    def _serve_partition(
        self, pool: ThreadPoolExecutor, queue: Queue, partition: int, *, sweep: bool
    ) -> int:
        book = self.engine._queues
        if sweep:
            self._reap(queue, partition, book.read(queue.name, partition))
        with self._lock:
            free = self.concurrency - len(self._in_flight) - len(self._backlog)
        admitted = self._admit(queue, partition, free)
        for task in admitted:
            if not self._submit(pool, task, queue=True):  # a visit of it is in flight
                assert task.let_go is not None
                task.let_go()
        return len(admitted)

    def _admit(self, queue: Queue, partition: int, free: int) -> list[_Task]:
        """Admit as many runs as `free` slots and the limits allow, with a take at the
        partition's exact head (folding it again when another process moved it); the
        tasks that drive them."""
        engine = self.engine
        book = engine._queues
        with book.holding(queue.name, partition):
            for _ in range(_TAKE_ATTEMPTS):
                if free <= 0 or self._stopping.is_set():
                    return []
                fold = book.refresh(queue.name, partition)
                cap, rate = queue.share(partition)
                chosen = pick(
                    fold,
                    cap=cap,
                    per_key=queue.per_key,
                    rate=rate,
                    now=engine.clock(),
                    free=free,
                    hosts=engine._hosts_code,
                    busy=self._busy_with,
                )
                if not chosen:
                    return []
                try:
                    take = book.take(queue.name, partition, fold, chosen, engine.worker_id)
                except ConflictError:  # another process admitted or added: fold again
                    continue
                return [self._queued_task(queue, partition, run, take) for run in chosen]
        return []

    def _queued_task(self, queue: Queue, partition: int, execution_id: str, take: int) -> _Task:
        drive = partial(self._drive_queued, queue, partition, execution_id, take)
        let_go = partial(
            self._give_back, queue.name, partition, execution_id, take, requeue=True, unused=True
        )
        return _Task(execution_id, drive, let_go, since=time.monotonic())

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
            outcome = yield from self.engine._drive_queued(execution_id)
            if outcome is QueuedDrive.LEFT_RUNNING:
                self._beat()  # says it no longer drives the run: the next taker claims it
            if outcome in (QueuedDrive.DRIVEN, QueuedDrive.LEFT_RUNNING):
                self.stats.driven += 1
        finally:
            self.stats.visited += 1
            requeue = outcome in (QueuedDrive.LEFT_RUNNING, QueuedDrive.NOT_NOW)
            unused = outcome in (QueuedDrive.NOT_NOW, QueuedDrive.VOID)
            self._finish(queue, partition, execution_id, take, requeue=requeue, unused=unused)

    def _beat(self) -> None:
        try:
            self.engine._heartbeat.beat()
        except LoomError as exc:  # its next beat says it
            logger.warning("loom: a beat letting a run go: %s: %s", type(exc).__name__, exc)

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
        book = self.engine._queues
        done = book.done_record(execution_id, take, requeue=requeue, unused=unused)
        with self._lock:
            # Found work (a due timer, say) waits for the slot, or the run may need it
            # again at once.
            chain = not (requeue or self._backlog)
        try:
            with book.holding(queue.name, partition):
                book.append_at(queue.name, partition, book.refresh(queue.name, partition), [done])
        except LoomError as exc:  # another process moved it: the done wherever the head is
            logger.debug("loom: queue %s/%d: %s", queue.name, partition, exc)
            self._give_back(
                queue.name, partition, execution_id, take, requeue=requeue, unused=unused
            )
            self._wake.set()  # the next poll admits for the free slots at once
            return
        try:
            admitted = self._admit_next(queue) if chain else []
        except LoomError as exc:  # a damaged partition, say: the polls say it and mend it
            logger.debug("loom: admitting after %s: %s", execution_id, exc)
            self._wake.set()
            return
        with self._lock:
            for task in admitted:  # taken next by this slot's thread, in _work
                self._backlog.appendleft(task)
                self._queued.add(task.execution_id)

    def _admit_next(self, after: Queue) -> list[_Task]:
        """Admit one run for a slot that has just finished a run of `after`: from the
        first of the worker's queues, in turn from the one after it, that has one to
        admit (queues of several partitions are left to the polls)."""
        names = list(self.queues)
        start = names.index(after.name)
        for offset in range(1, len(names) + 1):
            queue = self.engine._queues.queues[names[(start + offset) % len(names)]]
            if queue.partitions == 1:
                admitted = self._admit(queue, 0, 1)
                if admitted:
                    return admitted
        return []

    def _busy_with(self, execution_id: str) -> bool:
        """Whether a run is in flight or waiting for a slot here (a visit of it, say)."""
        with self._lock:
            return execution_id in self._in_flight or execution_id in self._queued

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
            self.engine._queues.done(
                name, partition, execution_id, take, requeue=requeue, unused=unused
            )
        except LoomError as exc:  # a sweep's reaping gives the admission back
            self.stats.failures += 1
            logger.warning("loom: %s: its queue's done record: %s", execution_id, exc)

    def _reap(self, queue: Queue, partition: int, fold: QueueFold) -> bool:
        """Give back the admissions, older than half a lease, of runs their taker no
        longer drives (it crashed, stopped, or never claimed them); whether any was."""
        engine = self.engine
        horizon = engine.clock() - engine.lease / 2
        reaped = False
        for execution_id, active in fold.active.items():
            # Its taker has had half a lease to claim it, by the clocks; or its taker
            # is a process of this machine that has exited, whatever the clocks say.
            if active.at > horizon and not exited_here(active.by):
                continue
            if active.by == engine.worker_id and self._busy_with(execution_id):
                continue
            try:
                requeue = engine._queued_stale(execution_id, active.by)
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

    def _fire_timers(self, pool: ThreadPoolExecutor) -> int:
        """Hand the due timers to the pool (the run's drive happens there, counted in
        the concurrency and released on stop); how many were handed over.

        A hint is handled (dropped) on a later poll, once the journal shows the wake.
        """
        engine = self.engine
        now = engine.clock()
        handed = 0

        def wake(entry: TimerEntry) -> bool | None:
            nonlocal handed
            due = engine._timer_state(entry, now)
            if due is not True:
                return due
            task = _Task(entry.execution_id, partial(self._fire, entry, now))
            if self._submit(pool, task, queue=True):  # or the next free slot
                handed += 1
            return None

        _woken, failures = engine.timers.fire_due(now, wake)
        for exc in failures:
            self.stats.failures += 1
            logger.warning("loom: firing timers: %s: %s", type(exc).__name__, exc)
        return handed

    def _fire(self, entry: TimerEntry, now: float) -> Drive[None]:
        if (yield from self.engine._fire(entry, now)):
            self.stats.timers += 1

    def _visit_open(self, pool: ThreadPoolExecutor, *, sweep: bool) -> int:
        """Hand the open runs to visit to the pool; how many were handed over.

        Between sweeps only runs not seen open before are visited, and on a store whose
        heads cost nothing a partition is read only when its head moved since it was
        last read. A partition that cannot be read (a damaged index record) does not
        stop the others; the next sweep has `recover()` rewrite the index.
        """
        runs = self.engine.runs
        handed = 0
        with self._lock:
            again, self._look_again_next = self._look_again_next, set()
        for run in again:
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
                self.stats.failures += 1
                self._repair = True
                logger.warning("loom: run index partition %s: %s", partition, exc)
                continue
            except LoomError as exc:
                self.stats.failures += 1
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
                if driving_here(self.engine.worker_id, hint.execution_id):
                    # This engine drives it inline, or is still writing its start
                    # (an enqueue): not seen yet, and the partition is read again.
                    deferred = True
                    continue
                fresh = hint not in known  # a sweep's look at a known hint is no news
                known.add(hint)
                task = _Task(hint.execution_id, partial(self._visit, hint))
                if self._submit(pool, task, queue=True, look_again=fresh):
                    handed += 1
            if deferred:
                self._heads.pop(partition, None)
            else:
                self._heads[partition] = head
        return handed

    def _indexed(self) -> bool:
        try:
            return self.engine.runs.built()
        except LoomError as exc:
            logger.warning("loom: the run index marker: %s: %s", type(exc).__name__, exc)
            return True  # looked at again at the next sweep

    def _repair_index(self) -> None:
        """Have `recover()` rewrite the run index from the journals (a store written
        before the index, or a damaged index record)."""
        self._repair = False
        logger.info("loom: indexing runs from the journals (recover)")
        try:
            self.engine.recover()
        except LoomError as exc:
            self.stats.failures += 1
            logger.warning("loom: recover: %s: %s", type(exc).__name__, exc)

    def _unchanged(self, partition: str) -> bool:
        """Whether a partition surely holds nothing new since it was last read."""
        return self.engine.store.head_is_cheap and self.engine.runs.head(
            partition
        ) == self._heads.get(partition)

    def _submit(
        self,
        pool: ThreadPoolExecutor,
        task: _Task,
        *,
        queue: bool = False,
        look_again: bool = False,
    ) -> bool:
        """Run `task` on the pool, or (with `queue`) keep it for the next free slot;
        False when its run is in flight or queued already, or every slot is busy.

        With `look_again`, a run in flight is looked at again by the first poll after
        its task ends: the task may have begun before what the poll saw (a handed drive
        that failed before it held the run, say), and left the run open for nobody.
        """
        with self._lock:
            if task.execution_id in self._in_flight:
                if look_again:
                    self._look_again_after.add(task.execution_id)
                return False
            if task.execution_id in self._queued:
                return False
            if len(self._in_flight) >= self.concurrency:
                if not queue:
                    return False
                self._backlog.append(task)
                self._queued.add(task.execution_id)
                return True
            self._in_flight.add(task.execution_id)
            self.stats.in_flight = len(self._in_flight)
        pool.submit(self._work, task)
        return True

    # -- runs handed over by enqueue on this engine --------------------------------

    def _reserve(self, execution_id: str, *, queue: bool) -> bool:
        """Take a slot for a run `enqueue` is about to start, if one is free now (and
        nothing waits for one: found work comes first), or else (with `queue`) a place
        in this worker's queue, if it holds fewer than `_HANDED_PER_SLOT` a slot."""
        with self._lock:
            if (
                self._pool is None
                or self._stopping.is_set()
                or execution_id in self._in_flight
                or execution_id in self._queued
            ):
                return False
            if len(self._in_flight) < self.concurrency and not self._backlog:
                self._in_flight.add(execution_id)
                self.stats.in_flight = len(self._in_flight)
                return True
            if queue and len(self._handed) < self.concurrency * _HANDED_PER_SLOT:
                self._queued.add(execution_id)
                self._handed.add(execution_id)
                return True
            return False

    def _unreserve(self, execution_id: str) -> None:
        """Give back a slot or a place taken by `_reserve` for a run that was not handed
        over; a slot given back takes the next queued task, if any."""
        with self._lock:
            freed = execution_id in self._in_flight
            self._in_flight.discard(execution_id)
            self._queued.discard(execution_id)
            self._handed.discard(execution_id)
            self._look_again_if_asked(execution_id)  # a poll saw it while reserved
            for stale in [t for t in self._backlog if t.execution_id == execution_id]:
                self._backlog.remove(stale)
            pool = self._pool
            task: _Task | None = None
            if freed and pool is not None and self._backlog and not self._stopping.is_set():
                task = self._backlog.popleft()
                self._queued.discard(task.execution_id)
                self._handed.discard(task.execution_id)
                self._in_flight.add(task.execution_id)
            self.stats.in_flight = len(self._in_flight)
        if task is not None:
            assert pool is not None
            try:
                pool.submit(self._work, task)
            except RuntimeError:  # shut down meanwhile: the task is dropped, as at a stop
                with self._lock:
                    self._in_flight.discard(task.execution_id)
                    self.stats.in_flight = len(self._in_flight)
                if task.let_go is not None:
                    task.let_go()
        self._wake.set()

    def _hand(
        self,
        execution_id: str,
        drive: Callable[[], Drive[str]],
        let_go: Callable[[], None],
        flow: str,
    ) -> bool:
        """Drive in the reserved slot (or queue for the next free one) a run `enqueue`
        started as this engine's own; False (the reservation given back) when the
        worker is stopping. A queued run not driven within `_HANDED_WAIT` seconds, or
        left at a stop, is let go (`let_go`) for any worker to take."""

        def run() -> Drive[None]:
            try:
                yield from drive()
                self.stats.driven += 1
            finally:
                self.stats.visited += 1

        with self._lock:
            pool = None if self._stopping.is_set() else self._pool
            if pool is not None and execution_id in self._handed:
                if len(self._in_flight) >= self.concurrency:
                    first = not any(task.let_go for task in self._backlog)
                    self._backlog.append(_Task(execution_id, run, let_go, flow, time.monotonic()))
                    if first:  # the poll loop's wait now ends when this one is let go
                        self._wake.set()
                    return True
                self._queued.discard(execution_id)  # a slot was freed meanwhile
                self._handed.discard(execution_id)
                self._in_flight.add(execution_id)
                self.stats.in_flight = len(self._in_flight)
        if pool is not None:
            try:
                pool.submit(self._work, _Task(execution_id, run))
                return True
            except RuntimeError:  # shut down meanwhile
                pass
        self._unreserve(execution_id)
        return False

    def _work(self, first: _Task) -> None:
        """Run a task, then the queued ones, one after another, until none is left or
        one hands the rest of its drive to the loop (an async flow: the loop's end of
        it frees the slot and takes the next); every drive made here is released when
        the worker's grace is over."""
        task: _Task | None = first
        while task is not None:
            if self._begin(task):
                return
            task = self._next_for_slot(task)
        self._wake.set()  # a slot is free

    def _begin(self, task: _Task) -> bool:
        """Drive a task on this thread, up to the first pass of async flow code it
        asks for (all of a sync flow's drive); True when the rest went to the loop."""
        context = contextvars.copy_context()  # the drive's own, wherever it goes on
        context.run(self._enter_drive)
        try:
            drive = context.run(task.run)
            asked = context.run(next, drive, None)
            if asked is None:
                return False
            if self._to_loop(task, drive, asked, context):
                return True
            context.run(drive_here, drive, asked)
        except BaseException as exc:  # SystemExit from a step: on this thread, not the process's
            self._failed(task, exc)
        return False

    def _enter_drive(self) -> None:
        RELEASE.set(self._released)
        FLOW_LOOP.set(None if self._flows is None else self._flows.loop)

    def _failed(self, task: _Task, exc: BaseException) -> None:
        self.stats.failures += 1
        if isinstance(exc, LoomError):
            logger.warning("loom: %s: %s: %s", task.execution_id, type(exc).__name__, exc)
        else:
            logger.error("loom: working on %s failed", task.execution_id, exc_info=exc)

    def _to_loop(
        self, task: _Task, drive: Drive[object], asked: FlowPass, context: contextvars.Context
    ) -> bool:
        """Hand the rest of a drive, whose async flow's code is to run, to the worker's
        loop (see `drive_on_loop`): its slot holds no thread while that code awaits.
        False when the worker's loop or pool is gone (it is stopping)."""
        with self._lock:
            pool, flows = self._pool, self._flows
            if pool is None or flows is None:
                return False
            self._on_loop += 1
            self._loop_idle.clear()
        rest = drive_on_loop(drive, asked, context, pool)
        try:
            future = asyncio.run_coroutine_threadsafe(rest, flows.loop)
        except RuntimeError:  # its loop closed
            rest.close()
            self._off_loop()
            return False
        future.add_done_callback(partial(self._ended_on_loop, task, pool, drive, context))
        return True

    def _ended_on_loop(
        self,
        task: _Task,
        pool: ThreadPoolExecutor,
        drive: Drive[object],
        context: contextvars.Context,
        future: concurrent.futures.Future[Outcome],
    ) -> None:
        """On the loop, as a drive handed to it ends: say how, then free its slot for
        the next task, which the pool runs."""
        try:
            if future.cancelled():  # by the loop closing before it began: it never did
                context.run(drive.close)  # what it holds (the run's lock) is let go
                error: BaseException | None = LoopStoppedError("the worker's loop closed")
            else:
                error = future.exception() or future.result()[1]
            if error is not None:
                self._failed(task, error)
            following = self._next_for_slot(task)
            if following is not None:
                try:
                    pool.submit(self._work, following)
                except RuntimeError:  # shut down meanwhile: dropped, as at a stop
                    self._drop(following)
        finally:
            self._off_loop()
            self._wake.set()

    def _off_loop(self) -> None:
        with self._lock:
            self._on_loop -= 1
            if self._on_loop == 0:
                self._loop_idle.set()

    def _drop(self, task: _Task) -> None:
        """A task taken for a slot that no pool will run (the worker is stopping)."""
        with self._lock:
            self._in_flight.discard(task.execution_id)
            self.stats.in_flight = len(self._in_flight)
        if task.let_go is not None:
            task.let_go()

    def _next_for_slot(self, done: _Task) -> _Task | None:
        """Once a slot's task is over: the queued task it takes next, if any."""
        with self._lock:
            self._in_flight.discard(done.execution_id)
            self._look_again_if_asked(done.execution_id)
            task = None
            if self._backlog and not self._stopping.is_set():
                task = self._backlog.popleft()
                self._queued.discard(task.execution_id)
                self._handed.discard(task.execution_id)
                self._in_flight.add(task.execution_id)
            self.stats.in_flight = len(self._in_flight)
        return task

    def _visit(self, hint: OpenHint) -> Drive[None]:
        try:
            outcome = yield from self.engine._recover_hint(hint)
            if outcome is NOT_STARTED:
                self._look_again(hint.execution_id)
                return
            with self._lock:
                self._not_started.pop(hint.execution_id, None)
            if outcome is not None:
                self.stats.driven += 1
        finally:
            self.stats.visited += 1

    def _look_again_if_asked(self, execution_id: str) -> None:
        """Under the lock, once a run's task or reservation is over: the next poll
        looks at it again if a poll asked for that meanwhile (`_look_again_after`)."""
        if execution_id in self._look_again_after:
            self._look_again_after.discard(execution_id)
            self._look_again_next.add(execution_id)
            self._wake.set()

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
            # Queued for the next poll only once its visit is no longer in flight
            # (in _work), or that poll could find it in flight and skip it.
            self._look_again_after.add(execution_id)

    def _until_let_go(self) -> float:
        """Seconds until the oldest handed run waiting for a slot is let go."""
        with self._lock:
            oldest = next((task.since for task in self._backlog if task.let_go), None)
        if oldest is None:
            return float("inf")
        return max(0.0, oldest + _HANDED_WAIT - time.monotonic())

    def _let_go_handed(self, *, everything: bool = False) -> None:
        """Let go the handed runs that waited `_HANDED_WAIT` for a slot (or all, at a
        stop): this engine no longer holds them, a beat says so, and a nudge in the run
        index has every worker look at them now (this one too; a taker claims it)."""
        cutoff = time.monotonic() - _HANDED_WAIT
        with self._lock:
            stale = [
                task
                for task in self._backlog
                if task.let_go is not None and (everything or task.since <= cutoff)
            ]
            for task in stale:
                self._backlog.remove(task)
                self._queued.discard(task.execution_id)
                self._handed.discard(task.execution_id)
        if not stale:
            return
        for task in stale:
            assert task.let_go is not None
            task.let_go()
        logger.info("loom: let go %d enqueued run(s) a slot did not take in time", len(stale))
        try:
            self.engine._heartbeat.beat()
        except LoomError as exc:  # its next beat says it; the hints still have workers look
            self.stats.failures += 1
            logger.warning("loom: a beat letting runs go: %s: %s", type(exc).__name__, exc)
        for task in stale:
            if not task.flow:
                continue  # a run admitted from a queue: its let_go had it wait again
            try:
                self.engine.runs.nudged(task.execution_id, task.flow)
            except LoomError as exc:  # held by no one now: found at the next sweeps
                self.stats.failures += 1
                logger.warning("loom: letting %s go: %s", task.execution_id, exc)

    # -- stopping ---------------------------------------------------------------

    def _wind_down(self) -> None:
        """Let the runs in flight go on for the grace period, then release them."""
        deadline = time.monotonic() + self.grace
        while self._in_flight and time.monotonic() < deadline:
            self._wake.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            self._wake.clear()
        with self._lock:
            left = sorted(self._in_flight)
        if left:
            logger.info("loom: releasing %d run(s) at their next step: %s", len(left), left)
        self._released_runs = left
        self._released.set()  # every drive made by this worker stops before its next step

    def _release_lease(self) -> bool:
        """A last beat listing nothing, so the runs this worker let go are taken over
        at once rather than a lease later; whether it was written."""
        try:
            self.engine._heartbeat.beat()
        except LoomError as exc:
            logger.warning("loom: last beat of %s: %s", self.engine.worker_id, exc)
            return False
        return True

    def _nudge_released(self) -> None:
        """After the last beat: a nudge in the run index for each run released at the
        stop and left running, so that workers already running look at it at their
        next poll (they saw it open before, while this one drove it), not at their next
        sweep. A queued run needs none: its release had it wait on its queue again.

        The first failure ends the nudges (the store is likely down, and each call
        could take its full timeout): the runs left are found at the next sweeps."""
        engine = self.engine
        for execution_id in self._released_runs:
            if driving_here(engine.worker_id, execution_id):
                continue  # an engine of this process drives it now (an inline resume)
            try:
                status, owner, queue, flow_name = engine._view(
                    execution_id, lambda state: (state.status, state.owner, state.queue, state.flow)
                )
                if status is Status.RUNNING and owner == engine.worker_id and queue is None:
                    engine.runs.nudged(execution_id, flow_name)
            except ExecutionNotFoundError:
                continue  # a reservation, or a hint, whose start never landed
            except Exception as exc:  # the stop goes on, whatever the store did
                logger.warning(
                    "loom: releasing %s: %s: %s; the runs released are found at the next sweeps",
                    execution_id,
                    type(exc).__name__,
                    exc,
                )
                return

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, Any] = {}
        for number in (signal.SIGTERM, signal.SIGINT):
            previous[number] = signal.signal(number, self._on_signal)
        return previous

    def _on_signal(self, number: int, _frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals > 1:
            logger.warning("loom: second %s: stopping at once", signal.Signals(number).name)
            os._exit(128 + number)
        logger.info(
            "loom: %s: stopping; runs in flight have %.0f s to park or end (again to stop now)",
            signal.Signals(number).name,
            self.grace,
        )
        self._stopping.set()
        self._wake.set()

    def _show(self, out: TextIO) -> None:
        stats = self.stats
        line = (
            f"loom worker {self.engine.worker_id}: driving {stats.in_flight}/{self.concurrency}"
            f" · driven {stats.driven} · timers {stats.timers} · failures {stats.failures}"
        )
        out.write("\r" + line[:200].ljust(80))
        out.flush()


def terminal_status() -> TextIO | None:
    """stderr when it is a terminal (for the live status line), else None."""
    return sys.stderr if sys.stderr.isatty() else None
