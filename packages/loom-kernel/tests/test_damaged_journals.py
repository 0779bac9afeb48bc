"""A damaged journal is reported, never folded around: one broken run never stops the rest."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from counter_flow import counter
from loom_kernel import Context, Engine, MemoryStore, Status, flow
from loom_kernel._coordination import SNAPSHOT_KIND
from loom_kernel.spi import NewRecord, SchemaError
from loom_kernel.testing import sandbox


class Crash(BaseException):
    """Stands in for the process dying mid-flow: nothing in the engine catches it."""


crash_now = {"on": False}


@flow
def charge(ctx: Context, _input: Any) -> Any:
    first = ctx.step("quote", lambda: 10)
    if crash_now["on"]:
        raise Crash
    second = ctx.step("charge", lambda: first * 2)
    gate = ctx.suspend("ship")
    return [first, second, gate]


def _engine(store: MemoryStore) -> Engine:
    return sandbox(charge, store=store, listeners=[]).engine


def _drop_record(store: MemoryStore, stream: str, position: int) -> None:
    """Lose one row, as a damaged backend might."""
    entry = store._state.streams[stream]
    index = position - 1 - entry.floor
    del entry.records[index]
    del entry.commits[index]


@pytest.mark.parametrize("missing", [2, 3])
def test_a_missing_record_is_a_schema_error_naming_stream_and_position(missing: int) -> None:
    store = MemoryStore()
    execution = _engine(store).start("charge", key="order-1")
    assert execution.waiting_on == "ship"
    _drop_record(store, "ex/order-1", missing)
    looks: list[Callable[[Engine], object]] = [
        lambda engine: engine.get("order-1"),
        lambda engine: engine.resume("order-1", "go"),
        lambda engine: engine.history("order-1"),
    ]
    for look in looks:
        with pytest.raises(SchemaError, match=f"record {missing} is missing") as caught:
            look(_engine(store))
        assert (caught.value.stream, caught.value.position) == ("ex/order-1", missing)
    assert [r.kind for r in store.read("ex/order-1")].count("EXECUTION_RESUMED") == 0


def test_one_damaged_journal_does_not_stop_recover_for_the_others() -> None:
    store = MemoryStore()
    engine = _engine(store)
    crash_now["on"] = True
    try:
        for key in ("a-broken", "b-left-running", "c-left-running"):
            with pytest.raises(Crash):
                engine.start("charge", key=key)
    finally:
        crash_now["on"] = False
    store.append("ex/a-broken", store.head("ex/a-broken"), [NewRecord("BOGUS", b"{}", 1.0)])
    fresh = _engine(store)
    with pytest.raises(SchemaError) as caught:
        fresh.recover()
    assert caught.value.stream == "ex/a-broken"
    for key in ("b-left-running", "c-left-running"):
        assert fresh.get(key).status is Status.SUSPENDED, f"{key} was not driven past the break"


def test_a_journal_trimmed_past_its_latest_snapshot_is_a_schema_error_naming_the_loss() -> None:
    store = MemoryStore()
    engine = _engine(store)
    run = engine.start("charge", None, key="lost")
    covered = engine.compact(run.id)
    head = engine.resume(run.id, "shipped").position
    store.trim("ex/lost", head)  # trimmed by other means, past what the snapshot holds
    with pytest.raises(SchemaError, match="are lost") as caught:
        _engine(store).get(run.id)
    assert (caught.value.stream, caught.value.position) == ("ex/lost", covered + 1)


def test_a_journal_trimmed_with_no_snapshot_at_all_is_a_schema_error() -> None:
    store = MemoryStore()
    run = _engine(store).start("charge", None, key="bare")
    store.trim("ex/bare", 3)  # by other means: Loom trims only below a snapshot
    with pytest.raises(SchemaError, match="are lost"):
        _engine(store).get(run.id)


def test_snapshots_that_keep_changing_under_a_reader_are_an_error_to_retry() -> None:
    from loom_kernel import StoreUnavailableError
    from loom_kernel.spi import TrimmedError

    class Churning(MemoryStore):
        churn = False

        def _read(self, stream: str, after: int, limit: int | None) -> Any:
            if self.churn and stream.startswith("snap/"):
                raise TrimmedError(stream, after, after + 1)  # a newer snapshot, every time
            return super()._read(stream, after, limit)

    store = Churning()
    engine = _engine(store)
    run = engine.start("charge", None, key="churn")
    engine.compact(run.id)
    store.churn = True
    with pytest.raises(StoreUnavailableError, match="kept changing"):
        _engine(store).get(run.id)


@pytest.mark.parametrize(
    ("payload", "says"),
    [(b"{not json", "snapshot is not JSON"), (b"[1, 2]", "snapshot is not an object")],
)
def test_a_damaged_snapshot_is_a_schema_error_naming_where(payload: bytes, says: str) -> None:
    store = MemoryStore()
    engine = _engine(store)
    run = engine.start("charge", None, key="snapped")
    engine.compact(run.id)
    head = store.head("snap/snapped")
    store.append("snap/snapped", head, [NewRecord(SNAPSHOT_KIND, payload, 0.0)])
    with pytest.raises(SchemaError, match=says) as caught:
        _engine(store).get(run.id)
    assert (caught.value.stream, caught.value.position) == ("snap/snapped", head + 1)


@pytest.mark.parametrize(
    "snapshot",
    [{"state": {}}, {"state": {"position": "7"}}, {"state": {"position": True}}, {"nothing": 1}],
)
def test_compacting_over_a_snapshot_that_names_no_position_is_a_schema_error(
    snapshot: dict[str, Any],
) -> None:
    store = MemoryStore()
    engine = _engine(store)
    run = engine.start("charge", None, key="snapped")
    engine.compact(run.id)
    head = store.head("snap/snapped")
    damaged = NewRecord(SNAPSHOT_KIND, json.dumps(snapshot).encode(), 0.0)
    store.append("snap/snapped", head, [damaged])
    with pytest.raises(SchemaError, match="snapshot names no position") as caught:
        engine.compact(run.id)  # its cached state: only the compaction reads the snapshot
    assert (caught.value.stream, caught.value.position) == ("snap/snapped", head + 1)


@pytest.mark.usefixtures("flow_loop")
@pytest.mark.parametrize("payload", [b"[1, 2]", b'"a step"', b"7"])
def test_a_step_record_that_is_not_a_json_object_is_a_schema_error(payload: bytes) -> None:
    from loom_kernel.spi import NewRecord, SchemaError

    @flow(name="one_step", version="1")
    def one_step(ctx: Context, _input: Any) -> Any:
        return ctx.step("s", lambda: 1)

    box = sandbox(one_step)
    box.engine.start("one_step", key="j")
    stream = "ex/j"
    box.store.append(stream, box.store.head(stream), [NewRecord("STEP_COMPLETED", payload, 1.0)])
    with pytest.raises(SchemaError):
        box.new_engine().get("j")


@pytest.mark.usefixtures("flow_loop")
@pytest.mark.parametrize(
    "data",
    [
        b'{"index":"0","name":"s","result":1,"attempts":1}',
        b'{"index":0,"name":7,"result":1,"attempts":1}',
        b'{"index":0,"name":"s","result":1,"attempts":"1"}',
    ],
)
def test_a_step_record_with_a_field_of_the_wrong_type_is_a_schema_error(data: bytes) -> None:
    from loom_kernel import SchemaError
    from loom_kernel.events import EVENT_SCHEMA, ExecutionStarted, encode_event
    from loom_kernel.spi import NewRecord

    store = MemoryStore()
    start = encode_event(ExecutionStarted("counter", counter.code_hash, 0), 1.0)
    step = NewRecord(
        "STEP_COMPLETED", b'{"v":"' + EVENT_SCHEMA.encode() + b'","d":' + data + b"}", 1.0
    )
    store.append("ex/typed", 0, [start, step])
    with pytest.raises(SchemaError):
        Engine(store, [counter]).get("typed")
