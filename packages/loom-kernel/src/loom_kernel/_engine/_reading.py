"""Reading: what a run is now (its view, state, steps and history), which runs a store
holds (listed through the run index), and what a run published.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from operator import itemgetter
from types import MappingProxyType
from typing import Any, Final

from loom_kernel._coordination import (
    ENDED,
    execution_ids,
    first_timestamp,
    last_record,
)
from loom_kernel._core import (
    EXECUTION_PREFIX,
    ExecutionNotFoundError,
    ExecutionState,
    InvalidArgumentError,
    InvalidIdError,
    SchemaError,
    Status,
    StepFrame,
    StreamDeletedError,
    TrimmedError,
    check_gapless,
    decode_events,
    event_key_refusal,
    finite_number,
    is_name,
    stream_of,
    validate_prefix,
)
from loom_kernel._engine._driver import Driver
from loom_kernel._engine._views import (
    Execution,
    HistoryEntry,
    InboxMessage,
    RunSummary,
    SentKey,
)
from loom_kernel._replay import consumed_positions

__all__ = ["EventLooks", "Reading"]

logger = logging.getLogger("loom")

#: A run as a listing holds it until it is returned: `RunSummary`'s fields, in order.
_Row = tuple[str, str, Status, float | None, float | None, str | None, str | None, int]
_ID: Final = itemgetter(0)


def _newest_first(row: _Row) -> float:
    """A sort key: the later a run started the smaller; a run of no known start last."""
    began = row[3]
    return math.inf if began is None else -began


class Reading:
    """Reads the runs of one engine's store."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    def state(self, execution_id: str) -> ExecutionState:
        """See `Engine.state`."""
        copy: ExecutionState = self._driver.view(execution_id, ExecutionState.copy)
        return copy

    def frames(self, execution_id: str) -> Mapping[int, StepFrame]:
        """See `Engine.frames`."""
        frames: Mapping[int, StepFrame] = self._driver.view(
            execution_id, lambda state: MappingProxyType(dict(state.steps))
        )
        return frames

    def history(self, execution_id: str) -> list[HistoryEntry]:
        """See `Engine.history`."""
        store = self._driver.store
        stream = stream_of(execution_id)
        after = 0
        try:
            try:
                records = store.read(stream)
            except TrimmedError as exc:
                after = exc.floor
                records = store.read(stream, after)
        except StreamDeletedError:
            raise ExecutionNotFoundError(f"execution {execution_id!r} was deleted") from None
        if not records:
            raise ExecutionNotFoundError(f"no execution with id {execution_id!r}")
        check_gapless(records, after, stream)
        events = decode_events(records, stream)
        return [
            HistoryEntry(r.position, r.timestamp, e) for r, e in zip(records, events, strict=True)
        ]

    def listing(
        self,
        prefix: str,
        status: Status | str | Iterable[Status | str] | None,
        flow: str | None,
        unreadable: Callable[[str, SchemaError], None] | None = None,
    ) -> Iterator[Execution]:
        """`Engine.executions`; with `unreadable`, a run whose journal cannot be folded
        is handed to it and the listing goes on (`loom ls`)."""
        wanted = _statuses(status)
        if wanted is None and flow is None:
            ids: Iterable[str] = execution_ids(self._driver.store, prefix)
        else:
            ids = self._indexed_ids(prefix, wanted, flow)
        for execution_id in ids:
            try:
                execution = self._driver.execution(execution_id)
            except ExecutionNotFoundError:
                continue
            except SchemaError as exc:
                if unreadable is None:
                    raise
                unreadable(execution_id, exc)
                continue
            if (wanted is None or execution.status in wanted) and (
                flow is None or execution.flow == flow
            ):
                yield execution

    def runs(
        self,
        prefix: str,
        *,
        status: Status | str | Iterable[Status | str] | None,
        flow: str | None,
        since: float | datetime | None,
        limit: int | None,
        unreadable: Callable[[str, SchemaError], None] | None = None,
    ) -> list[RunSummary]:
        """`Engine.runs`; with `unreadable`, an open run whose journal cannot be folded
        is handed to it and the listing goes on (`loom ls`)."""
        wanted = _statuses(status)
        if not isinstance(prefix, str):
            raise InvalidIdError(prefix, "an execution id prefix is a str")
        validate_prefix(EXECUTION_PREFIX + prefix)
        moment = _moment(since)
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 0
        ):
            raise InvalidArgumentError(f"limit is an int >= 0 or None, not {limit!r}")
        rows = self._summaries(prefix, wanted is None or bool(wanted - set(ENDED)), unreadable)
        if wanted is not None or flow is not None or moment is not None:
            rows = [
                row
                for row in rows
                if (wanted is None or row[2] in wanted)
                and (flow is None or row[1] == flow)
                and (moment is None or (row[3] is not None and row[3] >= moment))
            ]
        # Newest start first, runs of no known start last, ties by id: two sorts, each
        # by a key cheaper than one tuple made per run (the sort is stable).
        rows.sort(key=_ID)
        rows.sort(key=_newest_first)
        return [RunSummary(*row) for row in (rows if limit is None else rows[:limit])]

    def _summaries(
        self,
        prefix: str,
        open_wanted: bool,
        unreadable: Callable[[str, SchemaError], None] | None,
    ) -> list[_Row]:
        """Every run whose id starts with `prefix`, as a row of `RunSummary`'s fields:
        an ended run as the run index files it, an open one (and every run of a store
        not indexed yet) from its journal."""
        driver = self._driver
        runs = driver.runs
        try:
            indexed = runs.built()
            ended: dict[str, _Row] = {}
            started: dict[str, float | None] = {}
            if indexed:
                for entry in runs.ended_entries():
                    execution_id = entry[0]
                    if prefix and not execution_id.startswith(prefix):
                        continue
                    known = ended.setdefault(execution_id, entry)
                    if known is not entry and known[7] <= entry[7]:  # the later generation
                        ended[execution_id] = entry
                for hint in runs.open_runs():
                    if hint.execution_id.startswith(prefix):
                        started[hint.execution_id] = hint.started
        except SchemaError as exc:
            logger.warning("loom: %s; listing every journal instead", exc)
            indexed = False
        if not indexed:
            ended, started = {}, dict.fromkeys(execution_ids(driver.store, prefix))
        for execution_id in started.keys() & ended.keys():
            del ended[execution_id]  # open again (a later run of the id): its journal tells
        rows = list(ended.values())
        for number, row in enumerate(rows):
            if row[3] is None:  # filed by an older Loom: its first record tells
                began = first_timestamp(driver.store, stream_of(row[0]))
                rows[number] = (*row[:3], began, *row[4:])
        for execution_id, began in started.items():
            summary = self._summary_of(execution_id, began, unreadable)
            if summary is not None and (open_wanted or summary[2].finished):
                rows.append(summary)
        return rows

    def _summary_of(
        self,
        execution_id: str,
        began: float | None,
        unreadable: Callable[[str, SchemaError], None] | None,
    ) -> _Row | None:
        """A run as its journal tells it; None when there is no such run."""
        driver = self._driver
        try:
            execution = driver.execution(execution_id)
        except ExecutionNotFoundError:
            return None
        except SchemaError as exc:
            if unreadable is None:
                raise
            unreadable(execution_id, exc)
            return None
        stream = stream_of(execution_id)
        if began is None:
            began = first_timestamp(driver.store, stream)
        ended_at = None
        if execution.status.finished:
            last = last_record(driver.store, stream)
            ended_at = None if last is None else last.timestamp
        return (
            execution.id,
            execution.flow,
            execution.status,
            began,
            ended_at,
            execution.waiting_on,
            execution.parent,
            execution.generation,
        )

    def _indexed_ids(
        self, prefix: str, wanted: frozenset[Status] | None, flow: str | None
    ) -> Iterable[str]:
        """The ids that may match, from the run index (every id, when it is not built
        or is damaged)."""
        if not isinstance(prefix, str):
            raise InvalidIdError(prefix, "an execution id prefix is a str")
        validate_prefix(EXECUTION_PREFIX + prefix)
        store, runs = self._driver.store, self._driver.runs
        try:
            if not runs.built():
                return execution_ids(store, prefix)
            found: set[str] = set()
            for hint in runs.open_runs():
                if flow is None or hint.flow == flow:
                    found.add(hint.execution_id)
            for execution_id, ended_as, ended_flow in runs.closed_runs():
                if (wanted is None or ended_as in wanted) and (flow is None or ended_flow == flow):
                    found.add(execution_id)
            for ended_as in ENDED:
                if wanted is not None and ended_as not in wanted:
                    continue
                for execution_id, ended_flow in runs.ended(ended_as):
                    if flow is None or ended_flow == flow:
                        found.add(execution_id)
        except SchemaError as exc:
            logger.warning("loom: %s; listing every journal instead", exc)
            return execution_ids(store, prefix)
        return sorted(execution_id for execution_id in found if execution_id.startswith(prefix))

    def event_looks(self, execution_id: str, key: str, timeout: float | None) -> EventLooks:
        """The looks of a `get_event`, its arguments checked."""
        stream_of(execution_id)
        if not is_name(key):
            raise InvalidArgumentError(event_key_refusal(key))
        if timeout is not None and (not finite_number(timeout) or timeout < 0):
            raise InvalidArgumentError(f"a timeout is a number of seconds >= 0, not {timeout!r}")
        generation = self._driver.view(execution_id, _generation)  # an unknown run: refused
        return EventLooks(self._driver, execution_id, key, timeout, generation)

    def get_event(self, execution_id: str, key: str, timeout: float | None) -> Any:
        """See `Engine.get_event`."""
        looks = self.event_looks(execution_id, key, timeout)
        while True:
            pause, value = looks.look()
            if pause is None:
                return value
            time.sleep(pause)

    def inbox(self, execution_id: str) -> list[InboxMessage]:
        """See `Engine.inbox`."""
        keys, generation = self._driver.view(execution_id, _resume_keys)
        consumed = consumed_positions(keys)
        with _deletion_told(self._driver, execution_id):
            messages = self._driver.inbox.messages(execution_id, generation)
        return [
            InboxMessage(m.position, m.topic, m.key, m.message, m.sent_at, m.position in consumed)
            for m in messages
        ]

    def inbox_keys(self, execution_id: str) -> dict[str, SentKey]:
        """See `Engine.inbox_keys`."""
        keys, generation = self._driver.view(execution_id, _resume_keys)
        consumed = consumed_positions(keys)
        with _deletion_told(self._driver, execution_id):
            sent = self._driver.inbox.keys(execution_id, generation)
        return {key: SentKey(position, position in consumed) for key, position in sent.items()}

    def get_events(self, execution_id: str) -> dict[str, Any]:
        """See `Engine.get_events`."""
        generation = self._driver.view(execution_id, _generation)
        with _deletion_told(self._driver, execution_id):
            return self._driver.published.values(execution_id, generation)


