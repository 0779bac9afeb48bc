"""Published progress: values a run sets by key, readable without its journal.

`events/<execution id>` holds one record per `ctx.set_event(key, value)`; the latest
record of a key is its value. The run writes the record first and then journals the
call as a recorded step, so a crash in between publishes the same value again on
the re-drive (the flow computes it from the same journal), and a replay publishes
nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

import attrs

from loom_kernel._coordination._streams import StreamFolds
from loom_kernel._core import EVENTS_PREFIX, NewRecord, Record, SchemaError, events_stream
from loom_kernel._spi import JournalStore

__all__ = ["EVENTS_PREFIX", "Published"]

EVENT_KIND: Final = "loom.event"
#: Runs whose published values a reader keeps (the least recently used go first).
_KEPT: Final = 1024


@attrs.define
class _Values:
    """A run's published values as folded up to `head`: each key's latest."""

    stream: str
    head: int = 0
    values: dict[str, Any] = attrs.Factory(dict)

    def copy(self) -> _Values:
        return _Values(self.stream, self.head, dict(self.values))


def _fold(values: _Values, record: Record) -> None:
    try:
        if record.kind != EVENT_KIND:
            raise ValueError(f"unknown kind {record.kind!r}")
        data = json.loads(record.payload)
        key = data["key"]
        if not isinstance(key, str):
            raise TypeError("the key is a str")
        values.values[key] = data["value"]
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
        self._folds = StreamFolds(store, _Values, _fold, kept=_KEPT, checkpointed=False)

    @staticmethod
    def stream(execution_id: str, generation: int = 1) -> str:
        """The published values of generation `generation` of a run id."""
        return events_stream(execution_id, generation)

    def set(self, execution_id: str, key: str, value: Any, generation: int = 1) -> None:
        """Append `key`'s new value wherever the stream's head is now."""
        payload = json.dumps({"key": key, "value": value}).encode()
        self._folds.append(
            self.stream(execution_id, generation),
            [NewRecord(EVENT_KIND, payload, self._clock())],
        )

    def values(self, execution_id: str, generation: int = 1) -> dict[str, Any]:
        """Every key's latest value (read from where this reader last stopped)."""
        return self._folds.read(self.stream(execution_id, generation)).values
