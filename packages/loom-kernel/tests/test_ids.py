"""Stream and execution ids are validated in one place, before any store sees them."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from loom_kernel import Engine
from loom_kernel._core import ID_ALPHABET, events_stream, inbox_stream
from loom_kernel.spi import MAX_ID_LENGTH, InvalidIdError, validate_prefix, validate_stream_id
from loom_kernel.testing import BAD_IDS


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_bad_ids_are_refused(bad: object) -> None:
    with pytest.raises(InvalidIdError) as caught:
        validate_stream_id(bad)
    assert caught.value.value == bad
    assert repr(bad)[:40] in str(caught.value)


@pytest.mark.parametrize(
    "good", ["a", "exec/0f3a", "order-7/step:3@2", "a.b/c..d/.e", "x" * MAX_ID_LENGTH, "A~z+=_"]
)
def test_good_ids_pass_unchanged(good: str) -> None:
    assert validate_stream_id(good) == good


segment = st.text(alphabet=ID_ALPHABET.replace("/", ""), min_size=1, max_size=12).filter(
    lambda s: s not in (".", "..")
)


@given(st.lists(segment, min_size=1, max_size=6))
def test_ids_built_from_valid_segments_pass(segments: list[str]) -> None:
    value = "/".join(segments)
    if len(value) <= MAX_ID_LENGTH:
        assert validate_stream_id(value) == value
        for cut in range(len(value) + 1):
            assert validate_prefix(value[:cut]) == value[:cut]


@given(st.text(max_size=30))
def test_anything_accepted_is_a_safe_relative_path(value: str) -> None:
    try:
        validate_stream_id(value)
    except InvalidIdError:
        return
    parts = value.split("/")
    assert all(part not in ("", ".", "..") for part in parts)
    assert set(value) <= set(ID_ALPHABET)


def test_prefix_rules() -> None:
    assert validate_prefix("") == ""
    assert validate_prefix("a/") == "a/"
    assert validate_prefix("a/.") == "a/."  # a prefix of "a/.b"
    for bad in ("/a", "a//", "../x", "a b", 5):
        with pytest.raises(InvalidIdError):
            validate_prefix(bad)


@pytest.mark.parametrize(
    ("bad", "rule"),
    [
        ("/abs", "must not start with '/'"),
        ("a//b", "empty segment"),
        ("a/", "empty segment"),
        ("a/../b", "'..' segment"),
        ("", "must not be empty"),
        (3, "must be a str"),
    ],
)
def test_a_refused_id_names_the_rule_it_breaks(bad: object, rule: str) -> None:
    with pytest.raises(InvalidIdError, match=re.escape(rule)):
        validate_stream_id(bad)


def test_the_memory_of_ids_seen_valid_is_bounded() -> None:
    from loom_kernel._core import _ids

    for number in range(_ids._REMEMBERED * 2 + 10):
        assert validate_stream_id(f"ex/bounded-{number}") == f"ex/bounded-{number}"
        assert len(_ids._recently_valid) <= _ids._REMEMBERED
    assert "ex/bounded-1" not in _ids._recently_valid, "the oldest were let go"
    assert validate_stream_id("ex/bounded-1") == "ex/bounded-1", "and are checked again"


def test_a_run_started_without_a_key_gets_a_uuid7_that_sorts_by_its_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time
    import uuid

    from loom_kernel import Engine, flow, open_store
    from loom_kernel._engine import _starts

    @flow(name="noop")
    def noop(ctx: object, value: int) -> int:
        return value

    now = [1_796_000_000_000_000_000]  # ns
    monkeypatch.setattr(time, "time_ns", lambda: now[0])
    engine = Engine(open_store("memory://"), [noop])
    first = engine.start("noop", 1).id
    now[0] += 1_000_000  # a millisecond later
    second = engine.start("noop", 2).id
    for made, millis in ((first, 1_796_000_000_000), (second, 1_796_000_000_001)):
        parsed = uuid.UUID(made)
        assert (parsed.version, parsed.variant, parsed.hex) == (7, uuid.RFC_4122, made)
        assert parsed.int >> 80 == millis, "the start's Unix time in milliseconds comes first"
    assert first < second, "a later start sorts after: new journals land side by side"
    many = {_starts.fresh_execution_id() for _ in range(20_000)}
    assert len(many) == 20_000, "74 random bits: no two alike, within a millisecond too"
    parsed_many = [uuid.UUID(made) for made in many]
    assert {(p.version, p.variant) for p in parsed_many} == {(7, uuid.RFC_4122)}
    ones = zeros = 0
    for p in parsed_many:
        ones |= p.int
        zeros |= ~p.int
    random_bits = ((1 << 80) - 1) & ~((0xF << 76) | (0x3 << 62))
    assert bin(ones & zeros & random_bits).count("1") == 74, "every random bit varies"
    now[0] = -5_000_000_000  # a clock before 1970 counts as 1970
    assert uuid.UUID(_starts.fresh_execution_id()).int >> 80 == 0


@pytest.mark.usefixtures("flow_loop")
@pytest.mark.parametrize("bad", [123, None, b"id", 1.5])
def test_an_execution_id_that_is_not_a_str_is_an_invalid_id(bad: Any) -> None:
    with pytest.raises(InvalidIdError, match="an execution id is a str"):
        Engine.stream_of(bad)


@pytest.mark.usefixtures("flow_loop")
def test_the_id_limit_is_two_hundred_characters() -> None:
    assert validate_stream_id("x" * 200) == "x" * 200
    with pytest.raises(InvalidIdError, match="longer than 200"):
        validate_stream_id("x" * 201)
    assert validate_prefix("x" * 200) == "x" * 200
    with pytest.raises(InvalidIdError):
        validate_prefix("x" * 201)


@pytest.mark.usefixtures("flow_loop")
def test_an_unhashable_id_is_an_invalid_id_not_a_type_error() -> None:
    with pytest.raises(InvalidIdError):
        validate_stream_id(["ex", "1"])


@pytest.mark.parametrize("generation", [0, -1, 2.5, "2", None])
def test_a_run_numbered_other_than_by_an_int_from_one_names_no_stream(generation: Any) -> None:
    """A generation read from a damaged record names no inbox or events stream: it is
    refused, never turned into a stream nobody else would read ("in~0/...")."""
    for name in (inbox_stream, events_stream):
        with pytest.raises(InvalidIdError, match="generation"):
            name("run-1", generation)


def test_the_first_run_of_an_id_and_its_later_ones_have_streams_of_their_own() -> None:
    assert (inbox_stream("run-1"), events_stream("run-1")) == ("inbox/run-1", "events/run-1")
    assert (inbox_stream("run-1", 2), events_stream("run-1", 3)) == ("in~2/run-1", "ev~3/run-1")
