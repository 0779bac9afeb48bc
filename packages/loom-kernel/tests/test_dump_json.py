"""dump_json writes what json.dumps writes, byte for byte, and refuses what it refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from loom_kernel import InvalidArgumentError
from loom_kernel._core import dump_json

keys = st.text(max_size=5) | st.integers() | st.floats(allow_nan=False) | st.booleans() | st.none()
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats()  # NaN and the infinities included: both sides must refuse them
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(keys, inner, max_size=4)
    ),
    max_leaves=12,
)


def _reference(value: Any) -> str | None:
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except ValueError:  # NaN, infinity, a lone surrogate
        return None
    return text


@given(values)
def test_dump_json_is_json_dumps(value: Any) -> None:
    expected = _reference(value)
    if expected is None:
        with pytest.raises(InvalidArgumentError):
            dump_json(value)
    else:
        assert dump_json(value) == expected


@pytest.mark.parametrize("value", [{1, 2}, object(), {"k": b"bytes"}, {("tuple",): 1}])
def test_what_json_cannot_hold_is_refused(value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="not JSON"):
        dump_json(value)


def test_a_cycle_is_refused_not_a_crash() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    mapping: dict[str, Any] = {}
    mapping["self"] = mapping
    for value in (cycle, mapping):
        with pytest.raises(InvalidArgumentError, match="not JSON"):
            dump_json(value)


def _has_other_keys(value: Any) -> bool:
    if isinstance(value, dict):
        return any(type(key) is not str or _has_other_keys(inner) for key, inner in value.items())
    if isinstance(value, list | tuple):
        return any(_has_other_keys(inner) for inner in value)
    return False


@given(values)
def test_a_payload_with_a_key_that_is_not_a_str_is_refused_never_rewritten(value: Any) -> None:
    """`{1: "x"}` arrived as `{"1": "x"}`: every payload path (a step's result, an
    input, a message, a resume, a published value) goes through `to_json_text`, which
    gives back what it was given, or refuses."""
    from loom_kernel._core import to_json_text

    reference = _reference(value)
    if _has_other_keys(value) or reference is None:
        with pytest.raises(InvalidArgumentError) as refused:
            to_json_text(value, "the payload")
        if reference is not None:  # JSON could dump it: only its keys are wrong
            assert "JSON's keys are str" in str(refused.value)
    else:
        assert json.loads(to_json_text(value, "the payload")) == json.loads(reference)
