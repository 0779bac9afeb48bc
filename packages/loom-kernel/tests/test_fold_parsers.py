"""The fold's three ways to read a journal agree: typed msgspec structs for the steps
(the `fast` extra), untyped msgspec for the rest, and the standard library's json alone,
which is all the kernel needs; a step whose record leaves `attempts` out counts one."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loom_kernel import Context, Engine, MemoryStore, flow
from loom_kernel._core import (
    _codec,
    _fast_fold,
    _state,
    decode_step_runs,
    dump_json,
    encode_step_completed,
)
from loom_kernel.events import (
    EVENT_SCHEMA,
    ExecutionStarted,
    ExecutionState,
    ExecutionSuspended,
    StepCompleted,
    encode_event,
)
from loom_kernel.spi import NewRecord, Record, SchemaError

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**100), max_value=2**100)
    | st.sampled_from([2**64, 2**80, -(2**63) - 1, 2**53 + 1])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)

#: Step payloads the typed decoder must refuse, so the general path judges them
#: (CURRENT stands for this kernel's EVENT_SCHEMA: the typed decoder's own version).
odd_steps = st.sampled_from(
    [
        payload.replace(b"CURRENT", EVENT_SCHEMA.encode())
        for payload in (
            b'{"v":"1.15.0","d":{"index":%d,"name":"old","result":1,"attempts":1}}',
            b'{"v":"CURRENT","d":{"index":%d,"name":"x","result":1,"attempts":1,"extra":2}}',
            b'{"v":"CURRENT","d":{"index":%d,"name":"x","result":1e400,"attempts":1}}',
            b'{"v":"CURRENT","d":{"index":%d,"name":"x","result":1,"attempts":1.0}}',
            # two envelopes in one record: must not shift the frames after it
            b'{"v":"CURRENT","d":{"index":%d,"name":"x","result":1,"attempts":1}},'
            b'{"v":"CURRENT","d":{"index":99,"name":"y","result":2,"attempts":1}}',
        )
    ]
)


def _journal(results: list[Any], odd: bytes | None, parks: frozenset[int]) -> list[Record]:
    started = encode_event(ExecutionStarted("flow", "version:1", None, None, None), 1.0)
    records = [Record(1, started.kind, started.payload, started.timestamp)]
    for index, result in enumerate(results):
        step = encode_step_completed(index, f"s{index}", dump_json(result), 1, 2.0)
        records.append(Record(len(records) + 1, step.kind, step.payload, step.timestamp))
        if index in parks:  # runs of steps broken by other events, anywhere
            gate = encode_event(ExecutionSuspended(index, "g"), 3.0)
            records.append(Record(len(records) + 1, gate.kind, gate.payload, gate.timestamp))
    if odd is not None:
        payload = odd % len(results)
        records.append(Record(len(records) + 1, StepCompleted.KIND, payload, 4.0))
    return records


def _fold(records: list[Record], parser: str) -> Any:
    with pytest.MonkeyPatch.context() as patch:
        if parser != "typed":
            patch.setattr(_fast_fold, "decode_step_runs", None)
        if parser == "json":
            patch.setattr(_codec, "parse_many", json.loads)
        state = ExecutionState(id="x")
        try:
            _state.fold_records(state, records, "ex/x")
        except SchemaError as exc:
            return ("error", exc.position)
        return state


@settings(max_examples=150, deadline=None)
@given(
    results=st.lists(json_values, max_size=12),
    odd=st.none() | odd_steps,
    parks=st.frozensets(st.integers(min_value=0, max_value=11)),
)
def test_typed_untyped_and_json_fold_a_journal_alike(
    results: list[Any], odd: bytes | None, parks: frozenset[int]
) -> None:
    assert decode_step_runs is not None, "the workspace installs the fast extra"
    records = _journal(results, odd, parks)
    by_msgspec = _fold(records, "typed")
    # repr, not ==: 2**80 == float(2**80), but a replay must give back the same type
    assert repr(by_msgspec) == repr(_fold(records, "untyped"))
    assert repr(by_msgspec) == repr(_fold(records, "json"))


@pytest.mark.usefixtures("flow_loop")
def test_a_journaled_step_without_attempts_counts_one() -> None:
    """A completed step of the current schema whose data lacks `attempts` (a writer
    that leaves the default out) is not the fast fold's exact shape: it is decoded,
    and counts one attempt."""

    @flow(name="one_step")
    def one_step(ctx: Context, _input: Any) -> Any:
        return ctx.step("a", lambda: 5)

    written = MemoryStore()
    Engine(written, [one_step], listeners=[]).start("one_step", key="x")
    started, step, _completed = written.read("ex/x")
    envelope = json.loads(step.payload)
    del envelope["d"]["attempts"]
    store = MemoryStore()
    store.append(
        "ex/x",
        0,
        [
            NewRecord(started.kind, started.payload, started.timestamp),
            NewRecord(step.kind, json.dumps(envelope).encode(), step.timestamp),
        ],
    )
    frames = Engine(store, [one_step], listeners=[]).frames("x")
    assert (frames[0].result, frames[0].attempts) == (5, 1)


@pytest.mark.usefixtures("flow_loop")
def test_the_kernel_alone_folds_without_msgspec(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import json
    import sys

    from loom_kernel._core import _fast_fold

    monkeypatch.setitem(sys.modules, "msgspec", None)  # an import of it fails
    spec = importlib.util.spec_from_file_location("_fold_without_msgspec", _fast_fold.__file__)
    assert spec is not None
    assert spec.loader is not None
    alone = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(alone)
    assert alone.decode_step_runs is None
    assert alone.parse_many is json.loads

    assert alone.step_runs([]) is None, "the general path"
