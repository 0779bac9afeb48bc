"""A worker's slots: the runs it drives at once, the work waiting for a free slot, and
the runs `enqueue` on its own engine hands over.

At most `concurrency` runs are driven at once. A sync flow's drive holds a thread of
the worker's pool; an async flow's begins there and goes on on the worker's one event
loop (`drive_on_loop`): its code runs as a task, its journal writes and sync step
functions are made on the pool one after another (so the loop never waits on a disk),
and it holds no thread while its code awaits. Work found while every slot is busy
waits in a backlog, and a slot that ends takes the next. `Slots` is what the worker
offers its engine (`LocalSlots`): a run `enqueue` starts goes to a free slot at once,
or waits in the backlog, held as the engine's own for a second at most.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Final

import attrs

from loom_kernel._core import LoomError
from loom_kernel._engine import DRIVE_WATCH, EngineParts
from loom_kernel._replay import (
    FLOW_LOOP,
    RELEASE,
    Drive,
    FlowPass,
    LoopStoppedError,
    LoopThread,
    Outcome,
    drive_here,
    drive_on_loop,
)

__all__ = ["Slots", "Task", "WorkerStats"]

logger = logging.getLogger("loom")

#: Runs `enqueue` hands to a worker whose slots are all busy wait in its own backlog,
#: held as this engine's, at most this many per slot and for at most this long; then
#: they are let go for any worker to take.
_HANDED_PER_SLOT: Final = 16
_HANDED_WAIT: Final = 1.0


@attrs.frozen
class Task:
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
        visited: runs it looked at (open runs visited, runs admitted from a queue or
            handed over by `enqueue`).
        driven: drives it made, each counted as it ended: a run claimed (or taken
            over) and run until it parked, ended or was let go; a run a timer woke, or
            a listener resumed in its slot (a parent whose child ended), is one too.
        timers: timers it fired.
        failures: visits, timer firings and polls that raised (each is logged).
        in_flight: slots busy now (with a drive, a visit or a timer's wake).
        driving: drives in progress now: those of its slots and those they run inline
            (a parent driving a child it started), so it can pass `in_flight`.
    """

    visited: int = 0
    driven: int = 0
    timers: int = 0
    failures: int = 0
    in_flight: int = 0
    driving: int = 0


