"""Published progress (`set_event`, `get_event`): the latest value of each key, published
once (a replay publishes nothing), waited for or given up on; a value that is not JSON,
or cannot be published, stops the drive before it is journaled; a damaged published
value is a schema error naming where; the inboxes and values kept parsed are bounded."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from loom_kernel import (
    Context,
    Engine,
    ExecutionNotFoundError,
    InvalidArgumentError,
    MemoryStore,
    Status,
    flow,
)
from loom_kernel._engine import parts_of
from loom_kernel.spi import NewRecord, SchemaError, StreamDeletedError
from message_helpers import FLOWS, _engine


def test_set_event_publishes_the_latest_value_and_a_replay_publishes_nothing() -> None:
    store = MemoryStore()
    engine = _engine(store)
    engine.start("inbox.progress", 3, key="pr")
    assert engine.get_event("pr", "done") == 3
    assert engine.get_events("pr") == {"done": 3}
    assert store.head("events/pr") == 3
    _engine(store).resume("pr", None)  # a replay in a new engine
    assert store.head("events/pr") == 3
    assert engine.get("pr").result == "finished"


def test_an_unknown_run_is_not_found_at_once_not_waited_for() -> None:
    """`get_event` on a run that does not exist used to wait its whole timeout and
    return None, as if the run had published nothing."""
    engine = _engine(MemoryStore())
    began = time.monotonic()
    with pytest.raises(ExecutionNotFoundError, match="no-such-run"):
        engine.get_event("no-such-run", "done", timeout=30)
    assert time.monotonic() - began < 10, "not after its timeout"
    with pytest.raises(ExecutionNotFoundError):
        engine.get_events("no-such-run")


def test_get_event_waits_for_a_value_or_gives_up() -> None:
    engine = Engine(MemoryStore(), FLOWS, listeners=[])
    engine.start("inbox.two", None, key="slow")
    assert engine.get_event("slow", "done", timeout=0.05) is None
    timer = threading.Timer(0.05, lambda: parts_of(engine).driver.published.set("slow", "done", 7))
    timer.start()
    assert engine.get_event("slow", "done", timeout=10) == 7
    timer.join()
    with pytest.raises(InvalidArgumentError):
        engine.get_event("slow", "done", timeout=-1)


def test_get_event_waiting_returns_what_a_run_published_as_it_finished() -> None:
    engine = _engine(MemoryStore())
    engine.start("inbox.progress", 1, key="p")
    engine.resume("p", "go")
    assert engine.get("p").status is Status.COMPLETED
    real = parts_of(engine).driver.published.values
    reads: list[str] = []

    def racing(execution_id: str, generation: int = 1) -> dict[str, Any]:
        reads.append(execution_id)  # the first read is from before the run published
        return {} if len(reads) == 1 else real(execution_id, generation)

    parts_of(engine).driver.published.values = racing  # type: ignore[method-assign]
    assert engine.get_event("p", "done", timeout=5) == 1, "read again once it finished"
    assert reads == ["p", "p"]


def test_an_event_value_that_is_not_json_stops_the_run() -> None:
    @flow(name="inbox.bad_event")
    def bad_event(ctx: Context, _input: Any) -> Any:
        ctx.set_event("k", object())

    engine = Engine(MemoryStore(), [bad_event], listeners=[])
    with pytest.raises(InvalidArgumentError):
        engine.start("inbox.bad_event", None)


def test_a_value_that_cannot_be_published_stops_the_drive_before_it_is_journaled() -> None:
    from loom_kernel import StoreUnavailableError

    store = MemoryStore()
    engine = _engine(store)

    def down(*_args: Any) -> None:
        raise StoreUnavailableError("the store went away")

    parts_of(engine).driver.published.set = down  # type: ignore[method-assign,assignment]
    with pytest.raises(StoreUnavailableError):
        engine.start("inbox.progress", 3, key="down")
    assert engine.get("down").status is Status.RUNNING, "stopped, not failed or ended"
    names = [getattr(entry.event, "name", "") for entry in engine.history("down")]
    assert not any(name.startswith("loom.event:") for name in names), "nothing journaled"


@pytest.mark.parametrize(
    ("kind", "payload"),
    [
        ("loom.other", b'{"key": "done", "value": 1}'),
        ("loom.event", b"{not json"),
        ("loom.event", b'{"key": 7, "value": 1}'),
        ("loom.event", b'{"key": "done"}'),
        ("loom.event", b'"done"'),
    ],
)
def test_a_damaged_published_value_is_a_schema_error_naming_where(
    kind: str, payload: bytes
) -> None:
    store = MemoryStore()
    engine = _engine(store)
    engine.start("inbox.progress", 1, key="p")
    assert engine.get_event("p", "done") == 1
    store.append("events/p", 1, [NewRecord(kind, payload, 0.0)])
    with pytest.raises(SchemaError, match="a damaged published value") as caught:
        engine.get_event("p", "done")
    assert (caught.value.stream, caught.value.position) == ("events/p", 2)


def test_the_inboxes_and_published_values_kept_parsed_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from loom_kernel._coordination import _inbox, _published

    monkeypatch.setattr(_inbox, "_KEPT", 3)
    monkeypatch.setattr(_published, "_KEPT", 3)
    engine = _engine(MemoryStore())
    for number in range(5):
        engine.start("inbox.two", None, key=f"p{number}")
        engine.send(f"p{number}", "hello")  # the run reads its inbox
        engine.start("inbox.progress", 1, key=f"p{number}-progress")
        assert engine.get_event(f"p{number}-progress", "done") == 1
    inboxes = parts_of(engine).driver.inbox._folds.kept()
    assert inboxes == ["inbox/p2", "inbox/p3", "inbox/p4"], "the least recent dropped"
    kept = parts_of(engine).driver.published._folds.kept()
    assert kept == ["events/p2-progress", "events/p3-progress", "events/p4-progress"], (
        "the least recent dropped"
    )
    assert engine.get_event("p0-progress", "done") == 1, "read again from the store"


def test_published_values_deleted_by_other_means_are_an_error_not_an_empty_dict() -> None:
    from loom_kernel.spi import StreamDeletedError

    store = MemoryStore()
    engine = _engine(store)
    engine.start("inbox.progress", 3, key="pr")
    assert engine.get_events("pr") == {"done": 3}
    store.delete("events/pr")
    for reader in (engine, _engine(store)):
        with pytest.raises(StreamDeletedError):
            reader.get_events("pr")
        with pytest.raises(StreamDeletedError):
            reader.get_event("pr", "done", timeout=5)


def test_superseded_values_are_compacted_and_every_reader_still_reads_the_latest() -> None:
    """A run that publishes its progress a thousand times leaves a stream of what is
    current: a checkpoint and the values set since, however many were set before; a
    reader that last looked long ago, and a new one, read the latest values."""
    from loom_kernel import flow

    @flow(name="pub.progress")
    def progress(ctx: Context, times: int) -> Any:
        for number in range(times):
            ctx.set_event("done", number)
            ctx.set_event("stage", f"s{number % 3}")
        return times

    store = MemoryStore()
    engine = Engine(store, [progress], listeners=[])
    early = Engine(store, [progress], listeners=[])
    engine.start("pub.progress", 10, key="few")
    assert early.get_events("few") == {"done": 9, "stage": "s0"}
    engine.start("pub.progress", 1000, key="many")
    assert early.get_events("many") == {"done": 999, "stage": "s0"}
    from loom_kernel.spi import TrimmedError

    with pytest.raises(TrimmedError) as trimmed:
        store.read("events/many")
    retained = store.read("events/many", trimmed.value.floor)
    assert retained[0].kind == "loom.event.checkpoint"
    assert len(retained) <= 2 * 64, "a checkpoint and what was set since"
    assert Engine(store, [progress], listeners=[]).get_events("many") == {
        "done": 999,
        "stage": "s0",
    }
    assert engine.get_event("many", "done") == 999


def test_a_reader_whose_fold_a_compaction_trimmed_starts_over_from_the_checkpoint() -> None:
    from loom_kernel._coordination import Published

    store = MemoryStore()
    writer, reader = Published(store, lambda: 1.0), Published(store, lambda: 1.0)
    for number in range(50):
        writer.set("r", f"k{number % 5}", number)
    assert reader.values("r") == {f"k{n}": 45 + n for n in range(5)}
    for number in range(50, 1000):
        writer.set("r", f"k{number % 5}", number)
    assert reader.values("r") == {f"k{n}": 995 + n for n in range(5)}
    store.delete("events/r")
    with pytest.raises(StreamDeletedError):
        reader.values("r")
