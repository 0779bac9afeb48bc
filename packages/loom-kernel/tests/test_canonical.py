"""stable_stringify is RFC 8785 canonical JSON, iterative, and refuses what is not JSON."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import rfc8785
from hypothesis import given
from hypothesis import strategies as st
from loom_kernel import CanonicalJSONError, InvalidArgumentError
from loom_kernel.events import stable_hash, stable_stringify

# RFC 8785 appendix B: IEEE-754 bit patterns and their canonical text.
RFC_NUMBERS = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),
]


def _double(bits: str) -> float:
    value: float = struct.unpack(">d", bytes.fromhex(bits))[0]
    return value


@pytest.mark.parametrize(("bits", "text"), RFC_NUMBERS)
def test_rfc_number_examples(bits: str, text: str) -> None:
    assert stable_stringify(_double(bits)) == text


@pytest.mark.parametrize("bits", ["7fffffffffffffff", "7ff0000000000000", "fff0000000000000"])
def test_rfc_refuses_nan_and_infinity(bits: str) -> None:
    with pytest.raises(CanonicalJSONError, match=r"at \$\[0\].*not a JSON number") as caught:
        stable_stringify([_double(bits)])
    assert caught.value.path == "$[0]"
    assert "not a JSON number" in caught.value.reason


def test_rfc_sample_object() -> None:
    value = {
        "numbers": [333333333.33333329, 1e30, 4.50, 2e-3, 0.000000000000000000000000001],
        "string": "\u20ac$\u000f\u000aA'\u0042\u0022\u005c\\\"/",
        "literals": [None, True, False],
    }
    assert stable_stringify(value) == (
        '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
        '"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    )


def test_rfc_property_sorting_by_utf16_code_units() -> None:
    value = {
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\U0001f600": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis",
    }
    keys = list(json.loads(stable_stringify(value)))
    assert keys == ["\r", "1", "\u0080", "\u00f6", "\u20ac", "\U0001f600", "\ufb33"]


def test_big_integers_that_doubles_hold_are_written_as_doubles() -> None:
    assert stable_stringify([2**53, -(10**20), 35257376518737070]) == (
        "[9007199254740992,-100000000000000000000,35257376518737070]"
    )
    with pytest.raises(CanonicalJSONError, match="same digits"):
        stable_stringify(2**60)  # its double writes 1152921504606847000


def test_issue_examples() -> None:
    assert stable_stringify([1.0, 1e21, -0.0]) == "[1,1e+21,0]"
    assert stable_stringify({"b": 1, "a": {"d": [], "c": {}}}) == '{"a":{"c":{},"d":[]},"b":1}'
    assert stable_stringify("\x1f\u2028é") == '"\\u001f\u2028é"'


def test_deep_nesting_is_refused_without_recursion_error() -> None:
    value: Any = []
    for _ in range(100_000):
        value = [value]
    with pytest.raises(CanonicalJSONError, match="deeper than max_depth=1000"):
        stable_stringify(value)
    assert stable_stringify(value, max_depth=200_000).startswith("[[[[")


def test_depth_limit_is_exact() -> None:
    assert stable_stringify([[[]]], max_depth=3) == "[[[]]]"
    with pytest.raises(CanonicalJSONError, match=r"at \$\[0\]\[0\]: nested deeper"):
        stable_stringify([[[]]], max_depth=2)


def test_cycles_are_refused_with_their_path() -> None:
    loop: dict[str, Any] = {"a": [1]}
    loop["a"].append(loop)
    with pytest.raises(CanonicalJSONError, match=r'at \$\["a"\]\[1\]: .*cycle'):
        stable_stringify(loop)


def test_shared_but_acyclic_values_are_fine() -> None:
    shared = [1, 2]
    assert stable_stringify({"x": shared, "y": [shared, shared]}) == '{"x":[1,2],"y":[[1,2],[1,2]]}'


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ({1: "a"}, "key 1 is a int"),
        ({"a": {None: 1}}, "key None"),
        ({"s": {1, 2}}, "set is not a JSON value"),
        ([b"x"], "bytes is not a JSON value"),
        ([object()], "object is not a JSON value"),
        ([2**53 + 1], "no IEEE-754 double with the same digits"),
        ([-(2**53) - 1], "no IEEE-754 double with the same digits"),
        ([10**400], "no IEEE-754 double with the same digits"),
        ({"k": "\ud800"}, "lone surrogate"),
        ({"\udfff": 1}, "lone surrogate"),
    ],
)
def test_values_that_are_not_json_are_refused(value: Any, reason: str) -> None:
    with pytest.raises(CanonicalJSONError, match=reason) as caught:
        stable_stringify(value)
    assert isinstance(caught.value, InvalidArgumentError)


def test_stable_hash_is_sha256_of_the_canonical_bytes() -> None:
    assert stable_hash({"b": 1, "a": "é"}) == stable_hash({"a": "é", "b": 1.0})
    assert (
        stable_hash([]) == "sha256:4f53cda18c2baa0c0354bb5f9a3ecbe5ed12ab4d8e11ba873c2f11161202b945"
    )


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53) + 1, 2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(), children, max_size=5)
    ),
    max_leaves=30,
)


def _shuffled(value: Any, seed: int) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        items.sort(key=lambda kv: hash((kv[0], seed)))
        return {k: _shuffled(v, seed) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, seed) for v in value]
    return value


def _as_doubles(value: Any) -> Any:
    """JSON numbers are doubles: compare values with every number as a float."""
    if isinstance(value, dict):
        return {k: _as_doubles(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_doubles(v) for v in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


@given(json_values)
def test_round_trips_through_json_loads(value: Any) -> None:
    text = stable_stringify(value)
    assert _as_doubles(json.loads(text)) == _as_doubles(value)
    assert stable_stringify(json.loads(text)) == text


@given(json_values, st.integers())
def test_key_order_never_changes_the_bytes(value: Any, seed: int) -> None:
    assert stable_stringify(_shuffled(value, seed)) == stable_stringify(value)


@given(json_values)
def test_agrees_with_the_rfc8785_reference_library(value: Any) -> None:
    assert stable_stringify(value).encode("utf-8") == rfc8785.dumps(value)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_numbers_agree_with_the_reference_and_round_trip(number: float) -> None:
    text = stable_stringify(number)
    assert text.encode() == rfc8785.dumps(number)
    assert float(text) == number
