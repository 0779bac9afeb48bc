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