class EventLooks:
    """A `get_event`'s looks at what a run published: each says how long to wait
    before the next, or (None, the value) once the wait is over."""

    def __init__(
        self, driver: Driver, execution_id: str, key: str, timeout: float | None, generation: int
    ) -> None:
        self._driver = driver
        self._id = execution_id
        self._generation = generation
        self._key = key
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._pause = 0.005

    def look(self) -> tuple[float | None, Any]:
        driver, execution_id, generation = self._driver, self._id, self._generation
        with _deletion_told(driver, execution_id):
            values = driver.published.values(execution_id, generation)
        if self._key in values:
            return None, values[self._key]
        left = 0.0 if self._deadline is None else self._deadline - time.monotonic()
        if left <= 0:
            return None, None
        with contextlib.suppress(ExecutionNotFoundError):
            if driver.view(execution_id, lambda state: state.status.finished):
                with _deletion_told(driver, execution_id):
                    values = driver.published.values(execution_id, generation)
                return None, values.get(self._key)
        pause = min(self._pause, left)
        self._pause = min(self._pause * 2, 0.25)
        return pause, None


def _generation(state: ExecutionState) -> int:
    """A look at a run that says which of its id's runs it is (and that it exists:
    its checkout raises if it does not)."""
    return state.generation


def _resume_keys(state: ExecutionState) -> tuple[list[str], int]:
    return list(state.resume_keys), state.generation


