"""The run index: which runs are open (not yet finished and delivered), and which ended
how, kept on the journal SPI so store-wide calls cost what there is to do.

A run's id hashes to one of `PARTITIONS` partitions. Each partition has:

- `runs/open/<p>`: an `open` record, written before the run's first record (a hint
  before the fact), and a `closed` record (with the run's status and flow), written
  once the run has finished and its listeners have been called. A `checkpoint`
  record lists the runs still open when it was written; everything below it is
  trimmed off.
- `runs/<status>/<p>` for completed, failed and cancelled: batches of entries of the
  runs that ended so, moved there from the open partition's `closed` records before
  they are trimmed off: [id, flow, when it was closed, its generation, when its
  first hint was written (its start), its parent]. Read by `executions(status=...)`,
  by retention, and by `Engine.runs`, which lists an ended run from its entry alone.
- `runs/built`: one record once every run of the store is indexed (a fresh store,
  or an older one after `recover()` indexed it); until then store-wide calls list
  every journal, as before the index existed.

The journal is always the truth: an open hint of a run that never started, was
deleted, or has finished is found out when it is read, and a run listed twice is
listed once. Every write is safe to repeat and every crash leaves the run findable:

- crash after the open hint, before the start: the hint names a run that does not
  exist; it is dropped once its writer is known to be gone (see `Sighting`);
- crash after the run finished, before the closed record: the run is still open,
  so `recover()` calls its listeners again and closes it;
- crash between moving closed runs to their status streams and the checkpoint: they
  are moved again, and read once.

A checkpoint is appended at the exact head the compactor read, so it can never drop
an open hint that landed meanwhile.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final, NamedTuple

import attrs

from loom_kernel._coordination._filed import decode_filed
from loom_kernel._coordination._streams import StreamFolds, retained
from loom_kernel._core import ConflictError, LoomError, NewRecord, Record, SchemaError, Status
from loom_kernel._spi import JournalStore

__all__ = ["ENDED", "PARTITIONS", "Closing", "EndedEntry", "OpenHint", "RunIndex", "partition_of"]

#: How many partitions runs are spread over (a hex digit of a hash of the run id).
PARTITIONS: Final = 16
ENDED: Final = (Status.COMPLETED, Status.FAILED, Status.CANCELLED)
_PREFIX: Final = "runs/"
_BUILT: Final = _PREFIX + "built"
_OPEN: Final = "loom.run.open"
_CLOSED: Final = "loom.run.closed"
_CHECKPOINT: Final = "loom.run.checkpoint"
_ENDED_KIND: Final = "loom.run.ended"
#: Closed records a partition holds before a reader compacts it.
_COMPACT_AT: Final = 32
#: Runs an index closes in a partition between two looks of its own at it.
_COMPACT_EVERY: Final = 64

_log = logging.getLogger("loom")


def partition_of(execution_id: str) -> str:
    """The partition of a run: one hex digit of a hash of its id."""
    digest = hashlib.blake2b(execution_id.encode(), digest_size=1).digest()
    return f"{digest[0] % PARTITIONS:x}"


def _open_stream(partition: str) -> str:
    return f"{_PREFIX}open/{partition}"


def _ended_stream(status: Status, partition: str) -> str:
    return f"{_PREFIX}{status.value}/{partition}"


@attrs.frozen
class OpenHint:
    """An open run as its partition lists it.

    Attributes:
        execution_id: the run.
        flow: its flow's name.
        by: the worker that wrote the hint (before the run's first record).
        at: when, by that worker's clock.
        queue: the queue the run was enqueued on, if any (only its workers drive it).
        position: the position of the index record that wrote the hint (0 when not
            known: a checkpoint an older Loom wrote). Two hints of a run are equal
            only when they are one record, so a worker that saw one finds a nudge
            news even when its clock gave both the same `at`.
        started: when the run's first hint was written (a nudge keeps it), just
            before its first record; None when not known (an older Loom's hint).
    """

    execution_id: str
    flow: str
    by: str | None
    at: float
    queue: str | None = None
    position: int = 0
    started: float | None = None


#: What the index keeps of a closed run: when it was closed, its generation (the
#: how-manyth run of its id), when it started (None: not known) and its parent.
Closing = tuple[float, int, float | None, str | None]


class EndedEntry(NamedTuple):
    """An ended run as the index files it (see `RunIndex.ended_entries`): a named
    tuple, as a listing makes one per ended run in the store, with the fields of the
    engine's `RunSummary` in its order (so a listing makes a summary of it as it is)."""

    execution_id: str
    flow: str
    status: Status
    started_at: float | None
    ended_at: float
    waiting_on: None  # an ended run waits on nothing
    parent: str | None
    generation: int


@attrs.define
class _Partition:
    """An open partition as folded up to `head`: the runs it holds open, and the runs
    closed there since its checkpoint (id -> (id, status, flow))."""

    stream: str
    head: int = 0
    open: dict[str, OpenHint] = attrs.Factory(dict)
    closed: dict[str, tuple[str, Status, str]] = attrs.Factory(dict)
    closed_at: dict[str, Closing] = attrs.Factory(dict)

    def copy(self) -> _Partition:
        return _Partition(
            self.stream, self.head, dict(self.open), dict(self.closed), dict(self.closed_at)
        )


def _fold(partition: _Partition, record: Record) -> None:
    _fold_record(record, partition.stream, partition.open, partition.closed, partition.closed_at)


def _dump(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


class RunIndex:
    """Reads and writes the run index of one store."""

    def __init__(self, store: JournalStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        self._built = False
        self._looked = False  # whether a start here has checked for a fresh store
        self._folds = StreamFolds(store, _Partition, _fold)
        self._closes: dict[str, int] = {}  # closed records written here, by partition
        self._closes_lock = threading.Lock()

    # -- writing --------------------------------------------------------------

    def opened(
        self,
        execution_id: str,
        flow: str,
        by: str | None,
        queue: str | None = None,
        *,
        sync: bool = True,
    ) -> None:
        """Hint that a run is about to start: before its first record is appended.

        With `sync` False the hint is appended unsynced (`JournalStore.append`): for
        the hint just before a run's start, which, synced, makes it durable too (and
        without which a hint lost to a power loss named no run).

        The first hint of this index on a store with no run yet marks the store built.
        """
        if not self._looked:
            self._looked = True
            self.built()
        data: dict[str, Any] = {"id": execution_id, "flow": flow, "by": by}
        if queue is not None:
            data["queue"] = queue
        self._add(
            _open_stream(partition_of(execution_id)), NewRecord(_OPEN, _dump(data), 0.0), sync=sync
        )

    def nudged(self, execution_id: str, flow: str) -> None:
        """Hint an open run afresh, so workers that saw it open look at it again (a run
        let go by the worker that held it). It never reopens a run closed before it."""
        data = {"id": execution_id, "flow": flow, "by": None, "nudge": True}
        self._add(_open_stream(partition_of(execution_id)), NewRecord(_OPEN, _dump(data), 0.0))

    def closed(
        self,
        execution_id: str,
        status: Status,
        flow: str,
        generation: int = 1,
        parent: str | None = None,
    ) -> None:
        """Record that a finished run's listeners have all been called.

        Appended unsynced (`JournalStore.append`): a close a power loss takes leaves
        the run open, and the next `recover()` calls its listeners again and closes it,
        as after a crash between the run's end and its close."""
        data: dict[str, Any] = {"id": execution_id, "status": status.value, "flow": flow}
        if generation > 1:
            data["g"] = generation
        if parent is not None:
            data["p"] = parent
        partition = partition_of(execution_id)
        self._add(_open_stream(partition), NewRecord(_CLOSED, _dump(data), 0.0), sync=False)
        with self._closes_lock:
            closes = self._closes[partition] = self._closes.get(partition, 0) + 1
        if closes % _COMPACT_EVERY == 0:
            # The writer compacts as it goes: else a store nobody read since (a web
            # tier that only starts runs) leaves the next reader every hint and close
            # to fold (a first recover() after 100,000 starts took 2 s).
            try:
                self.open_in(partition)
            except LoomError as exc:  # the next reader compacts it
                _log.warning("loom: run index %s not compacted: %s", partition, exc)

    def dropped(self, execution_id: str, generation: int | None = None) -> None:
        """Drop the hint of a run that never started (its writer is gone) or was deleted
        (with `generation`: the id's runs up to it, never a later one closed since)."""
        data: dict[str, Any] = {"id": execution_id, "status": None, "flow": None}
        if generation is not None:
            data["g"] = generation
        self._add(_open_stream(partition_of(execution_id)), NewRecord(_CLOSED, _dump(data), 0.0))

    def _add(self, stream: str, record: NewRecord, *, sync: bool = True) -> None:
        """Append one record wherever the stream's head is now."""
        self._folds.append(
            stream, [NewRecord(record.kind, record.payload, self._clock())], sync=sync
        )

    # -- the built marker -------------------------------------------------------

    def built(self) -> bool:
        """Whether every run of the store is indexed. A store with no run yet is marked
        built on the spot: from then on every start writes its hint."""
        if self._built:
            return True
        if self._store.head(_BUILT) == 0:
            if self._store.streams("ex/", None, 1):
                return False
            self.mark_built()
        self._built = True
        return True

    def mark_built(self) -> None:
        """Mark the store indexed (after every run in it was indexed by a full listing)."""
        if self._store.head(_BUILT) == 0:
            marker = NewRecord("loom.run.built", b"{}", self._clock())
            with contextlib.suppress(ConflictError):  # marked by another engine meanwhile
                self._store.append(_BUILT, 0, [marker])
        self._built = True

    def index_ended(
        self,
        runs: Iterable[tuple[str, Status, str]],
        at: Mapping[str, Closing] | None = None,
        *,
        sync: bool = True,
    ) -> None:
        """File finished runs (id, status, flow) under their status, each with when it
        was closed, its generation, when it started and its parent (`at`, where known:
        retention measures from its close, listings show its times).

        With `sync` False the batches are appended unsynced (`JournalStore.append`):
        for a compaction, whose checkpoint, appended synced right after, makes them
        durable too (a power loss before it loses both, and the partition still holds
        the runs closed, to be moved again)."""
        by_stream: dict[str, list[list[Any]]] = {}
        for execution_id, status, flow in runs:
            stream = _ended_stream(status, partition_of(execution_id))
            entry: list[Any] = [execution_id, flow]
            if at is not None and execution_id in at:
                entry.extend(at[execution_id])
            by_stream.setdefault(stream, []).append(entry)
        for stream, batch in sorted(by_stream.items()):
            self._add(stream, NewRecord(_ENDED_KIND, _dump({"runs": batch}), 0.0), sync=sync)

    # -- reading ----------------------------------------------------------------

    def open_runs(self, partitions: Iterable[str] | None = None) -> Iterator[OpenHint]:
        """The runs the index holds open, partition by partition (compacting a
        partition that holds many closed runs as it goes)."""
        for partition in partitions if partitions is not None else self.partitions():
            yield from self.open_in(partition)[1]

    def open_in(self, partition: str) -> tuple[int, list[OpenHint]]:
        """One partition's head as read, and the runs it holds open (compacting it when
        it holds many closed runs)."""
        stream = _open_stream(partition)
        with self._folds.holding(stream):
            found = self._folds.refresh(stream)
            if len(found.closed) >= _COMPACT_AT:
                self._compact(found)
            return found.head, list(found.open.values())

    def head(self, partition: str) -> int:
        """A partition's head: it moves whenever a run is opened or closed there."""
        return self._store.head(_open_stream(partition))

    @staticmethod
    def partitions() -> list[str]:
        """Every partition's name."""
        return [f"{number:x}" for number in range(PARTITIONS)]

    def ended(self, status: Status) -> Iterator[tuple[str, str]]:
        """(id, flow) of the runs filed as ended with `status`; may repeat an id, and
        omits runs ended but not yet moved out of their open partition."""
        for partition in self.partitions():
            stream = _ended_stream(status, partition)
            for record in retained(self._store, stream) or []:
                yield from ((str(e[0]), str(e[1])) for e in _entries(record, stream))

    def ended_entries(self) -> Iterator[EndedEntry]:
        """Every ended run the index files, with its times and parent: the entries of
        the status streams, then the runs closed but not moved yet. An id may repeat
        (a run filed twice, or two runs of one id); an entry an older Loom filed has
        no start time or parent (None) and gives the time it was filed as its end."""
        new = tuple.__new__  # EndedEntry's own __new__ costs a Python call a run
        for partition in self.partitions():
            for status in ENDED:
                stream = _ended_stream(status, partition)
                for record in retained(self._store, stream) or []:
                    filed = decode_filed(record.payload)
                    if filed is None:  # no msgspec, or a batch only the checks can judge
                        for entry in _entries(record, stream):
                            yield _ended_entry(entry, status, record.timestamp)
                        continue
                    filed_at = record.timestamp
                    for run in filed:
                        at = filed_at if math.isnan(run.at) else run.at
                        yield new(
                            EndedEntry,
                            (
                                run.id,
                                run.flow,
                                status,
                                run.started,
                                at,
                                None,
                                run.parent,
                                run.generation,
                            ),
                        )
            found = self._folds.read(_open_stream(partition))
            for execution_id, status, flow in found.closed.values():
                at, generation, started, parent = found.closed_at.get(
                    execution_id, (self._clock(), 1, None, None)
                )
                yield EndedEntry(execution_id, flow, status, started, at, None, parent, generation)

    def ended_in(self, partition: str) -> Iterator[tuple[str, Status, float, int]]:
        """(id, status, when it was closed, generation) of the runs one partition files
        as ended:
        in its status streams and closed in its open partition. An id may repeat (a
        run filed twice, or two runs of one id: one deleted, one ended since); an
        entry an older Loom filed gives the time it was filed, later than its close.
        """
        for status in ENDED:
            stream = _ended_stream(status, partition)
            for record in retained(self._store, stream) or []:
                for entry in _entries(record, stream):
                    at = float(entry[2]) if len(entry) > 2 else record.timestamp
                    yield str(entry[0]), status, at, int(entry[3]) if len(entry) > 3 else 1
        found = self._folds.read(_open_stream(partition))
        for execution_id, status, _flow in found.closed.values():
            at, generation, _started, _parent = found.closed_at.get(
                execution_id, (self._clock(), 1, None, None)
            )
            yield execution_id, status, at, generation

    def forget(self, partition: str, runs: Mapping[str, int]) -> None:
        """Drop runs (id -> generation) from one partition's status streams (retention
        deleted them): the entries of each id up to that generation, never a later
        run's. Each stream is rewritten as one batch at the exact head read, and
        trimmed below it; runs still closed in the open partition are dropped there."""
        found = self._folds.read(_open_stream(partition))
        for execution_id in runs.keys() & found.closed.keys():
            self.dropped(execution_id, runs[execution_id])
        for status in ENDED:
            stream = _ended_stream(status, partition)
            while True:
                records = retained(self._store, stream) or []
                entries = [e for r in records for e in _entries(r, stream)]
                kept = [e for e in entries if not _forgotten(e, runs)]
                if len(kept) == len(entries):
                    break
                batch = NewRecord(_ENDED_KIND, _dump({"runs": kept}), self._clock())
                try:
                    head = self._store.append(stream, records[-1].position, [batch])
                except ConflictError:
                    continue  # runs were filed meanwhile: read them too
                self._store.trim(stream, head)
                break

    def closed_runs(self) -> Iterator[tuple[str, Status, str]]:
        """(id, status, flow) of runs closed but not yet moved to their status streams."""
        for partition in self.partitions():
            yield from self._folds.read(_open_stream(partition)).closed.values()

    def rebuild(
        self,
        open_runs: Iterable[OpenHint],
        ended: dict[str, tuple[str, Status, str]],
        ended_at: Mapping[str, Closing] | None = None,
    ) -> None:
        """Bring the index up to what a full listing of the journals found.

        `open_runs` are the runs the listing found unfinished, `ended` the finished
        ones (id -> (id, status, flow)), already filed under their status. A readable
        partition only gains records: a hint for each open run it lacks, a `closed`
        record for each ended run it still holds open; nothing in it is dropped (a
        hint whose start is still on its way, or a run closed meanwhile, stays as it
        is). A partition with a damaged record is rewritten: its readable records are
        folded, the runs they close filed under their status, and a checkpoint of the
        runs open in them or in the listing is appended at the exact head read, so
        everything below it, the damaged record too, is trimmed off.
        """
        by_partition: dict[str, dict[str, OpenHint]] = {p: {} for p in self.partitions()}
        for hint in open_runs:
            by_partition[partition_of(hint.execution_id)][hint.execution_id] = hint
        for partition, hints in by_partition.items():
            stream = _open_stream(partition)
            while True:
                head = self._store.head(stream)
                opened, closed, damaged = _fold_readable(
                    stream, retained(self._store, stream) or []
                )
                if not damaged:
                    for execution_id, hint in hints.items():
                        if execution_id not in opened:
                            self.opened(execution_id, hint.flow, hint.by)
                    for execution_id in opened:
                        if execution_id in ended:
                            _id, status, flow = ended[execution_id]
                            closing = (ended_at or {}).get(execution_id, (0.0, 1, None, None))
                            self.closed(execution_id, status, flow, closing[1], closing[3])
                    break
                self.index_ended(closed.values(), ended_at, sync=False)
                merged = {**opened, **hints}
                body = {"open": [_hint_data(h) for i, h in merged.items() if i not in ended]}
                checkpoint = NewRecord(_CHECKPOINT, _dump(body), self._clock())
                try:
                    new_head = self._store.append(stream, head, [checkpoint])
                except ConflictError:
                    continue  # a run opened or closed meanwhile: fold it in too
                self._store.trim(stream, new_head)
                break

    def _compact(self, found: _Partition) -> None:
        """Move closed runs to their status streams, then checkpoint and trim (a run
        opened or closed meanwhile: compacted on a later read)."""
        try:
            self.index_ended(found.closed.values(), found.closed_at, sync=False)
            hints = [_hint_data(hint) for hint in found.open.values()]
            record = NewRecord(_CHECKPOINT, _dump({"open": hints}), self._clock())
            self._folds.checkpoint(found.stream, found, record)
        except LoomError as exc:  # the partition stays as it was; a later read compacts it
            _log.warning("loom: run index %s not compacted: %s", found.stream, exc)


def _generation_of(data: dict[str, Any]) -> int:
    generation = data.get("g", 1)
    _check_generation(generation)
    return int(generation)


def _check_generation(generation: object) -> None:
    if type(generation) is not int or generation < 1:
        raise TypeError(f"a generation is an int >= 1, not {generation!r}")


def _forgotten(entry: list[Any], runs: Mapping[str, int]) -> bool:
    upto = runs.get(str(entry[0]))
    return upto is not None and (int(entry[3]) if len(entry) > 3 else 1) <= upto


def _ended_entry(entry: list[Any], status: Status, filed_at: float) -> EndedEntry:
    at = float(entry[2]) if len(entry) > 2 else filed_at
    generation = int(entry[3]) if len(entry) > 3 else 1
    started = None if len(entry) <= 4 or entry[4] is None else float(entry[4])
    parent = None if len(entry) <= 5 else entry[5]
    return EndedEntry(str(entry[0]), str(entry[1]), status, started, at, None, parent, generation)


def _entries(record: Record, stream: str) -> list[list[Any]]:
    """The entries of a status stream's batch: [id, flow], then, where known, when it
    was closed, its generation, when it started and its parent."""
    try:
        entries = json.loads(record.payload)["runs"]
        for entry in entries:
            if not isinstance(entry[0], str) or not isinstance(entry[1], str):
                raise TypeError("an entry is [id, flow, ...]")
            size = len(entry)
            if size > 2:
                float(entry[2])
                if size > 3:
                    _check_generation(entry[3])
                    if size > 4 and entry[4] is not None:
                        float(entry[4])
                    if size > 5 and not (entry[5] is None or isinstance(entry[5], str)):
                        raise TypeError("an entry's parent is a str or null")
        return list(entries)
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
        raise _damaged(record, exc, stream) from None


def _hint_data(hint: OpenHint) -> dict[str, Any]:
    data = {
        "id": hint.execution_id,
        "flow": hint.flow,
        "by": hint.by,
        "at": hint.at,
        "position": hint.position,
    }
    if hint.started is not None:
        data["started"] = hint.started
    if hint.queue is not None:
        data["queue"] = hint.queue
    return data


def _queue_of(data: dict[str, Any]) -> str | None:
    queue = data.get("queue")
    if queue is not None and not isinstance(queue, str):
        raise TypeError(f"a hint's queue is a str, not {queue!r}")
    return queue


def _fold_readable(
    stream: str, records: list[Record]
) -> tuple[dict[str, OpenHint], dict[str, tuple[str, Status, str]], bool]:
    """Fold what can be read of a partition: (open runs, closed runs, whether any record
    was damaged). With a damaged record, it is skipped, and a checkpoint never empties
    what the records before it opened, so the open runs are a superset of the truth."""
    found = _Partition(stream)
    try:
        for record in records:
            _fold(found, record)
    except SchemaError:
        pass
    else:
        return found.open, found.closed, False
    opened: dict[str, OpenHint] = {}
    closed: dict[str, tuple[str, Status, str]] = {}
    damaged = False
    for record in records:
        if record.kind == _CHECKPOINT:
            before = dict(opened)
            try:
                _fold_record(record, stream, opened, closed)
            except SchemaError:
                damaged = True
            opened.update({i: h for i, h in before.items() if i not in closed})
            continue
        try:
            _fold_record(record, stream, opened, closed)
        except SchemaError:
            damaged = True
    return opened, closed, damaged


def _fold_record(
    record: Record,
    stream: str,
    opened: dict[str, OpenHint],
    closed: dict[str, tuple[str, Status, str]],
    closed_at: dict[str, Closing] | None = None,
) -> None:
    """Fold one partition record into the open and closed runs.

    Raises:
        SchemaError: the record is damaged.
    """
    try:
        data = json.loads(record.payload)
        if record.kind == _CHECKPOINT:
            opened.clear()
            closed.clear()
            if closed_at is not None:
                closed_at.clear()
            for item in data["open"]:
                hint = OpenHint(
                    str(item["id"]),
                    str(item["flow"]),
                    item["by"],
                    float(item["at"]),
                    _queue_of(item),
                    _position_of(item),
                    _started_of(item),
                )
                opened[hint.execution_id] = hint
        elif record.kind == _OPEN:
            execution_id = str(data["id"])
            nudge = data.get("nudge") is True
            if nudge and execution_id not in opened:
                return  # the run closed (or was dropped) before the nudge: it stays so
            opened[execution_id] = OpenHint(
                execution_id,
                str(data["flow"]),
                data["by"],
                record.timestamp,
                _queue_of(data),
                record.position,
                opened[execution_id].started if nudge else record.timestamp,
            )
            closed.pop(execution_id, None)
            if closed_at is not None:
                closed_at.pop(execution_id, None)
        elif record.kind == _CLOSED:
            execution_id = str(data["id"])
            if data["status"] is None and "g" in data:  # runs up to g deleted: unfiled
                upto = _generation_of(data)
                if (
                    closed_at is None
                    or closed_at.get(execution_id, (0.0, 1, None, None))[1] <= upto
                ):
                    closed.pop(execution_id, None)
                    if closed_at is not None:
                        closed_at.pop(execution_id, None)
                return  # a later run of the id, open now, stays open
            was_open = opened.pop(execution_id, None)
            if data["status"] is None:  # a dropped hint: filed nowhere
                return
            closed[execution_id] = (execution_id, Status(data["status"]), str(data["flow"]))
            if closed_at is not None:
                parent = data.get("p")
                if not (parent is None or isinstance(parent, str)):
                    raise TypeError(f"a closed run's parent is a str, not {parent!r}")
                started = None if was_open is None else was_open.started
                closed_at[execution_id] = (record.timestamp, _generation_of(data), started, parent)
        else:
            raise ValueError(f"unknown kind {record.kind!r}")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise _damaged(record, exc, stream) from None


def _started_of(data: dict[str, Any]) -> float | None:
    started = data.get("started")  # absent: a checkpoint an older Loom wrote
    return None if started is None else float(started)


def _position_of(data: dict[str, Any]) -> int:
    position = data.get("position", 0)  # 0: a checkpoint an older Loom wrote
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise TypeError(f"a hint's position is an int >= 0, not {position!r}")
    return position


def _damaged(record: Record, exc: Exception, stream: str | None = None) -> SchemaError:
    return SchemaError(
        f"damaged run index record ({type(exc).__name__}: {exc}); the journals are the "
        "truth: recover() lists them and rewrites the index",
        kind=record.kind,
        stream=stream,
        position=record.position,
    )
