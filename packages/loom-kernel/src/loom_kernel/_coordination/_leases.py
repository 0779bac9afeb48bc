"""Who drives a run: worker ids, a lease renewed by a heartbeat, and when another
worker may take a run over.

A run being driven names its owner in the journal (the `by` of its start, resume or
claim). The owner's engine renews one lease for everything it drives by appending a
beat to its own stream, `workers/<worker id>`, every third of the lease; a beat
lists the runs the worker is driving. Another worker takes a running run over when
its owner is known to have stopped driving it (its process on this machine is gone,
no engine of this process drives it, or the owner's latest beat, newer than the
run's last record, does not list it), or when the owner was last seen (its last
beat, or the run's last record, whichever is later) more than a lease ago by the
taker's clock. The takeover is an append at the journal's exact head, so one taker
wins and the old owner's next append is refused: the journal fences, the clock
only decides when to look.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

import attrs

from loom_kernel._coordination._streams import latest
from loom_kernel._core import (
    ConflictError,
    LoomError,
    NewRecord,
    Record,
    TrimmedError,
    validate_stream_id,
)
from loom_kernel._spi import JournalStore

__all__ = [
    "DEFAULT_LEASE",
    "MAX_LEASE",
    "WORKERS_PREFIX",
    "Heartbeat",
    "Sighting",
    "abandoned_here",
    "default_worker_id",
    "driving_here",
    "earlier_process_exited",
    "exited_here",
    "last_record",
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
#: Seconds a heartbeat thread stays after its engine's last drive (and waits at most).
_LINGER: Final = 1.0

#: The runs engines of this process are driving now: (worker id, execution id) -> count.
_driving: Counter[tuple[str, str]] = Counter()
_driving_lock = threading.Lock()


def _machine() -> str:
    """The host name, the boot and the pid namespace: a pid is only ever judged on
    the machine, boot and namespace it belongs to (two hosts or two containers that
    share a host name differ here)."""
    host = re.sub(r"[^A-Za-z0-9\-_]", "-", socket.gethostname())[:60] or "host"
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot_file:
            boot = re.sub(r"[^0-9a-f]", "", boot_file.read())[:12] or "0"
    except OSError:
        boot = "0"
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = "0"
    return f"{host}.{boot}.{namespace}"


_THIS_MACHINE: Final = _machine()


def default_worker_id() -> str:
    """`<host>.<boot>.<pid namespace>:<pid>:<nonce>`: unique per engine and process,
    and telling a worker of this machine whether the process it names is there."""
    return f"{_THIS_MACHINE}:{os.getpid()}:{secrets.token_hex(3)}"


_process: tuple[int, str] | None = None


def this_process() -> str:
    """`<host>.<boot>.<pid namespace>:<pid>:<nonce>` of this process (a fork is
    another): what its beats say wrote them, whatever worker id they are under."""
    global _process  # noqa: PLW0603 - one identity per process, made again after a fork
    pid = os.getpid()
    if _process is None or _process[0] != pid:
        _process = (pid, f"{_THIS_MACHINE}:{pid}:{secrets.token_hex(4)}")
    return _process[1]


#: How many of a worker id's last beats are looked at for another process's.
_BEATS_LOOKED_AT: Final = 8


def earlier_process_exited(store: JournalStore, worker_id: str) -> bool:
    """Whether the last other process that beat under `worker_id` is known to have
    exited: one of this machine whose pid is gone. False when no other process beat
    under it, or it was of another machine, or it may be alive: two live processes
    under one id would otherwise each take what the other holds."""
    stream = WORKERS_PREFIX + worker_id
    try:
        head = store.head(stream)
        try:
            beats = store.read(stream, max(0, head - _BEATS_LOOKED_AT)) if head else []
        except TrimmedError as trimmed:  # the beats kept: those from its floor on
            beats = store.read(stream, trimmed.floor)
    except LoomError:
        return False  # unreadable now: no evidence
    me = this_process()
    for beat in reversed(beats):
        try:
            proc = json.loads(beat.payload).get("proc")
        except (ValueError, AttributeError, RecursionError):
            return False
        if isinstance(proc, str) and proc != me:
            return exited_here(proc)
    return False


def driving_here(worker_id: str, execution_id: str, *, besides: int = 0) -> bool:
    """Whether an engine of this process with `worker_id` is driving the run now (or
    is about to: it holds the lease before its first append), not counting `besides`
    holds the caller has itself."""
    with _driving_lock:
        return _driving[worker_id, execution_id] > besides


def abandoned_here(worker_id: str, execution_id: str) -> bool:
    """Whether `worker_id` is known here to have stopped driving `execution_id`: it
    names this process, and no engine here is driving the run, or another process of
    this machine, which has exited."""
    pid = _pid_here(worker_id)
    if pid == os.getpid():
        return not driving_here(worker_id, execution_id)
    return exited_here(worker_id)


def exited_here(worker_id: str) -> bool:
    """Whether `worker_id` names another process of this machine, which has exited
    (whatever any clock says)."""
    pid = _pid_here(worker_id)
    if pid is None or pid == os.getpid() or os.name != "posix":
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _pid_here(worker_id: str) -> int | None:
    """The process id a worker id names, when it names one of this machine."""
    machine, _, rest = worker_id.partition(":")
    pid_text, _, _nonce = rest.partition(":")
    if machine != _THIS_MACHINE or not pid_text.isdigit():
        return None
    return int(pid_text)


@attrs.frozen
class Sighting:
    """What the journal says of a run's owner.

    Attributes:
        worker: the owner.
        seen_at: the later of its last beat and the run's last record (the writers'
            clocks), or None when neither can be read.
        dropped: the owner's latest beat is newer than the run's last record and does
            not list the run: the owner is alive but no longer driving it.
    """

    worker: str
    seen_at: float | None
    dropped: bool = False

    def expired(self, now: float, lease: float) -> bool:
        """Whether the run can be taken over at `now`."""
        return self.dropped or self.seen_at is None or now - self.seen_at > lease


def last_record(store: JournalStore, stream: str) -> Record | None:
    """A stream's last record (its kind and time: a payload kept as a blob is left a
    reference); None when it has none, or it cannot be read now.

    A trim between reading the head and reading the record (a beat trims its stream
    now and then, a compaction a run's) means newer records: the head is read again,
    or an owner renewing its lease would look unseen.
    """
    try:
        return latest(store, stream, raw=True)
    except LoomError:
        return None  # deleted meanwhile, or unreadable: the other stream still tells


def _beat_lists(record: Record, execution_id: str) -> bool:
    try:
        runs = json.loads(record.payload).get("runs")
    except (ValueError, AttributeError, RecursionError):
        return True  # not a beat this kernel wrote: assume the best, wait for the lease
    return not isinstance(runs, list) or execution_id in runs


def sighting(store: JournalStore, worker: str, execution_id: str, run_stream: str) -> Sighting:
    """When the owner of a run was last seen, and whether its latest beat dropped it."""
    beat = last_record(store, WORKERS_PREFIX + worker)
    last = last_record(store, run_stream)
    times = [record.timestamp for record in (beat, last) if record is not None]
    dropped = (
        beat is not None
        and last is not None
        and beat.timestamp > last.timestamp
        and not _beat_lists(beat, execution_id)
    )
    return Sighting(worker, max(times) if times else None, dropped)


class Heartbeat:
    """Renews one worker's lease while it drives anything.

    `holding(id)` marks a drive of run `id` in progress; while at least one is, a
    daemon thread appends a beat listing the runs held to `workers/<id>` every
    `lease / 3` seconds (and trims old beats), and ends one to two seconds after the
    last drive.
    A beat that fails is logged and tried again at the next interval; the last
    success is what `in_doubt` measures.
    """

    def __init__(
        self,
        store: JournalStore,
        worker_id: Callable[[], str],
        lease: float,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._worker_id = worker_id
        self._lease = lease
        self._clock = clock
        self._runs: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._renewed = time.monotonic()
        self._heads: dict[str, int] = {}  # stream -> its head as this engine left it
        self._beating = threading.Lock()  # one beat at a time: each at the head the last left

    @contextmanager
    def holding(self, execution_id: str) -> Iterator[None]:
        """Keep the lease renewed for the duration of a drive of `execution_id`."""
        key = (self._worker_id(), execution_id)
        with _driving_lock:
            _driving[key] += 1
        try:
            with self._lock:
                if not self._runs:
                    self._renewed = time.monotonic()  # the drive's first record is a sighting
                self._runs[execution_id] += 1
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(
                        target=self._run, name="loom-heartbeat", daemon=True
                    )
                    self._thread.start()
            yield
        finally:
            with self._lock:
                self._runs[execution_id] -= 1
                if self._runs[execution_id] <= 0:
                    del self._runs[execution_id]
            # The thread is not woken to end (it looks every _LINGER seconds at most):
            # a wake at each drive's end cost a switch of threads a run.
            with _driving_lock:
                _driving[key] -= 1
                if _driving[key] <= 0:
                    del _driving[key]

    def in_doubt(self) -> bool:
        """Whether the lease may have run out: no beat succeeded for half a lease, so
        a drive should look at the journal's head before its next step."""
        return time.monotonic() - self._renewed > self._lease / 2

    def beat(self) -> None:
        """Append one beat now, listing the runs held (trimming old beats now and then).
        Safe to call from any thread (a worker letting runs go, the heartbeat's own)."""
        stream = validate_stream_id(WORKERS_PREFIX + self._worker_id())
        store = self._store
        with self._beating:
            # Stamped before the runs held are listed: a drive that begins after the
            # listing writes records stamped after the beat, so the beat never looks
            # like it dropped a run it only missed.
            stamp = self._clock()
            with self._lock:
                runs = sorted(self._runs)
            head = self._heads.get(stream)
            if head is None:
                head = store.head(stream)
            payload = json.dumps(
                {"runs": runs, "proc": this_process()}, separators=(",", ":")
            ).encode()
            try:
                head = store.append(stream, head, [NewRecord(_BEAT, payload, stamp)])
            except ConflictError:
                self._heads.pop(stream, None)  # another engine with this id: re-read next time
                raise
            self._heads[stream] = head
            self._renewed = time.monotonic()
            if head % _TRIM_EVERY == 0:
                store.trim(stream, head)

    def _run(self) -> None:
        idle_since: float | None = None
        not_before = 0.0  # after a failed beat: the next try
        while True:
            now = time.monotonic()
            due = max(self._renewed + self._lease / 3, not_before)
            time.sleep(min(_LINGER, max(0.0, due - now)))
            now = time.monotonic()
            with self._lock:
                if not self._runs:
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since >= _LINGER:
                        self._thread = None
                        return
                    continue
                idle_since = None
            if now < max(self._renewed + self._lease / 3, not_before):
                continue
            try:
                self.beat()
            except Exception as exc:  # a beat failing must not end the thread
                not_before = now + _LINGER
                logger.warning("loom: the lease of %s was not renewed: %s", self._worker_id(), exc)