class Slots:
    """The slots of one worker (see the module's docstring)."""

    def __init__(
        self,
        parts: EngineParts,
        concurrency: int,
        stats: WorkerStats,
        stopping: threading.Event,
        wake: threading.Event,
    ) -> None:
        self._parts = parts
        self.concurrency = concurrency
        self.stats = stats
        self._stopping = stopping
        self._wake = wake
        self.released = threading.Event()  # set once the grace on stop is over
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._backlog: deque[Task] = deque()  # work found while every slot was busy
        self._queued: set[str] = set()  # their ids
        self._handed: set[str] = set()  # of those, runs enqueue handed over (or will)
        self._look_again_next: set[str] = set()  # runs the next poll looks at again
        # runs to look at again once their task in flight ends (not started, or seen
        # open by a poll while a task of theirs was in flight)
        self._look_again_after: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None  # while the worker runs
        self.flows: LoopThread | None = None  # where async flows run, while it runs
        self._on_loop = 0  # drives handed to the loop (see `_to_loop`) not ended yet
        self.loop_idle = threading.Event()  # set while that is none
        self.loop_idle.set()

    # -- the worker's life ------------------------------------------------------

    def open(self, pool: ThreadPoolExecutor, flows: LoopThread | None) -> None:
        """Take work, driving on `pool` and on the loop of `flows`."""
        with self._lock:
            self._pool = pool
            self.flows = flows

    def close(self) -> None:
        """Take no more work (the pool shuts down next)."""
        with self._lock:
            self._pool = None

    def in_flight(self) -> list[str]:
        """The runs driven now."""
        with self._lock:
            return sorted(self._in_flight)

    def free(self) -> int:
        """How many slots are free, counting the work that waits for one."""
        with self._lock:
            return self.concurrency - len(self._in_flight) - len(self._backlog)

    def busy_with(self, execution_id: str) -> bool:
        """Whether a run is in flight or waiting for a slot here (a visit of it, say)."""
        with self._lock:
            return execution_id in self._in_flight or execution_id in self._queued

    def wake(self) -> None:
        """Have the worker poll now."""
        self._wake.set()

    # -- work found by the worker ----------------------------------------------------

    def submit(self, task: Task, *, queue: bool = False, look_again: bool = False) -> bool:
        """Run `task` on the pool, or (with `queue`) keep it for the next free slot;
        False when its run is in flight or queued already, or every slot is busy.

        With `look_again`, a run in flight is looked at again by the first poll after
        its task ends: the task may have begun before what the poll saw (a handed drive
        that failed before it held the run, say), and left the run open for nobody.
        """
        with self._lock:
            pool = self._pool
            if pool is None:
                return False  # the worker is stopping
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

    def next_up(self, tasks: list[Task]) -> None:
        """Have this slot's thread take `tasks` next, before the backlog (the runs a
        queue admitted for the slot that has just finished)."""
        with self._lock:
            for task in tasks:
                self._backlog.appendleft(task)
                self._queued.add(task.execution_id)

    def backlog_waits(self) -> bool:
        """Whether found work waits for a slot."""
        with self._lock:
            return bool(self._backlog)

    def look_again(self, execution_id: str) -> None:
        """Have the first poll after a run's task ends look at the run again."""
        with self._lock:
            self._look_again_after.add(execution_id)

    def looks_asked(self) -> set[str]:
        """The runs the next poll looks at again (taken: asked once)."""
        with self._lock:
            again, self._look_again_next = self._look_again_next, set()
        return again

    def _look_again_if_asked(self, execution_id: str) -> None:
        """Under the lock, once a run's task or reservation is over: the next poll
        looks at it again if a poll asked for that meanwhile (`_look_again_after`)."""
        if execution_id in self._look_again_after:
            self._look_again_after.discard(execution_id)
            self._look_again_next.add(execution_id)
            self._wake.set()

    # -- runs handed over by enqueue on this engine (LocalSlots) ---------------------

    def reserve(self, execution_id: str, *, queue: bool) -> bool:
        """Take a slot for a run `enqueue` is about to start, if one is free now (and
        nothing waits for one: found work comes first), or else (with `queue`) a place
        in this worker's backlog, if it holds fewer than `_HANDED_PER_SLOT` a slot."""
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

    def unreserve(self, execution_id: str) -> None:
        """Give back a slot or a place taken by `reserve` for a run that was not handed
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
            task: Task | None = None
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

    def hand(
        self,
        execution_id: str,
        drive: Callable[[], Drive[None]],
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
            finally:
                with self._lock:
                    self.stats.visited += 1

        with self._lock:
            pool = None if self._stopping.is_set() else self._pool
            if pool is not None and execution_id in self._handed:
                if len(self._in_flight) >= self.concurrency:
                    first = not any(task.let_go for task in self._backlog)
                    self._backlog.append(Task(execution_id, run, let_go, flow, time.monotonic()))
                    if first:  # the poll loop's wait now ends when this one is let go
                        self._wake.set()
                    return True
                self._queued.discard(execution_id)  # a slot was freed meanwhile
                self._handed.discard(execution_id)
                self._in_flight.add(execution_id)
                self.stats.in_flight = len(self._in_flight)
        if pool is not None:
            try:
                pool.submit(self._work, Task(execution_id, run))
                return True
            except RuntimeError:  # shut down meanwhile
                pass
        self.unreserve(execution_id)
        return False

    def until_let_go(self) -> float:
        """Seconds until the oldest handed run waiting for a slot is let go."""
        with self._lock:
            oldest = next((task.since for task in self._backlog if task.let_go), None)
        if oldest is None:
            return float("inf")
        return max(0.0, oldest + _HANDED_WAIT - time.monotonic())

    def let_go_handed(self, *, everything: bool = False) -> None:
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
        driver = self._parts.driver
        try:
            driver.heartbeat.beat()
        except LoomError as exc:  # its next beat says it; the hints still have workers look
            self.stats.failures += 1
            logger.warning("loom: a beat letting runs go: %s: %s", type(exc).__name__, exc)
        for task in stale:
            if not task.flow:
                continue  # a run admitted from a queue: its let_go had it wait again
            try:
                driver.runs.nudged(task.execution_id, task.flow)
            except LoomError as exc:  # held by no one now: found at the next sweeps
                self.stats.failures += 1
                logger.warning("loom: letting %s go: %s", task.execution_id, exc)

    # -- a slot at work ----------------------------------------------------------------

    def _work(self, first: Task) -> None:
        """Run a task, then the queued ones, one after another, until none is left or
        one hands the rest of its drive to the loop (an async flow: the loop's end of
        it frees the slot and takes the next); every drive made here is released when
        the worker's grace is over."""
        task: Task | None = first
        while task is not None:
            if self._begin(task):
                return
            task = self._next_for_slot(task)
        self._wake.set()  # a slot is free

    def _begin(self, task: Task) -> bool:
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
        RELEASE.set(self.released)
        DRIVE_WATCH.set(self._watch)
        FLOW_LOOP.set(None if self.flows is None else self.flows.loop)

    def _watch(self, change: int) -> None:
        """A drive made here began (1) or ended (-1): `driving` and `driven` count it."""
        with self._lock:
            self.stats.driving += change
            if change < 0:
                self.stats.driven += 1

    def _failed(self, task: Task, exc: BaseException) -> None:
        self.stats.failures += 1
        if isinstance(exc, LoomError):
            logger.warning("loom: %s: %s: %s", task.execution_id, type(exc).__name__, exc)
        else:
            logger.error("loom: working on %s failed", task.execution_id, exc_info=exc)

    def _to_loop(
        self, task: Task, drive: Drive[object], asked: FlowPass, context: contextvars.Context
    ) -> bool:
        """Hand the rest of a drive, whose async flow's code is to run, to the worker's
        loop (see `drive_on_loop`): its slot holds no thread while that code awaits.
        False when the worker's loop or pool is gone (it is stopping)."""
        with self._lock:
            pool, flows = self._pool, self.flows
            if pool is None or flows is None:
                return False
            self._on_loop += 1
            self.loop_idle.clear()
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
        task: Task,
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
                self.loop_idle.set()

    def _drop(self, task: Task) -> None:
        """A task taken for a slot that no pool will run (the worker is stopping)."""
        with self._lock:
            self._in_flight.discard(task.execution_id)
            self.stats.in_flight = len(self._in_flight)
        if task.let_go is not None:
            task.let_go()

    def _next_for_slot(self, done: Task) -> Task | None:
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