def _statuses(status: Status | str | Iterable[Status | str] | None) -> frozenset[Status] | None:
    """The statuses asked for, validated."""
    if status is None:
        return None
    items = [status] if isinstance(status, str) else list(status)
    try:
        return frozenset(Status(item) for item in items)
    except ValueError:
        known = ", ".join(member.value for member in Status)
        raise InvalidArgumentError(f"a status is one of {known}, not {status!r}") from None


@contextlib.contextmanager
def _deletion_told(driver: Driver, execution_id: str) -> Iterator[None]:
    """A run's stream found deleted: ExecutionNotFoundError when retention deleted the
    run meanwhile (its view says so), else the StreamDeletedError as it is (a stream
    deleted by other means is an error, never an empty answer)."""
    try:
        yield
    except StreamDeletedError:
        driver.view(execution_id, _generation)
        raise


def _moment(since: object) -> float | None:
    """`since` as Unix seconds: a number of them, or an aware datetime."""
    if since is None:
        return None
    if isinstance(since, datetime):
        if since.tzinfo is None:
            raise InvalidArgumentError(
                f"since is an aware datetime (with a tzinfo) or Unix seconds, not {since!r}"
            )
        return since.timestamp()
    if not finite_number(since):
        raise InvalidArgumentError(f"since is Unix seconds or an aware datetime, not {since!r}")
    return float(since)  # type: ignore[arg-type]
