"""Who drives a run: worker ids, a lease renewed by a heartbeat, and when another
worker may take a run over.

A run being driven names its owner in the journal (the `by` of its start, resume or
claim). The owner's engine renews one lease for everything it drives by appending a
beat to its own stream, `workers/<worker id>`, every third of the lease. Another
worker takes a running run over only when its owner was last seen (its last beat, or
the run's last record, whichever is later) more than a lease ago by the taker's
clock, or when the owner is a process of this machine that no longer exists. The
takeover is an append at the journal's exact head, so one taker wins and the old
owner's next append is refused: the journal fences, the clock only decides when to
look.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

import attrs

from loom_kernel._errors import ConflictError, LoomError
from loom_kernel._ids import validate_stream_id
from loom_kernel._journal import JournalStore, NewRecord

__all__ = [
    "DEFAULT_LEASE",
    "MAX_LEASE",
    "WORKERS_PREFIX",
    "Heartbeat",
    "Sighting",
    "abandoned_here",
    "default_worker_id",
    "driving_here",
    "sighting",
]

logger = logging.getLogger("loom")

#: Seconds a worker may go without renewing before its runs can be taken over.
DEFAULT_LEASE: Final = 30.0
#: The longest lease: a day (a run whose worker died waits at most this long).
MAX_LEASE: Final = 86_400.0
WORKERS_PREFIX: Final = "workers/"
_BEAT: Final = "loom.beat"
_TRIM_EVERY: Final = 16

#: The runs engines of this process are driving now: (worker id, execution id) -> count.
_driving: dict[tuple[str, str], int] = {}
_driving_lock = threading.Lock()


def _this_machine() -> str:
    """The host name and the pid namespace: two containers sharing a host name still
    differ here, so a pid is only ever judged in its own namespace."""
    host = re.sub(r"[^A-Za-z0-9\-_]", "-", socket.gethostname())[:60] or "host"
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = "0"
    return f"{host}.{namespace}"


def default_worker_id() -> str:
    """`<host>.<pid namespace>:<pid>:<nonce>`: unique per engine, and telling a worker
    of this machine whether the process it names is still there."""
    return f"{_this_machine()}:{os.getpid()}:{secrets.token_hex(3)}"


def abandoned_here(worker_id: str, execution_id: str) -> bool:
    """Whether `worker_id` is known to have stopped driving `execution_id` without a
    lease running out: it names this process, and no engine here is driving the run,
    or another process of this machine, which has exited. Its run can be taken over
    at once."""
    machine, _, rest = worker_id.partition(":")
    pid_text, _, _nonce = rest.partition(":")
    if machine != _this_machine() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return not driving_here(worker_id, execution_id)
    if os.name != "posix":
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def driving_here(worker_id: str, execution_id: str, *, besides: int = 0) -> bool:
    """Whether an engine of this process with `worker_id` is driving the run now (or
    is about to: it holds the lease before its first append), not counting `besides`
    holds the caller has itself."""
    with _driving_lock:
        return _driving.get((worker_id, execution_id), 0) > besides


@attrs.frozen
class Sighting:
    """When a worker was last seen alive, and by which record."""

    worker: str
    seen_at: float | None

    def expired(self, now: float, lease: float) -> bool:
        """Whether the worker's lease has run out by `now`."""
        return self.seen_at is None or now - self.seen_at > lease


def sighting(store: JournalStore, worker: str, run_stream: str) -> Sighting:
    """The later of the worker's last beat and the run's last record."""
    times: list[float] = []
    for stream in (WORKERS_PREFIX + worker, run_stream):
        try:
            head = store.head(stream)
            if head:
                times.extend(record.timestamp for record in store.read(stream, head - 1))
        except LoomError:
            continue  # a stream trimmed or deleted meanwhile: the other one still tells
    return Sighting(worker, max(times) if times else None)


class Heartbeat:
    """Renews one worker's lease while it drives anything.

    `holding()` marks a drive in progress; while at least one is, a daemon thread
    appends a beat to `workers/<id>` every `lease / 3` seconds (and trims old ones).
    A beat that fails is logged and tried again at the next interval; the last
    success is what `in_doubt` measures.
    """

    def __init__(
        self,
        store: JournalStore,
        worker_id: str,
        lease: float,
        clock: Callable[[], float],
    ) -> None:
        self.worker_id = worker_id
        self.stream = validate_stream_id(WORKERS_PREFIX + worker_id)
        self._store = store
        self._lease = lease
        self._clock = clock
        self._held = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed = time.monotonic()
        self._head: int | None = None

    @contextmanager
    def holding(self, execution_id: str) -> Iterator[None]:
        """Keep the lease renewed for the duration of a drive of `execution_id`."""
        key = (self.worker_id, execution_id)
        with _driving_lock:
            _driving[key] = _driving.get(key, 0) + 1
        with self._lock:
            self._held += 1
            if self._held == 1:
                self._renewed = time.monotonic()  # the drive's first record is a sighting
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="loom-heartbeat", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1
            with _driving_lock:
                _driving[key] -= 1
                if not _driving[key]:
                    del _driving[key]

    def in_doubt(self) -> bool:
        """Whether the lease may have run out: no beat succeeded for half a lease, so
        a drive should look at the journal's head before its next step."""
        return time.monotonic() - self._renewed > self._lease / 2

    def beat(self) -> None:
        """Append one beat now (trimming old ones now and then)."""
        stream, store = self.stream, self._store
        if self._head is None:
            self._head = store.head(stream)
        try:
            self._head = store.append(stream, self._head, [NewRecord(_BEAT, b"{}", self._clock())])
        except ConflictError:
            self._head = None  # another engine with this id: re-read next time
            raise
        self._renewed = time.monotonic()
        if self._head % _TRIM_EVERY == 0:
            store.trim(stream, self._head)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._lease / 3)
            with self._lock:
                if self._held == 0:
                    self._thread = None
                    return
            try:
                self.beat()
            except LoomError as exc:
                logger.warning("loom: the lease of %s was not renewed: %s", self.stream, exc)
