"""Run inboxes: messages sent to a run, journaled in a stream of its own.

`inbox/<execution id>` holds one record per message sent, in send order: its topic,
its dedupe key (if any) and the message. A message whose key an earlier message of
the inbox has is a resend: it is never delivered (concurrent resends may both be
appended; the reader skips all but the first). The run records which positions it
consumed (the dedupe keys of the resumes that handed them to its gates), so a replay
reads the same messages, and a message is delivered to one gate at most.

The streams are append-only; a reader keeps what it parsed and reads only what was
appended since (positions never change once written).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, Final

import attrs

from loom_kernel._coordination._streams import StreamFolds
from loom_kernel._core import INBOX_PREFIX, NewRecord, Record, SchemaError, inbox_stream
from loom_kernel._replay import Message
from loom_kernel._spi import JournalStore

__all__ = ["INBOX_PREFIX", "Inbox"]

MESSAGE_KIND: Final = "loom.message"
#: Inboxes whose parsed messages a reader keeps (the least recently used go first).
_KEPT: Final = 1024


@attrs.define
class _Parsed:
    """An inbox as parsed up to `head`."""

    stream: str
    head: int = 0
    messages: list[Message] = attrs.Factory(list)  # first sends only: resends dropped
    keys: dict[str, int] = attrs.Factory(dict)  # key -> position of its first send

    def copy(self) -> _Parsed:
        return _Parsed(self.stream, self.head, list(self.messages), dict(self.keys))


def _fold(parsed: _Parsed, record: Record) -> None:
    message = _decode(record, parsed.stream)
    if message.key is not None:
        if message.key in parsed.keys:
            return  # a resend
        parsed.keys[message.key] = message.position
    parsed.messages.append(message)


class Inbox:
    """Reads and writes the inboxes of one store."""

    def __init__(self, store: JournalStore, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._folds = StreamFolds(store, _Parsed, _fold, kept=_KEPT, checkpointed=False)

    @staticmethod
    def stream(execution_id: str, generation: int = 1) -> str:
        """The inbox of generation `generation` of a run id (see `inbox_stream`)."""
        return inbox_stream(execution_id, generation)

    def append(
        self,
        execution_id: str,
        topic: str | None,
        key: str | None,
        message: Any,
        generation: int = 1,
    ) -> int:
        """Append a message wherever the inbox's head is now; its position."""
        payload = json.dumps({"topic": topic, "key": key, "message": message}).encode()
        record = NewRecord(MESSAGE_KIND, payload, self._clock())
        return self._folds.append(self.stream(execution_id, generation), [record])

    def sent(self, execution_id: str, key: str, generation: int = 1) -> int | None:
        """The position of the first message sent with `key`, if any."""
        stream = self.stream(execution_id, generation)
        with self._folds.holding(stream):
            return self._folds.refresh(stream).keys.get(key)

    def messages(self, execution_id: str, generation: int = 1) -> list[Message]:
        """Every message of the inbox, in send order (resends left out)."""
        stream = self.stream(execution_id, generation)
        with self._folds.holding(stream):
            return list(self._folds.refresh(stream).messages)

    def next_for(
        self,
        execution_id: str,
        topics: Iterable[str | None],
        consumed: set[int],
        generation: int = 1,
    ) -> Message | None:
        """The first message on one of `topics` that is not in `consumed` (nor a resend)."""
        wanted = set(topics)
        stream = self.stream(execution_id, generation)
        with self._folds.holding(stream):
            for message in self._folds.refresh(stream).messages:
                if message.topic in wanted and message.position not in consumed:
                    return message
        return None


def _decode(record: Record, stream: str) -> Message:
    try:
        if record.kind != MESSAGE_KIND:
            raise ValueError(f"unknown kind {record.kind!r}")
        data = json.loads(record.payload)
        topic, key = data["topic"], data["key"]
        if not (topic is None or isinstance(topic, str)) or not (
            key is None or isinstance(key, str)
        ):
            raise TypeError("topic and key are str or null")
        return Message(record.position, topic, key, data["message"], record.timestamp)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise SchemaError(
            f"a damaged message: {exc}", kind=record.kind, stream=stream, position=record.position
        ) from None
