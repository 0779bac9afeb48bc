"""Schema governance: pinned kinds, versioned records, clear errors, upcasters."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from loom_kernel._core._codec import _upcasters, dump_json, encode_step_completed, register_upcaster
from loom_kernel.events import (
    EVENT_SCHEMA,
    PINNED,
    ErrorInfo,
    Event,
    ExecutionCancelled,
    ExecutionClaimed,
    ExecutionCompleted,
    ExecutionDeleted,
    ExecutionFailed,
    ExecutionMigrated,
    ExecutionResumed,
    ExecutionStarted,
    ExecutionSuspended,
    QueuePlace,
    StepCompleted,
    StepFailed,
    decode_event,
    encode_event,
    known_event_types,
)
from loom_kernel.spi import InvalidArgumentError, Record, SchemaError

ALL_EVENTS: list[Event] = [
    ExecutionStarted(flow="approval", code_hash="sha256:ab", input={"id": 7}, key="order-7"),
    StepCompleted(index=0, name="quote", result={"total": 12.5}, attempts=2),
    StepFailed(index=1, name="charge", error=ErrorInfo("ValueError", "declined"), attempts=3),
    ExecutionSuspended(gate=0, on="manager"),
    ExecutionSuspended(gate=1, on="timer", wake_at=1_700_000_000.5),
    ExecutionResumed(payload={"ok": True}, key="delivery-1"),
    ExecutionCompleted(result=[1, "two", None]),
    ExecutionFailed(error=ErrorInfo("builtins.KeyError", "'x'")),
    ExecutionCancelled(reason="operator"),
    ExecutionMigrated(from_hash="sha256:aa", to_hash="sha256:bb", reason="fix"),
    ExecutionClaimed(by="host.1:42:ab12", previous="host.2:7:cd34"),
    ExecutionResumed(payload=None, key="timer:1", by="host.1:42:ab12"),
    ExecutionDeleted(generation=2, reason="retention"),
]


def test_known_event_types_equal_pinned() -> None:
    """A new kind must be added to PINNED on purpose (and EVENT_SCHEMA bumped)."""
    assert known_event_types() == PINNED


def test_schema_version_is_1_21_0() -> None:
    assert EVENT_SCHEMA == "1.21.0"


def test_every_kind_has_an_example_here() -> None:
    assert {type(event).KIND for event in ALL_EVENTS} == PINNED


def _stored(event: Event, position: int = 1) -> Record:
    new = encode_event(event, 1_700_000_000.0)
    return Record(position, new.kind, new.payload, new.timestamp)


@pytest.mark.parametrize("event", ALL_EVENTS, ids=lambda e: type(e).__name__)
def test_events_round_trip_and_carry_the_schema(event: Event) -> None:
    record = _stored(event)
    assert record.kind == type(event).KIND
    assert json.loads(record.payload)["v"] == EVENT_SCHEMA
    assert decode_event(record, "exec/1") == event


def _record(kind: str, payload: Any, position: int = 4) -> Record:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return Record(position, kind, raw, 0.0)


def test_unknown_kind_names_kind_version_and_stream() -> None:
    with pytest.raises(SchemaError) as caught:
        decode_event(_record("CHILD_COMPLETED", {"v": "1.16.0", "d": {}}), "exec/9")
    message = str(caught.value)
    assert "unknown record kind" in message
    assert "CHILD_COMPLETED" in message
    assert "exec/9" in message
    assert "position 4" in message


def test_an_unknown_kind_whose_payload_is_not_json_says_unknown_kind_first() -> None:
    for payload in (b"{not json", b"\xff\xfe"):
        with pytest.raises(SchemaError, match="unknown record kind") as caught:
            decode_event(_record("CHILD_COMPLETED", payload), "exec/9")
        assert (caught.value.kind, caught.value.stream) == ("CHILD_COMPLETED", "exec/9")
    with pytest.raises(SchemaError, match="payload is not JSON"):
        decode_event(_record("EXECUTION_SUSPENDED", b"{not json"), "exec/9")


def test_newer_major_is_refused_with_kind_version_and_stream() -> None:
    payload = {"v": "2.0.0", "d": {"payload": 1, "key": None}}
    with pytest.raises(SchemaError) as caught:
        decode_event(_record("EXECUTION_RESUMED", payload), "exec/9")
    error = caught.value
    assert (error.kind, error.version, error.stream, error.position) == (
        "EXECUTION_RESUMED",
        "2.0.0",
        "exec/9",
        4,
    )
    assert "newer major schema" in str(error)


def test_newer_minor_of_the_same_major_is_read() -> None:
    payload = {"v": "1.99.0", "d": {"payload": 1, "key": None, "added_later": True}}
    assert decode_event(_record("EXECUTION_RESUMED", payload)) == ExecutionResumed(payload=1)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"{not json", "not JSON"),
        ([1, 2], "no schema envelope"),
        ({"d": {}}, "no schema envelope"),
        ({"v": "one", "d": {}}, "not MAJOR.MINOR.PATCH"),
        ({"v": "1.16.0", "d": []}, "not an object"),
        ({"v": "1.16.0", "d": {"gate": "x", "on": "m"}}, "does not fit"),
        ({"v": "1.16.0", "d": {}}, "does not fit"),
    ],
)
def test_corrupt_payloads_are_schema_errors(payload: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        decode_event(_record("EXECUTION_SUSPENDED", payload), "exec/1")


@pytest.mark.parametrize(
    "place",
    [
        "q",
        {"partition": 0},
        {"name": 7},
        {"name": "q", "partition": "0"},
        {"name": "q", "priority": 1.5},
        {"name": "q", "priority": True},
        {"name": "q", "key": 7},
        {"name": "q", "key": ["c7"]},
    ],
)
def test_a_start_with_a_malformed_queue_place_is_a_schema_error(place: Any) -> None:
    start = {"flow": "f", "code_hash": "sha256:0", "input": None, "queue": place}
    with pytest.raises(SchemaError, match="queue place"):
        decode_event(_record("EXECUTION_STARTED", {"v": "1.18.0", "d": start}), "exec/1")


def test_a_start_with_a_queue_place_reads_back_exactly() -> None:
    place = {"name": "q", "partition": 2, "priority": -4, "key": "c7"}
    start = {"flow": "f", "code_hash": "sha256:0", "input": None, "queue": place}
    event = decode_event(_record("EXECUTION_STARTED", {"v": "1.18.0", "d": start}))
    assert isinstance(event, ExecutionStarted)
    assert event.queue == QueuePlace("q", 2, -4, "c7")


def test_upcasters_lift_old_payloads_in_order() -> None:
    before = list(_upcasters)
    try:
        # Pretend 1.10 renamed "cause" to "reason", and 1.12 upper-cased it.
        register_upcaster(
            "EXECUTION_CANCELLED", "1.12.0", lambda d: {**d, "reason": d["reason"].upper()}
        )
        register_upcaster("EXECUTION_CANCELLED", "1.10.0", lambda d: {"reason": d.pop("cause")})
        old = {"v": "1.9.3", "d": {"cause": "timeout"}}
        assert decode_event(_record("EXECUTION_CANCELLED", old)) == ExecutionCancelled("TIMEOUT")
        middle = {"v": "1.11.0", "d": {"reason": "late"}}
        assert decode_event(_record("EXECUTION_CANCELLED", middle)) == ExecutionCancelled("LATE")
        current = {"v": EVENT_SCHEMA, "d": {"reason": "as is"}}
        assert decode_event(_record("EXECUTION_CANCELLED", current)) == ExecutionCancelled("as is")
    finally:
        _upcasters[:] = before


def test_upcaster_for_an_unknown_kind_is_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        register_upcaster("NOPE", "1.0.0", lambda d: d)


@given(st.binary(max_size=64), st.sampled_from(sorted(PINNED)))
def test_decoding_garbage_raises_only_schema_errors(raw: bytes, kind: str) -> None:
    with contextlib.suppress(SchemaError):
        decode_event(_record(kind, raw))


@given(
    index=st.integers(0, 10**6),
    name=st.text(min_size=1, max_size=20),
    result=st.recursive(
        st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=5),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
        ),
        max_leaves=8,
    ),
    attempts=st.integers(1, 9),
)
def test_fast_step_encoding_is_byte_identical(
    index: int, name: str, result: Any, attempts: int
) -> None:
    fast = encode_step_completed(index, name, dump_json(result), attempts, 5.0)
    general = encode_event(StepCompleted(index, name, result, attempts), 5.0)
    assert fast == general


@pytest.mark.parametrize("parser", ["json", "msgspec"])
def test_both_parsers_give_the_same_events_and_errors(
    parser: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """msgspec (the `fast` extra) reads journals when installed; json.loads otherwise."""
    from loom_kernel._core import _codec

    if parser == "json":
        monkeypatch.setattr(_codec, "parse_many", json.loads)
    else:
        msgspec = pytest.importorskip(
            "msgspec"
        )  # the workspace installs it; the kernel alone does not
        monkeypatch.setattr(_codec, "parse_many", msgspec.json.decode)
    records = [_stored(event, position) for position, event in enumerate(ALL_EVENTS, start=1)]
    big = encode_event(StepCompleted(0, "big", 2**80), 1.0)  # beyond 64-bit integers
    records.append(Record(len(records) + 1, big.kind, big.payload, big.timestamp))
    decoded = _codec.decode_events(records, "exec/1")
    assert decoded[: len(ALL_EVENTS)] == ALL_EVENTS
    assert decoded[-1] == StepCompleted(0, "big", 2**80)
    broken = [*records, _record("EXECUTION_RESUMED", b"{not json", position=99)]
    with pytest.raises(SchemaError, match="position 99"):
        _codec.decode_events(broken, "exec/1")


@pytest.mark.usefixtures("flow_loop")
def test_decoding_no_records_gives_no_events() -> None:
    from loom_kernel._core import decode_events, parse_envelopes

    assert parse_envelopes([]) == []
    assert decode_events([]) == []


@pytest.mark.usefixtures("flow_loop")
def test_a_record_holding_two_json_values_is_a_schema_error() -> None:
    from loom_kernel._core import decode_events
    from loom_kernel.spi import Record, SchemaError

    two = b'{"v":"1.17.0","d":{"reason":null}},{"v":"1.17.0","d":{"reason":null}}'
    with pytest.raises(SchemaError):
        decode_events([Record(1, "EXECUTION_CANCELLED", two, 0.0)], "ex/two")


@pytest.mark.usefixtures("flow_loop")
def test_the_parsed_version_cache_stays_bounded() -> None:
    from loom_kernel._core._codec import _versions, decode_event
    from loom_kernel.spi import Record

    for minor in range(200):
        payload = b'{"v":"1.%d.0","d":{"reason":null}}' % minor
        record = Record(1, "EXECUTION_CANCELLED", payload, 0.0)
        decode_event(record, "ex/v")
    assert len(_versions) <= 64


def test_the_docs_state_the_current_event_schema() -> None:
    """versioning.md said EVENT_SCHEMA stays 1.16.0 while it was 1.18.0: wherever a
    page states the current version, it is this kernel's."""
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[3] / "docs"
    stated = {
        "index.md": r'`EVENT_SCHEMA = "([\d.]+)"`',
        "schema.md": r'`EVENT_SCHEMA` is a semantic version, `"([\d.]+)"`',
        "versioning.md": r"it is ([\d.]+) now",
    }
    for page, pattern in stated.items():
        found = re.findall(pattern, (docs / page).read_text())
        assert found == [EVENT_SCHEMA], f"{page} states {found}, the kernel has {EVENT_SCHEMA}"
