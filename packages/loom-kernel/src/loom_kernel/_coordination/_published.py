"""Published progress: values a run sets by key, readable without its journal.

`events/<execution id>` holds one record per `ctx.set_event(key, value)`; the latest
record of a key is its value. The run writes the record first and then journals the
call as a recorded step, so a crash in between publishes the same value again on
the re-drive (the flow computes it from the same journal), and a replay publishes
nothing.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

from loom_kernel._coordination._appends import append_anywhere
from loom_kernel._core import (
    EVENTS_PREFIX,
    NewRecord,
    SchemaError,
    validate_stream_id,
)
from loom_kernel._spi import JournalStore

__all__ = ["EVENTS_PREFIX", "Published"]


EVENT_KIND: Final = "loom.event"
_KEPT: Final = 1024


class Published:
    """Reads and writes the published values of one store's runs."""

    def __init__(self, store: JournalStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        self._lock = threading.Lock()
        self._read: OrderedDict[str, tuple[int, dict[str, Any]]] = OrderedDict()

    @staticmethod
    def stream(execution_id: str) -> str:
        return validate_stream_id(EVENTS_PREFIX + execution_id)

    def set(self, execution_id: str, key: str, value: Any) -> None:
        """Append `key`'s new value wherever the stream's head is now."""
        stream = self.stream(execution_id)
        payload = json.dumps({"key": key, "value": value}).encode()
        with self._lock:
            head = self._read.get(execution_id, (0, {}))[0]
        record = NewRecord(EVENT_KIND, payload, self._clock())
        append_anywhere(self._store, stream, [record], head)

    def values(self, execution_id: str) -> dict[str, Any]:
        """Every key's latest value (read from where this reader last stopped)."""
        stream = self.stream(execution_id)
        with self._lock:
            head, before = self._read.get(execution_id, (0, {}))
        values = dict(before)
        for record in self._store.read(stream, head):
            try:
                if record.kind != EVENT_KIND:
                    raise ValueError(f"unknown kind {record.kind!r}")
                data = json.loads(record.payload)
                key = data["key"]
                if not isinstance(key, str):
                    raise TypeError("the key is a str")
                values[key] = data["value"]
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                raise SchemaError(
                    f"a damaged published value: {exc}",
                    kind=record.kind,
                    stream=stream,
                    position=record.position,
                ) from None
            head = record.position
        with self._lock:
            if self._read.get(execution_id, (0, {}))[0] <= head:
                self._read[execution_id] = (head, values)
                self._read.move_to_end(execution_id)
                while len(self._read) > _KEPT:
                    self._read.popitem(last=False)
        return dict(values)
