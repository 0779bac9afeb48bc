"""Retention: which ended runs a store keeps, and the sweep that deletes the rest.

A sweep walks the run index partition by partition (16 of them), so it holds one
partition's ended runs at a time however many the store has. A run is deleted only
when its journal, read at the sweep, shows it ended (completed, failed or cancelled)
and it is past its retention: ended longer ago than `keep_for` (the time of its
journal's last record) or older than the newest `keep_last` ended runs (by when the
index filed them as closed). A run whose parent has not ended is kept: the parent
may still await it. The deletion itself is `delete_ended` (see its module for the
order a crash cannot break).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Final

import attrs

from loom_kernel._coordination import delete_ended, finish_deletion, last_record, load
from loom_kernel._core import (
    ConflictError,
    ExecutionNotFoundError,
    ExecutionState,
    InvalidArgumentError,
    LoomError,
    finite_number,
    stream_of,
)
from loom_kernel._engine._driver import Driver

__all__ = ["Retention", "RetentionSweep", "Sweeper"]

logger = logging.getLogger("loom")

#: How often a worker sweeps, by default (seconds).
DEFAULT_EVERY: Final = 300.0


def _seconds(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if not finite_number(value) or value < 0:  # type: ignore[operator]
        raise InvalidArgumentError(
            f"keep_for is a number of seconds >= 0 or a timedelta, not {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def _count(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"keep_last is a whole number >= 0, not {value!r}")
    return value


def _every(value: object) -> float:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if not finite_number(value) or value <= 0:  # type: ignore[operator]
        raise InvalidArgumentError(f"every is a number of seconds above 0, not {value!r}")
    return float(value)  # type: ignore[arg-type]


@attrs.frozen
class Retention:
    """How long a store keeps ended runs (`Engine(..., retention=...)`, `loom gc`).

    A run is deleted once it ended longer ago than `keep_for` or is not among the
    newest `keep_last` ended runs, whichever comes first; a running, parked or queued
    run never is, nor a child whose parent has not ended. At least one of the two.

    Args:
        keep_for: seconds (or a timedelta) after its end that a run is kept.
        keep_last: how many of the newest ended runs are kept.
        every: how often each worker sweeps (seconds or a timedelta).
        batch: the most runs one sweep deletes (a worker's next sweep goes on).
    """

    keep_for: float | None = attrs.field(default=None, converter=_seconds)
    keep_last: int | None = attrs.field(default=None, converter=_count)
    every: float = attrs.field(default=DEFAULT_EVERY, converter=_every)
    batch: int = attrs.field(default=1000)

    def __attrs_post_init__(self) -> None:
        if self.keep_for is None and self.keep_last is None:
            raise InvalidArgumentError(
                "a retention keeps runs for a time (keep_for), or "
                "the newest few (keep_last), or both"
            )
        batch = self.batch
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise InvalidArgumentError(f"batch is a whole number >= 1, not {batch!r}")


@attrs.frozen
class RetentionSweep:
    """What one sweep did (or, with `dry_run`, would do).

    Attributes:
        deleted: the runs it deleted, in the order it deleted them.
        finished: runs an interrupted deletion had left, whose deletion it finished.
        kept: ended runs it looked at and kept (within their retention, or a child
            whose parent has not ended).
        more: whether it stopped at its batch with more to delete.
        dry_run: whether it only said what it would delete.
    """

    deleted: tuple[str, ...]
    finished: tuple[str, ...]
    kept: int
    more: bool
    dry_run: bool


class Sweeper:
    """Sweeps one engine's store."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    def sweep(self, retention: Retention, *, dry_run: bool = False) -> RetentionSweep:
        """Delete the ended runs past `retention`, at most `retention.batch` of them."""
        driver = self._driver
        runs = driver.runs
        if not runs.built():
            logger.warning("loom: the run index is not built yet (recover() builds it): no sweep")
            return RetentionSweep((), (), 0, False, dry_run)
        now = driver.clock()
        cutoff = None if retention.keep_for is None else now - retention.keep_for
        newest = self._newest(retention.keep_last)
        deleted: list[str] = []
        finished: list[str] = []
        kept = 0
        for partition in runs.partitions():
            if not dry_run:
                # Runs closed in the open partition move to their status streams first
                # (a compaction, as every worker's look makes), so the open partition
                # holds few whatever a store ended since.
                runs.open_in(partition)
            gone: dict[str, int] = {}  # id -> the generation whose entries go
            for execution_id, (generation, at) in _latest_entries(runs.ended_in(partition)):
                if len(deleted) >= retention.batch:
                    break
                by_count = newest is not None and (at, execution_id) < newest
                by_time = cutoff is not None and at < cutoff
                if not by_count and not by_time:
                    kept += 1
                    continue
                judged = None if by_count else cutoff
                outcome = self._judge(execution_id, generation, judged, dry_run)
                if outcome == "deleted":
                    deleted.append(execution_id)
                elif outcome == "finished":
                    finished.append(execution_id)
                elif outcome == "kept":
                    kept += 1
                if outcome != "kept":
                    gone[execution_id] = generation
            if gone and not dry_run:
                runs.forget(partition, gone)
            if len(deleted) >= retention.batch:
                return RetentionSweep(tuple(deleted), tuple(finished), kept, True, dry_run)
        return RetentionSweep(tuple(deleted), tuple(finished), kept, False, dry_run)

    def _newest(self, keep_last: int | None) -> tuple[float, str] | None:
        """The oldest of the newest `keep_last` ended runs, as (closed at, id): runs
        ordered before it are beyond them. None when every ended run is kept by count.
        """
        if keep_last is None:
            return None
        if keep_last == 0:
            return (float("inf"), "")
        runs = self._driver.runs
        kept: list[tuple[float, str]] = []  # a min-heap of the newest seen so far
        for partition in runs.partitions():
            for execution_id, (_generation, at) in _latest_entries(runs.ended_in(partition)):
                if len(kept) < keep_last:
                    heapq.heappush(kept, (at, execution_id))
                elif (at, execution_id) > kept[0]:
                    heapq.heapreplace(kept, (at, execution_id))
        return kept[0] if len(kept) == keep_last else None

    def _judge(
        self, execution_id: str, generation: int, cutoff: float | None, dry_run: bool
    ) -> str:
        """Delete run `generation` of an id if its journal says it may go: "deleted",
        "finished" (an interrupted deletion of it finished), "stale" (the index names a
        run that is not there: never started, or deleted since, a later run of the id
        maybe started), or "kept"."""
        driver = self._driver
        store = driver.store
        try:
            state = load(store, execution_id, None, deleted=True)
        except ExecutionNotFoundError:
            return "stale"  # never started, or its journal's name was retired
        except LoomError as exc:
            logger.warning("loom: retention skips %s: %s", execution_id, exc)
            return "kept"
        if state.generation > generation:  # that run was deleted
            if state.deleted and state.generation == generation + 1:
                if not dry_run:
                    finish_deletion(store, state, driver.clock)
                return "finished"
            return "stale"  # and a later run of the id started: filed when it ends
        if state.deleted or state.generation < generation or not state.status.finished:
            return "kept"  # not what the index says (a damaged entry): left alone
        if cutoff is not None and _ended_at(driver, state) >= cutoff:
            return "kept"
        if state.parent is not None and not self._parent_ended(state.parent):
            return "kept"
        if dry_run:
            return "deleted"
        try:
            delete_ended(store, state, driver.clock)
        except ConflictError:
            return "kept"  # the journal moved meanwhile: the next sweep looks again
        driver.cache.drop(execution_id)
        logger.info("loom: %s deleted (retention)", execution_id)
        return "deleted"

    def _parent_ended(self, parent: str) -> bool:
        """Whether a child's parent no longer awaits it: ended, deleted or absent."""
        try:
            state = load(self._driver.store, parent, None, deleted=True)
        except ExecutionNotFoundError:
            return True
        return state.deleted or state.status.finished


def _ended_at(driver: Driver, state: ExecutionState) -> float:
    """When an ended run ended: the time of its journal's last record."""
    record = last_record(driver.store, stream_of(state.id))
    return float("inf") if record is None else record.timestamp


def _latest_entries(
    entries: Iterator[tuple[str, object, float, int]],
) -> list[tuple[str, tuple[int, float]]]:
    """One (id, (generation, closed at)) per id, its latest run's, in id order."""
    latest: dict[str, tuple[int, float]] = {}
    for execution_id, _status, at, generation in entries:
        if (generation, at) > latest.get(execution_id, (0, float("-inf"))):
            latest[execution_id] = (generation, at)
    return sorted(latest.items())
