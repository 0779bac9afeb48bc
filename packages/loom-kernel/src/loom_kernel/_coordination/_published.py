"""Published progress: values a run sets by key, readable without its journal.

`events/<execution id>` holds one record per `ctx.set_event(key, value)`; the latest
record of a key is its value. The run writes the record first and then journals the
call as a recorded step, so a crash in between publishes the same value again on
the re-drive (the flow computes it from the same journal), and a replay publishes
nothing.

Superseded values are compacted: once the stream holds more than twice as many
records as keys (and at least `_COMPACT_AT`), the writer appends a checkpoint of every
key's value at the exact head it folded and trims below it, so a reader that comes
later reads what is current, not every value ever set (from 1.21.0; an older reader
refuses the checkpoint's kind).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

import attrs

from loom_kernel._coordination._streams import StreamFolds
from loom_kernel._core import EVENTS_PREFIX, NewRecord, Record, SchemaError, events_stream
from loom_kernel._spi import JournalStore

__all__ = ["EVENTS_PREFIX", "Published"]

EVENT_KIND: Final = "loom.event"
CHECKPOINT_KIND: Final = "loom.event.checkpoint"
#: Records a stream holds before its writer compacts it (and twice its keys at least).
_COMPACT_AT: Final = 64
#: Runs whose published values a reader keeps (the least recently used go first).
_KEPT: Final = 1024


@attrs.define
class _Values:
    """A run's published values as folded up to `head`: each key's latest."""

    stream: str
    head: int = 0
    values: dict[str, Any] = attrs.Factory(dict)
    records: int = 0  # folded since the stream's checkpoint (or start)

    def copy(self) -> _Values:
        return _Values(self.stream, self.head, dict(self.values), self.records)


def _fold(values: _Values, record: Record) -> None:
    try:
        data = json.loads(record.payload)
        if record.kind == CHECKPOINT_KIND:
            current = data["values"]
            if not isinstance(current, dict):
                raise TypeError("a checkpoint's values are an object")
            values.values, values.records = dict(current), 0
            return
        if record.kind != EVENT_KIND:
            raise ValueError(f"unknown kind {record.kind!r}")
        key = data["key"]
        if not isinstance(key, str):
            raise TypeError("the key is a str")
        values.values[key] = data["value"]
        values.records += 1
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise SchemaError(
            f"a damaged published value: {exc}",
            kind=record.kind,
            stream=values.stream,
            position=record.position,
        ) from None


class Published:
    """Reads and writes the published values of one store's runs."""

    def __init__(self, store: JournalStore, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._folds = StreamFolds(store, _Values, _fold, kept=_KEPT, deleted_is_empty=False)
        self._sets: OrderedDict[str, int] = OrderedDict()  # sets made here since a look
        self._lock = threading.Lock()

    @staticmethod
    def stream(execution_id: str, generation: int = 1) -> str:
        """The published values of generation `generation` of a run id."""
        return events_stream(execution_id, generation)

    def set(self, execution_id: str, key: str, value: Any, generation: int = 1) -> None:
        """Append `key`'s new value wherever the stream's head is now, then compact the
        stream if it holds many superseded values."""
        payload = json.dumps({"key": key, "value": value}).encode()
        stream = self.stream(execution_id, generation)
        self._folds.append(stream, [NewRecord(EVENT_KIND, payload, self._clock())])
        with self._lock:  # a look at the stream every _COMPACT_AT sets made here
            count = self._sets.pop(stream, 0) + 1
            self._sets[stream] = 0 if count >= _COMPACT_AT else count
            while len(self._sets) > _KEPT:
                self._sets.popitem(last=False)
        if count < _COMPACT_AT:
            return
        with self._folds.holding(stream):
            fold = self._folds.refresh(stream)
            if fold.records < max(_COMPACT_AT, 2 * len(fold.values)):
                return
            values = json.dumps({"values": fold.values}).encode()
            # At the exact head folded: a value set meanwhile makes it fail (a later
            # set compacts instead), so no value is ever trimmed unkept.
            record = NewRecord(CHECKPOINT_KIND, values, self._clock())
            self._folds.checkpoint(stream, fold, record)

    def values(self, execution_id: str, generation: int = 1) -> dict[str, Any]:
        """Every key's latest value (read from where this reader last stopped)."""
        return self._folds.read(self.stream(execution_id, generation)).values
