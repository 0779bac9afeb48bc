"""The checks every store gets from `JournalStore`, and the memory store's own: a
record's kind and payload, a listing's cursor, an append past the head of a missing
stream, a commit confirmation that is another writer's, and what the error of a
deleted stream says."""

from __future__ import annotations

from typing import Any

import pytest
from loom_kernel import MemoryStore
from loom_kernel.spi import InvalidArgumentError, NewRecord

pytestmark = pytest.mark.usefixtures("flow_loop")


@pytest.mark.parametrize("payload", ["text", bytearray(b"x"), None, 7])
def test_a_record_payload_that_is_not_bytes_is_refused(payload: Any) -> None:
    from loom_kernel.spi import NewRecord

    with pytest.raises(InvalidArgumentError, match="payload must be bytes"):
        NewRecord("k", payload, 1.0)


def test_a_kind_of_65_characters_is_refused() -> None:
    from loom_kernel.spi import MAX_KIND_LENGTH, NewRecord

    store = MemoryStore()
    assert MAX_KIND_LENGTH == 64
    store.append("s", 0, [NewRecord("k" * 64, b"", 0.0)])
    with pytest.raises(InvalidArgumentError):
        store.append("s", 1, [NewRecord("k" * 65, b"", 0.0)])


@pytest.mark.parametrize("after", ["a//b", "/a", "a b", "../x", 7])
def test_a_listing_cursor_is_checked_like_a_prefix(after: Any) -> None:
    store = MemoryStore()
    with pytest.raises(InvalidArgumentError):
        store.streams("", after)


def test_appending_past_the_head_of_a_missing_stream_conflicts() -> None:
    from loom_kernel import ConflictError
    from loom_kernel.spi import NewRecord

    with pytest.raises(ConflictError):
        MemoryStore().append("missing", 3, [NewRecord("k", b"", 0.0)])


def test_a_memory_store_confirmation_tells_another_writers_commit_from_its_own() -> None:
    from loom_kernel.spi import ConflictError, NewRecord

    store = MemoryStore()
    store.append("s", 0, [NewRecord("k", b"theirs", 1.0)])
    with pytest.raises(ConflictError):
        store._confirm("s", 0, 1, "a commit id that never landed")
    with pytest.raises(ConflictError):
        store._confirm("never", 0, 1, "x")


def test_a_deleted_stream_error_says_what_happened() -> None:
    from loom_kernel import StreamDeletedError

    error = StreamDeletedError("orders/7", 3)
    assert (error.stream, error.head) == ("orders/7", 3)
    assert str(error) == (
        "stream 'orders/7' was deleted at head 3; a deleted stream's name is retired and "
        "its positions are never reused"
    )


def test_a_record_over_the_stores_stated_limit_is_refused_writing_nothing() -> None:
    """Each store states its largest record (`max_record_bytes`); a larger one is bad
    input, refused before anything is written, never a fault to retry."""
    from loom_kernel import Context, Engine, flow

    class Small(MemoryStore):
        max_record_bytes = 512

    store = Small()
    with pytest.raises(InvalidArgumentError, match="over Small's limit of 512 bytes a record"):
        store.append("s", 0, [NewRecord("k", b"ok", 1.0), NewRecord("k", b"x" * 513, 1.0)])
    assert store.head("s") == 0, "nothing of the batch was written"
    assert store.append("s", 0, [NewRecord("k", b"x" * 512, 1.0)]) == 1

    @flow(name="big")
    def big(ctx: Context, _input: None) -> str:
        return str(ctx.step("result", lambda: "y" * 1000))

    engine = Engine(store, [big], listeners=[])
    run = engine.start("big", key="b")
    assert run.error is not None
    assert "limit of 512 bytes" in run.error.message
    assert "STEP_COMPLETED" not in [entry.event.KIND for entry in engine.history("b")], (
        "the step failed, journaled; its result was never written"
    )
