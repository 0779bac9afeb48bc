"""The run index's batches of ended runs as a listing reads them: msgspec's typed
decoder (where installed) gives exactly what the checks by hand give, accepts the
batches Loom writes, and hands every other batch to the checks, which accept it or
name the damage as they always did."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel import MemoryStore, SchemaError, Status
from loom_kernel._coordination import RunIndex, _run_index, partition_of
from loom_kernel._coordination._filed import decode_filed
from loom_kernel.spi import NewRecord
from loom_kernel.testing import FakeClock

_STREAM = "runs/completed/" + partition_of("x")
_FILED_AT = 5.0

#: Numbers any JSON parser reads as such (2**70 and Infinity are among the odd values).
_numbers = st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False)
_odd = (
    st.none()
    | st.booleans()
    | st.integers(-2, 2)
    | st.sampled_from([2**70, -(2**70), float("inf")])
    | _numbers
    | st.text(max_size=3)
    | st.sampled_from(["1", "2.5"])
    | st.lists(st.none(), max_size=1)
)
_valid = st.tuples(
    st.text(max_size=4),
    st.text(max_size=4),
    _numbers,
    st.integers(1, 2**40),
    st.none() | _numbers,
    st.none() | st.text(max_size=4),
)


@st.composite
def _entry(draw: st.DrawFn) -> Any:
    """An entry as Loom writes one (cut to 0..7 fields), at most one field of it
    something else; or not a list at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(_odd | st.dictionaries(st.text(max_size=2), _odd, max_size=2))
    fields = list(draw(_valid))
    if draw(st.integers(0, 2)):
        fields[draw(st.integers(0, 5))] = draw(_odd)
    return fields[: draw(st.sampled_from([6, 6, 6, 6, 2, 3, 4, 5, 0, 1, 7]))]


_batch = st.one_of(
    st.fixed_dictionaries({"runs": st.lists(_entry(), max_size=4)}),
    st.fixed_dictionaries({"runs": st.lists(_entry(), max_size=4), "more": _odd}),
    _odd,
)


def _listed(payload: bytes) -> list[Any] | tuple[str | None, int | None]:
    """What the index lists of one batch: its entries, or where it is damaged."""
    store = MemoryStore()
    store.append(_STREAM, 0, [NewRecord("loom.run.ended", payload, _FILED_AT)])
    try:
        return list(RunIndex(store, FakeClock()).ended_entries())
    except SchemaError as exc:
        return exc.stream, exc.position


@settings(max_examples=1000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=_batch)
def test_the_typed_decoder_lists_what_the_checks_by_hand_list(
    batch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = json.dumps(batch).encode()
    typed = _listed(payload)
    with monkeypatch.context() as patched:
        patched.setattr(_run_index, "decode_filed", lambda payload: None)
        by_hand = _listed(payload)
    # By their reprs: of one type (1 == 1.0, but not as text), and "NaN" filed as a
    # time (float() takes it) equal to itself.
    assert repr(typed) == repr(by_hand)


def test_the_batches_loom_writes_take_the_typed_path() -> None:
    pytest.importorskip("msgspec")
    store, clock = MemoryStore(), FakeClock(100.0)
    index = RunIndex(store, clock)
    index.index_ended(
        [("a", Status.COMPLETED, "work"), ("b", Status.COMPLETED, "work")],
        {"a": (7.0, 2, 3.0, "parent-run")},
    )
    batches = [
        record for stream in store.streams("runs/completed/") for record in store.read(stream)
    ]
    assert batches
    assert all(decode_filed(record.payload) is not None for record in batches)
    entries = sorted(index.ended_entries())
    filed_b = store.read("runs/completed/" + partition_of("b"))[-1].timestamp
    assert [
        (e.execution_id, e.ended_at, e.generation, e.started_at, e.parent) for e in entries
    ] == [
        ("a", 7.0, 2, 3.0, "parent-run"),
        ("b", filed_b, 1, None, None),
    ]
