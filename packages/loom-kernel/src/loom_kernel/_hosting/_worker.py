"""The worker: fires due timers and drives the runs no one else is driving.

A worker polls two indexes kept on the journal: the timer buckets, and the run index
(the runs still open, by partition; see `_visits`), and admits the runs its engine's
queues hold (`_queue_serving`). At most `concurrency` runs are driven at once, in its
slots (`_slots`). It stops gracefully: the runs in flight get a grace period to park
or end, then are released at their next step, and a last beat lets other workers
take them over at once.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import FrameType
from typing import Any, Final, TextIO

from loom_kernel._coordination import TimerEntry, driving_here
from loom_kernel._core import (
    ExecutionNotFoundError,
    InvalidArgumentError,
    LoomError,
    Status,
    finite_number,
)
from loom_kernel._engine import Engine, parts_of
from loom_kernel._hosting._pollers import PollerFactory, Pollers, installed_pollers
from loom_kernel._hosting._queue_serving import QueueServing
from loom_kernel._hosting._slots import Slots, Task, WorkerStats
from loom_kernel._hosting._visits import OpenRunVisits
from loom_kernel._replay import Drive, LoopThread
from loom_kernel._spi import SupportsWakeups

__all__ = ["Worker", "WorkerStats", "terminal_status"]

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
#: The shortest wait between two polls, whatever `idle_poll` says (a wait of nothing
#: would spin a core).
_SHORTEST_POLL: Final = 0.01


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
        pollers: work to do on each poll beside its own, as factories called with the
            engine (see docs/running.md); by default every one installed in the
            `loom.pollers` entry-point group (so installing loom-orchestration makes
            every worker fire its schedules).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        concurrency: int = 8,
        idle_poll: float | None = None,
        grace: float = 30.0,
        queues: Iterable[str] | None = None,
        pollers: Iterable[PollerFactory] | None = None,
    ) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise InvalidArgumentError(f"concurrency is an int of 1 or more, not {concurrency!r}")
        if grace is None or not finite_number(grace) or grace < 0:
            raise InvalidArgumentError(f"grace is a number of seconds >= 0, not {grace!r}")
        if idle_poll is not None and (not finite_number(idle_poll) or idle_poll <= 0):
            raise InvalidArgumentError(
                f"idle_poll is a number of seconds above 0, not {idle_poll!r} (a worker "
                f"polls at most every {_SHORTEST_POLL} s whatever it is given: 0 would spin)"
            )
        parts = parts_of(engine)
        book = parts.enqueueing.book
        self._queues = list(book.queues) if queues is None else list(queues)
        for name in self._queues:
            book.queue(name)  # raises for a queue the engine lacks
        self.engine = engine
        self._concurrency = concurrency
        default = _IDLE_POLL_CHEAP if engine.store.head_is_cheap else _IDLE_POLL_COSTLY
        self.idle_poll = default if idle_poll is None else float(idle_poll)
        self.grace = float(grace)
        self.stats = WorkerStats()
        self._parts = parts
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._ready = threading.Event()  # set once run() takes work
        self._wake = threading.Event()
        self._slots = Slots(parts, concurrency, self.stats, self._stopping, self._wake)
        self._visits = OpenRunVisits(parts, self._slots, self.stats)
        self._serving = QueueServing(
            parts,
            self._queues,
            slots=self._slots,
            stats=self.stats,
            stopping=self._stopping,
            beat=self._beat,
        )
        factories = installed_pollers() if pollers is None else list(pollers)
        self._pollers = Pollers(engine, factories, self.stats)
        self._released_runs: list[str] = []  # the runs in flight as the grace ended
        self._thread: threading.Thread | None = None
        self._threads_left = False  # threads its async flows started outlived its stop
        self._gc: threading.Thread | None = None  # a retention sweep in progress
        self._next_gc: float | None = None  # when the next sweep is due (monotonic)
        self._signals = 0

    @property
    def concurrency(self) -> int:
        """How many runs it drives at once (set when it is made)."""
        return self._concurrency

    @property
    def queues(self) -> list[str]:
        """The names of the queues whose runs it admits (set when it is made)."""
        return list(self._queues)

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
        slots, enqueueing = self._slots, self._parts.enqueueing
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="loom-drive")
        per_loop = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor's size
        flows = LoopThread("loom-flows", self.concurrency * per_loop)
        slots.open(pool, flows)
        enqueueing.slots.append(slots)
        self._ready.set()
        logger.info(
            "loom: worker %s started (concurrency %d)", self.engine.worker_id, self.concurrency
        )
        unsubscribe = self._subscribe_wakes()
        try:
            self._announce()
            self._poll_until_stopped(status)
            slots.let_go_handed(everything=True)  # not held through the grace
            self._wind_down()
        finally:
            unsubscribe()
            enqueueing.slots.remove(slots)
            slots.close()
            # The drives on the loop end (released at their next step) before the pool
            # that makes their calls shuts down, and before the loop closes.
            slots.loop_idle.wait()
            pool.shutdown(wait=True)
            flows.close()
            try:
                slots.let_go_handed(everything=True)
                if self._release_lease():
                    self._nudge_released()
                self._threads_left = not flows.join_threads(self.grace)
            finally:  # a second signal exits at once until here
                for number, handler in previous.items():
                    signal.signal(number, handler)
                if status is not None:
                    status.write("\n")
                logger.info("loom: worker %s stopped: %s", self.engine.worker_id, self.stats)
                self._stopped.set()

    # -- polling ----------------------------------------------------------------

    def _subscribe_wakes(self) -> Callable[[], None]:
        """Have a store that pushes changes (`SupportsWakeups`) wake the poll as work
        lands from any process; the function that stops it. Polling goes on as before:
        a wake lost costs a wait until the next poll, never the work."""
        store = self.engine.store
        if not isinstance(store, SupportsWakeups):
            return lambda: None
        try:
            return store.subscribe_wakes(self._wake.set)
        except Exception as exc:  # a worker that polls only is slower, never wrong
            logger.warning("loom: no wake-ups from the store (%s); polling only", exc)
            return lambda: None

    def _poll_until_stopped(self, status: TextIO | None) -> None:
        visits, slots = self._visits, self._slots
        sweep_every = self.engine.lease / 2
        next_sweep = next_timers = next_repair = 0.0
        fastest = _FASTEST_POLL if self.engine.store.head_is_cheap else _FASTEST_POLL_COSTLY
        fastest = max(min(fastest, self.idle_poll), _SHORTEST_POLL)
        pause = fastest
        shown = 0.0
        while not self._stopping.is_set():
            now = time.monotonic()
            sweep = now >= next_sweep
            if sweep:
                next_sweep = now + sweep_every
            busy = 0
            try:
                if sweep and not visits.repair:
                    visits.repair = not visits.indexed()  # a store from before the index
                if visits.repair and now >= next_repair:  # at once, then once a sweep
                    next_repair = now + sweep_every
                    visits.repair_index()
                slots.let_go_handed()
                busy += visits.visit_open(sweep=sweep)
                if now >= next_timers:  # at most every `fastest` seconds, however busy
                    next_timers = now + fastest
                    busy += self._fire_timers()  # due already: before the queues' runs
                busy += self._serving.serve(sweep=sweep)
                busy += self._pollers.poll()
                self._collect(now)
            except Exception:  # a poll that failed never ends the worker: the next tries
                self.stats.failures += 1
                logger.exception("loom: a poll of worker %s failed", self.engine.worker_id)
            if status is not None and now - shown >= _STATUS_EVERY:
                shown = now
                self._show(status)
            pause = fastest if busy else min(max(pause * 2, fastest), self.idle_poll)
            wait = min(pause, max(0.0, next_sweep - time.monotonic()) or pause)
            soonest = min(
                slots.until_let_go(), self._serving.until_due(), self._pollers.until_due()
            )
            self._wake.wait(min(wait, max(soonest, fastest)))
            self._wake.clear()
            spacing = now + fastest - time.monotonic()  # a wake-up polls no sooner than this
            if spacing > 0:
                self._stopping.wait(spacing)

    def _collect(self, now: float) -> None:
        """Start a retention sweep on a thread of its own (polls go on meanwhile) every
        `retention.every` seconds, the first at a random point of the first period so
        that workers started together sweep apart."""
        retention = self.engine.retention
        if retention is None or (self._gc is not None and self._gc.is_alive()):
            return
        if self._next_gc is None:
            self._next_gc = now + random.uniform(0, retention.every)  # noqa: S311 - spread, not secret
        if now < self._next_gc:
            return
        self._next_gc = now + retention.every
        self._gc = threading.Thread(target=self._sweep, name="loom-gc", daemon=True)
        self._gc.start()

    def _sweep(self) -> None:
        try:
            swept = self.engine.gc()
        except Exception:  # the next period tries again
            self.stats.failures += 1
            logger.exception("loom: a retention sweep of worker %s failed", self.engine.worker_id)
            return
        if swept.deleted or swept.finished:
            logger.info(
                "loom: retention deleted %d runs (%d left half-deleted finished)%s",
                len(swept.deleted),
                len(swept.finished),
                ", more to go" if swept.more else "",
            )
        if swept.more:
            self._next_gc = time.monotonic()  # the next batch at the next poll

    def _fire_timers(self) -> int:
        """Hand the due timers to the slots (the run's drive happens there, counted in
        the concurrency and released on stop); how many were handed over.

        A hint is handled (dropped) on a later poll, once the journal shows the wake.
        """
        driver, delivery = self._parts.driver, self._parts.delivery
        now = driver.clock()
        handed = 0

        def wake(entry: TimerEntry) -> bool | None:
            nonlocal handed
            due = delivery.timer_state(entry, now)
            if due is not True:
                return due
            task = Task(entry.execution_id, partial(self._fire, entry, now))
            if self._slots.submit(task, queue=True):  # or the next free slot
                handed += 1
            return None

        _woken, failures = driver.timers.fire_due(now, wake)
        for exc in failures:
            self.stats.failures += 1
            logger.warning("loom: firing timers: %s: %s", type(exc).__name__, exc)
        return handed

    def _fire(self, entry: TimerEntry, now: float) -> Drive[None]:
        if (yield from self._parts.delivery.fire(entry, now)):
            self.stats.timers += 1

    def _announce(self) -> None:
        """A first beat, saying which process works under this id now: a restart on
        this machine is then known to have replaced an exited process, whose queue
        places it takes back at once (see `_queue_serving`)."""
        try:
            self._parts.driver.heartbeat.beat()
        except Exception as exc:  # the places then wait half a lease, as any worker's
            logger.warning(
                "loom: first beat of %s: %s: %s", self.engine.worker_id, type(exc).__name__, exc
            )

    def _beat(self) -> None:
        """A beat now (it says which runs this worker no longer drives)."""
        try:
            self._parts.driver.heartbeat.beat()
        except LoomError as exc:  # its next beat says it
            logger.warning("loom: a beat letting a run go: %s: %s", type(exc).__name__, exc)

    # -- stopping ---------------------------------------------------------------

    def _wind_down(self) -> None:
        """Let the runs in flight go on for the grace period, then release them."""
        deadline = time.monotonic() + self.grace
        while self._slots.in_flight() and time.monotonic() < deadline:
            self._wake.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            self._wake.clear()
        left = self._slots.in_flight()
        if left:
            logger.info("loom: releasing %d run(s) at their next step: %s", len(left), left)
        self._released_runs = left
        self._slots.released.set()  # every drive made by this worker stops before its next step

    def _release_lease(self) -> bool:
        """A last beat listing nothing, so the runs this worker let go are taken over
        at once rather than a lease later; whether it was written."""
        try:
            self._parts.driver.heartbeat.beat()
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
        driver = self._parts.driver
        for execution_id in self._released_runs:
            if driving_here(driver.worker_id, execution_id):
                continue  # an engine of this process drives it now (an inline resume)
            try:
                status, owner, queue, flow_name = driver.view(
                    execution_id, lambda state: (state.status, state.owner, state.queue, state.flow)
                )
                if status is Status.RUNNING and owner == driver.worker_id and queue is None:
                    driver.runs.nudged(execution_id, flow_name)
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
            f"loom worker {self.engine.worker_id}: driving {stats.driving}/{self.concurrency}"
            f" · driven {stats.driven} · timers {stats.timers} · failures {stats.failures}"
        )
        out.write("\r" + line[:200].ljust(80))
        out.flush()


def terminal_status() -> TextIO | None:
    """stderr when it is a terminal (for the live status line), else None."""
    return sys.stderr if sys.stderr.isatty() else None
