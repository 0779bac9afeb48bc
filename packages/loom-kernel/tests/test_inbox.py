"""A damaged or unreadable inbox: a damaged message is reported (with its stream and
position), the run staying where it was and workers nudged to look again; a receive
resumed with a damaged payload is a schema error; and an inbox that cannot be read
stops the drive at the receive, neither parking nor passing."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from loom_kernel import MemoryStore, Status
from loom_kernel._coordination import partition_of
from loom_kernel._engine import parts_of
from loom_kernel.spi import NewRecord, SchemaError
from message_helpers import _engine

_DAMAGED_MESSAGES = [
    ("loom.other", b'{"topic": null, "key": null, "message": 1}', "unknown kind"),
    ("loom.message", b"{not json", "a damaged message"),
    ("loom.message", b'{"topic": 7, "key": null, "message": 1}', "topic and key"),
    ("loom.message", b'{"topic": null, "key": ["k"], "message": 1}', "topic and key"),
    ("loom.message", b'{"topic": null, "key": null}', "message"),
    ("loom.message", b"[1, 2]", "a damaged message"),
]


@pytest.mark.parametrize(("kind", "payload", "says"), _DAMAGED_MESSAGES)
def test_a_damaged_message_is_reported_and_the_run_stays_where_it_was(
    kind: str, payload: bytes, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore()
    engine = _engine(store)
    assert engine.start("inbox.two", None, key="r").waiting_on == "loom.receive:null"
    store.append("inbox/r", 0, [NewRecord(kind, payload, 0.0)])
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert engine.send("r", "hello") == 2
    assert "a damaged message" in caplog.text
    assert says in caplog.text
    assert "'inbox/r', position 1" in caplog.text
    execution = engine.get("r")
    assert (execution.status, execution.position) == (Status.SUSPENDED, 2), "nothing consumed"
    hints = [json.loads(r.payload) for r in store.read(f"runs/open/{partition_of('r')}")]
    nudge = {"id": "r", "flow": "inbox.two", "by": None, "nudge": True}
    assert nudge in hints, "workers look again"


@pytest.mark.parametrize("payload", [{"topic": None}, "hello", {"gate": "g"}])
def test_a_receive_resumed_with_a_damaged_payload_is_a_schema_error(payload: Any) -> None:
    from loom_kernel._core import encode_event
    from loom_kernel.events import ExecutionResumed

    store = MemoryStore()
    engine = _engine(store)
    engine.start("inbox.two", None, key="r")  # parked at its first receive
    resumed = ExecutionResumed(payload, "loom.message:1", None)
    store.append("ex/r", store.head("ex/r"), [encode_event(resumed, 0.0)])  # a bad tool
    with pytest.raises(SchemaError, match=r"gate #0 of 'r' was resumed with"):
        _engine(store).recover()
    kinds = [record.kind for record in store.read("ex/r")]
    assert kinds[3:] == ["EXECUTION_CLAIMED"], "the takeover, and nothing after it"


def test_an_inbox_that_cannot_be_read_stops_the_drive_at_the_receive() -> None:
    """A receive that cannot look at the inbox neither parks (a message already there
    would wait for a wake nobody sends) nor passes: the drive stops on the store's
    error, and the run stays running for the next drive."""
    from loom_kernel import StoreUnavailableError

    engine = _engine(MemoryStore())

    def down(*_args: Any) -> None:
        raise StoreUnavailableError("the inbox went away")

    parts_of(engine).driver.inbox.next_for = down  # type: ignore[method-assign,assignment]
    with pytest.raises(StoreUnavailableError, match="the inbox went away"):
        engine.start("inbox.two", None, key="down")
    assert engine.get("down").status is Status.RUNNING, "stopped, not parked"
    assert [type(entry.event).__name__ for entry in engine.history("down")] == ["ExecutionStarted"]


def test_an_inbox_trimmed_or_deleted_by_other_means_is_an_error_never_messages_gone() -> None:
    """An inbox is never checkpointed: read from a trim floor, its messages below it
    would be gone and their dedupe keys forgotten (a resend delivered again). A trim or
    a deletion by something other than Loom is an error the reader sees."""
    from loom_kernel.spi import StreamDeletedError, TrimmedError

    store = MemoryStore()
    engine = _engine(store)
    engine.start("inbox.two", "t", key="r")
    for number, key in enumerate("abc"):
        engine.send("r", f"m{number}", topic="other", key=key, drive=False)
    store.trim("inbox/r", 3)
    fresh = _engine(store)  # a reader that never saw the messages below the floor
    with pytest.raises(TrimmedError):
        fresh.send("r", "m0-again", topic="other", key="a")
    store.delete("inbox/r")
    for reader in (engine, _engine(store)):
        with pytest.raises(StreamDeletedError):
            reader.send("r", "again", topic="other", key="b")
