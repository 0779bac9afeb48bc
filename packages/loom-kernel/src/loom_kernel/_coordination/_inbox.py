"""Run inboxes: messages sent to a run, journaled in a stream of its own.

`inbox/<execution id>` holds one record per message sent, in send order: its topic,
its dedupe key (if any) and the message. A message whose key an earlier message of
the inbox has is a resend: it is never delivered (concurrent resends may both be
appended; the reader skips all but the first). The run records which positions it
consumed (the dedupe keys of the resumes that handed them to its gates), so a replay
reads the same messages, and a message is delivered to one gate at most.

A reader keeps what it parsed and reads only what was appended since (positions
never change once written). Messages the run consumed are compacted away (`compact`):
a checkpoint record holds the messages not consumed yet, with their own positions,
and every dedupe key the inbox has seen (a late resend of a compacted message is
still a resend), and the stream is trimmed below it, so a long receive loop costs
what it has left to read. A consumed message's content is in the run's journal (the
resume that handed it over), which is what a replay reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, Final

import attrs

from loom_kernel._coordination._streams import StreamFolds
from loom_kernel._core import (
    INBOX_PREFIX,
    NewRecord,
    Record,
    SchemaError,
    TrimmedError,
    inbox_stream,
)
from loom_kernel._replay import Message
from loom_kernel._spi import JournalStore

__all__ = ["INBOX_PREFIX", "Inbox"]

MESSAGE_KIND: Final = "loom.message"
CHECKPOINT_KIND: Final = "loom.message.checkpoint"
#: Consumed messages an inbox holds before a look compacts it.
_COMPACT_AT: Final = 32
#: Inboxes whose parsed messages a reader keeps (the least recently used go first).
_KEPT: Final = 1024


@attrs.define
class _Parsed:
    """An inbox as parsed up to `head`."""

    stream: str
    head: int = 0
    messages: list[Message] = attrs.Factory(list)  # first sends only: resends dropped
    keys: dict[str, int] = attrs.Factory(dict)  # key -> position of its first send
    floor: int = attrs.field(default=attrs.Factory(lambda self: self.head, takes_self=True))
    anchored: bool = False  # a checkpoint was folded: what is here is the whole inbox

    def copy(self) -> _Parsed:
        return _Parsed(
            self.stream,
            self.head,
            list(self.messages),
            dict(self.keys),
            self.floor,
            self.anchored,
        )


def _fold(parsed: _Parsed, record: Record) -> None:
    if record.kind == CHECKPOINT_KIND:
        parsed.messages, parsed.keys = _decode_checkpoint(record, parsed.stream)
        parsed.anchored = True
        return
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
        # A trim is a checkpoint's: a reader trimmed past starts over from it. A deleted
        # inbox (its run deleted) is an error, never messages silently gone.
        self._folds = StreamFolds(store, _Parsed, _fold, kept=_KEPT, deleted_is_empty=False)

    def _parsed(self, stream: str) -> _Parsed:
        """The inbox's fold, refreshed (inside `holding`). One read from a trim floor
        must start at a checkpoint, which holds the whole inbox; else messages below
        the floor were trimmed by other means, and that is an error, never messages
        (and their dedupe keys, so a resend would be delivered again) silently gone.

        Raises:
            TrimmedError: the inbox was trimmed by something other than a compaction.
        """
        parsed = self._folds.refresh(stream)
        if parsed.floor and not parsed.anchored:
            self._folds.forget(stream)
            raise TrimmedError(stream, 0, parsed.floor)
        return parsed

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
            return self._parsed(stream).keys.get(key)

    def messages(self, execution_id: str, generation: int = 1) -> list[Message]:
        """Every message of the inbox, in send order (resends left out)."""
        stream = self.stream(execution_id, generation)
        with self._folds.holding(stream):
            return list(self._parsed(stream).messages)

    def keys(self, execution_id: str, generation: int = 1) -> dict[str, int]:
        """Every dedupe key the inbox has seen, compacted messages' too, with the
        position of its first send."""
        stream = self.stream(execution_id, generation)
        with self._folds.holding(stream):
            return dict(self._parsed(stream).keys)

    def compact(self, execution_id: str, consumed: set[int], generation: int = 1) -> bool:
        """Drop the messages in `consumed` from the inbox, if it holds at least
        `_COMPACT_AT` of them and half as many as the keys the inbox has seen: a checkpoint
        of the rest (and of every key) at the exact head read, then a trim below it.
        Whether it compacted (False too when a message arrived meanwhile: a later
        look compacts).

        `consumed` must be positions the run's journal holds as consumed (committed,
        never a drive's pending records): what is dropped here is gone.
        """
        stream = self.stream(execution_id, generation)
        with self._folds.holding(stream):
            parsed = self._parsed(stream)
            left = [message for message in parsed.messages if message.position not in consumed]
            # A checkpoint copies every key: it is written only once the messages it
            # drops are at least half the keys it copies, so the keys copied double
            # from one checkpoint to the next and all checkpoints together copy a
            # small multiple of what was sent, however many keys there are.
            dropped = len(parsed.messages) - len(left)
            if dropped < _COMPACT_AT or 2 * dropped < len(parsed.keys):
                return False
            payload = json.dumps(
                {
                    "messages": [[m.position, m.topic, m.key, m.message, m.sent_at] for m in left],
                    "keys": parsed.keys,
                }
            ).encode()
            record = NewRecord(CHECKPOINT_KIND, payload, self._clock())
            return self._folds.checkpoint(stream, parsed, record)

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
            for message in self._parsed(stream).messages:
                if message.topic in wanted and message.position not in consumed:
                    return message
        return None


def _decode_checkpoint(record: Record, stream: str) -> tuple[list[Message], dict[str, int]]:
    try:
        data = json.loads(record.payload)
        messages = [
            Message(int(position), topic, key, message, float(sent_at))
            for position, topic, key, message, sent_at in data["messages"]
        ]
        keys = data["keys"]
        if not isinstance(keys, dict) or not all(
            isinstance(key, str) and type(at) is int for key, at in keys.items()
        ):
            raise TypeError("a checkpoint's keys map each key to a position")
        for message in messages:
            _check_topic_and_key(message.topic, message.key)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise SchemaError(
            f"a damaged inbox checkpoint: {exc}",
            kind=record.kind,
            stream=stream,
            position=record.position,
        ) from None
    return messages, keys


def _decode(record: Record, stream: str) -> Message:
    try:
        if record.kind != MESSAGE_KIND:
            raise ValueError(f"unknown kind {record.kind!r}")
        data = json.loads(record.payload)
        topic, key = data["topic"], data["key"]
        _check_topic_and_key(topic, key)
        return Message(record.position, topic, key, data["message"], record.timestamp)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise SchemaError(
            f"a damaged message: {exc}", kind=record.kind, stream=stream, position=record.position
        ) from None


def _check_topic_and_key(topic: object, key: object) -> None:
    if not (topic is None or isinstance(topic, str)) or not (key is None or isinstance(key, str)):
        raise TypeError("topic and key are str or null")
