"""Consumed messages compacted away: a long receive loop's inbox holds what is left to
read, dedupe keys outlive the messages they came with, a replay never needs a
compacted message, and a message that arrives during a compaction is never lost."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import pytest
from loom_kernel import Context, Engine, MemoryStore, SentKey, Status, flow
from loom_kernel.spi import NewRecord, StoreUnavailableError
from loom_kernel.testing import FakeClock


@flow(name="compaction.loop")
def loop(ctx: Context, count: int) -> Any:
    got = [ctx.receive("work") for _ in range(count)]
    ctx.suspend("finish")
    return got


@flow(name="compaction.later")
def later(ctx: Context, _input: Any) -> Any:
    first = [ctx.receive("now") for _ in range(100)]
    ctx.suspend("go")
    return [first, ctx.receive("later")]


def _engine(store: MemoryStore) -> Engine:
    return Engine(store, [loop, later], clock=FakeClock(), listeners=[])


def _records(store: MemoryStore, stream: str) -> int:
    return len(store.read(stream, _floor(store, stream)))


def _floor(store: MemoryStore, stream: str) -> int:
    from loom_kernel.spi import TrimmedError

    try:
        store.read(stream, 0, limit=1)
    except TrimmedError as exc:
        return exc.floor
    return 0


def test_a_long_receive_loop_leaves_an_inbox_of_what_is_left_to_read() -> None:
    store = MemoryStore()
    engine = _engine(store)
    engine.start("compaction.loop", 1_000, key="r")
    for number in range(1_000):
        engine.send("r", number, topic="work")
    assert _records(store, "inbox/r") <= 2 * 64 + 1, "a checkpoint and what came since"
    assert _floor(store, "inbox/r") > 800
    # A fresh engine (another process) replays the whole run from its journal alone.
    fresh = _engine(store)
    done = fresh.resume("r", None, on="finish")
    assert done.status is Status.COMPLETED
    assert done.result == list(range(1_000))


class _CheckpointBytes(MemoryStore):
    """Adds up the bytes of every inbox checkpoint appended."""

    def __init__(self) -> None:
        super().__init__()
        self.checkpointed = 0

    def append(
        self, stream: str, expected: int, records: Sequence[NewRecord], *, sync: bool = True
    ) -> int:
        head = super().append(stream, expected, records, sync=sync)
        self.checkpointed += sum(
            len(r.payload) for r in records if r.kind == "loom.message.checkpoint"
        )
        return head


def test_keyed_sends_cost_checkpoints_in_proportion_to_what_was_sent() -> None:
    """Every checkpoint copies every key, so one is written only once it drops as many
    messages as it copies keys: the checkpoints' bytes stay a small multiple of the
    messages', not their square."""
    store = _CheckpointBytes()
    engine = _engine(store)
    engine.start("compaction.loop", 1_000, key="r")
    for number in range(1_000):
        engine.send("r", number, topic="work", key=f"key-{number:06d}")
    every_key = len(json.dumps({f"key-{n:06d}": n for n in range(1_000)}))
    assert store.checkpointed > 0
    # Copying the keys at every look (every 64 sends) would copy them 7.7 times over.
    assert store.checkpointed <= 3 * every_key, "the keys copied double, then double"
    assert _records(store, "inbox/r") <= 1_000 // 2 + 2 * 64 + 1


def test_a_resend_of_a_compacted_message_is_still_a_resend() -> None:
    store = MemoryStore()
    engine = _engine(store)
    engine.start("compaction.loop", 300, key="r")
    first = engine.send("r", "first", topic="work", key="once")
    for number in range(299):
        engine.send("r", number, topic="work")
    assert _floor(store, "inbox/r") > first, "the keyed message was compacted away"
    for reader in (engine, _engine(store)):
        assert reader.send("r", "again", topic="work", key="once") == first
        assert reader.inbox_keys("r") == {"once": SentKey(first, received=True)}
    done = engine.resume("r", None, on="finish")
    assert done.result is not None
    assert done.result.count("first") == 1
    assert "again" not in done.result


def test_messages_not_read_yet_survive_a_compaction_where_they_were() -> None:
    store = MemoryStore()
    engine = _engine(store)
    engine.start("compaction.later", None, key="r")
    waiting = engine.send("r", "for later", topic="later", key="l")
    for number in range(100):
        engine.send("r", number, topic="now")
    assert _floor(store, "inbox/r") > waiting, "compacted past the unread message"
    for reader in (engine, _engine(store)):
        assert [(m.position, m.message, m.received) for m in reader.inbox("r")][:1] == [
            (waiting, "for later", False)
        ]
        assert reader.inbox_keys("r") == {"l": SentKey(waiting, received=False)}
    assert engine.resume("r", None, on="go").result == [list(range(100)), "for later"]
    assert engine.inbox_keys("r") == {"l": SentKey(waiting, received=True)}


class _SendDuringCheckpoint(MemoryStore):
    """Appends a message to the inbox just before a compaction's checkpoint lands."""

    def __init__(self) -> None:
        super().__init__()
        self.sneaked = 0

    def append(
        self, stream: str, expected: int, records: Sequence[NewRecord], *, sync: bool = True
    ) -> int:
        if records and records[0].kind == "loom.message.checkpoint" and self.sneaked < 3:
            self.sneaked += 1
            payload = b'{"topic": "work", "key": null, "message": "sneaked"}'
            super().append(stream, expected, [NewRecord("loom.message", payload, 0.0)])
        return super().append(stream, expected, records, sync=sync)


def test_a_message_arriving_during_a_compaction_is_never_lost() -> None:
    store = _SendDuringCheckpoint()
    engine = _engine(store)
    engine.start("compaction.loop", 403, key="r")
    for number in range(400):
        engine.send("r", number, topic="work")
    assert store.sneaked == 3, "three compactions met a message and gave way"
    done = engine.resume("r", None, on="finish")
    assert done.status is Status.COMPLETED
    assert done.result is not None
    assert sorted(map(str, done.result)) == sorted([*map(str, range(400)), *["sneaked"] * 3])


def test_a_damaged_checkpoint_is_a_schema_error_naming_where() -> None:
    from loom_kernel.spi import SchemaError

    store = MemoryStore()
    engine = _engine(store)
    engine.start("compaction.loop", 3, key="r")
    store.append("inbox/r", 0, [NewRecord("loom.message.checkpoint", b'{"keys": 1}', 0.0)])
    with pytest.raises(SchemaError, match="a damaged inbox checkpoint"):
        _engine(store).inbox("r")


class _TrimFailsOnce(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def trim(self, stream: str, before: int) -> None:
        if stream.startswith("inbox/") and not self.failed:
            self.failed = True
            raise StoreUnavailableError("a trim that failed (injected)")
        super().trim(stream, before)


def test_a_compaction_that_fails_never_fails_the_send_that_made_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The message is in the inbox before the compaction: a send that raised then
    would be retried by its caller, and its message received twice."""
    store = _TrimFailsOnce()
    engine = _engine(store)
    engine.start("compaction.loop", 200, key="r")
    with caplog.at_level(logging.WARNING, logger="loom"):
        positions = [engine.send("r", number, topic="work") for number in range(200)]
    assert store.failed
    assert "its inbox was not compacted" in caplog.text
    assert len(set(positions)) == 200
    done = engine.resume("r", None, on="finish")
    assert done.result == list(range(200))
