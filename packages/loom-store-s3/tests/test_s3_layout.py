"""Properties of the S3 key layout and batch format, over the whole id charset (no server)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from loom_kernel._core import ID_ALPHABET
from loom_kernel.spi import NewRecord, SchemaError, StoreUnavailableError
from loom_store_s3._batch import decode_batch, encode_batch, encode_marker
from loom_store_s3._layout import Layout

_segment = st.text(alphabet=ID_ALPHABET.replace("/", ""), min_size=1, max_size=8).filter(
    lambda s: s not in (".", "..")
)
stream_ids = st.lists(_segment, min_size=1, max_size=4).map("/".join)
prefixes = st.one_of(st.just(""), stream_ids)


@given(st.lists(stream_ids, min_size=2, max_size=30, unique=True), prefixes)
def test_key_order_is_stream_name_order_and_streams_never_interleave(
    names: list[str], prefix: str
) -> None:
    layout = Layout(prefix, 1)
    keys = []
    for name in names:
        for start in (0, 7, 10**12):
            keys.append((layout.batch_key(name, start), name, start))
        keys.append((layout.floor_key(name, 3), name, -1))
    ordered = [name for _key, name, _start in sorted(keys)]
    # every stream's keys are contiguous, and streams appear in str order
    collapsed = [
        name for index, name in enumerate(ordered) if index == 0 or ordered[index - 1] != name
    ]
    assert collapsed == sorted(names)
    for name in names:
        starts = [start for key, n, start in sorted(keys) if n == name and start >= 0]
        assert starts == sorted(starts)


@given(stream_ids, stream_ids, prefixes, prefixes)
def test_no_two_streams_or_stores_share_a_key(
    first: str, second: str, prefix_a: str, prefix_b: str
) -> None:
    a, b = Layout(prefix_a, 4), Layout(prefix_b, 4)
    if (first, prefix_a) != (second, prefix_b):
        assert a.batch_key(first, 5) != b.batch_key(second, 5)
        assert a.stream_dir(first) != b.stream_dir(second)
    # a key belongs to its store's root, and the name comes back out of a listing prefix
    assert a.batch_key(first, 0).startswith(a.root)
    root = a.journal_root(a.shard(first))
    assert Layout.name_from_prefix(root, a.stream_dir(first)) == first
    assert Layout.after_stream(root, first) > a.batch_key(first, 10**19)


@given(
    st.lists(
        st.tuples(
            st.text(alphabet="abc.XYZ", min_size=1, max_size=10),
            st.binary(max_size=64),
            st.floats(allow_nan=False, allow_infinity=False)
            | st.integers(-(2**40), 2**40).map(float),
        ),
        min_size=1,
        max_size=8,
    ),
    st.integers(0, 10**12),
)
def test_a_batch_decodes_to_exactly_what_was_encoded(
    rows: list[tuple[str, bytes, float]], start: int
) -> None:
    records = tuple(NewRecord(kind, payload, stamp) for kind, payload, stamp in rows)
    batch = decode_batch("k", encode_batch("c0ffee", start, records))
    assert (batch.commit, batch.start, batch.count, batch.state) == (
        "c0ffee",
        start,
        len(records),
        "live",
    )
    assert [(r.position, r.kind, r.payload, r.timestamp) for r in batch.records] == [
        (start + offset, record.kind, record.payload, record.timestamp)
        for offset, record in enumerate(records, start=1)
    ]


def test_markers_keep_start_and_count() -> None:
    stub = decode_batch("k", encode_marker("c", 4, 3, "stub"))
    assert (stub.start, stub.count, stub.end, stub.state, stub.records) == (4, 3, 7, "stub", ())
    tomb = decode_batch("k", encode_marker("c", 9, 0, "tomb"))
    assert (tomb.end, tomb.state) == (9, "tomb")


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json\n",
        b"[1,2]\n",
        b'{"v":1,"commit":"c","start":-1,"count":0,"state":"live"}',
        b'{"v":1,"commit":"c","start":0,"count":1,"state":"live","kinds":["k"],'
        b'"ts":[1.0],"sizes":[5]}\nabc',
        b'{"v":1,"commit":"c","start":0,"count":1,"state":"zombie"}',
        b'{"v":1,"commit":"c","start":-1,"count":0,"state":"stub"}',
        b'{"v":1,"commit":"c","start":"1","count":0,"state":"stub"}',
        b'{"v":1,"commit":"c","start":0,"count":true,"state":"stub"}',
        b'{"v":1,"commit":"c","start":0,"count":-2,"state":"tomb"}',
        b'{"v":1,"commit":"c","start":0,"count":1,"state":"live","kinds":[7],'
        b'"ts":[1.0],"sizes":[3]}\nabc',
        b'{"v":1,"commit":"c","start":0,"count":1,"state":"live","kinds":["k"],'
        b'"ts":["1.0"],"sizes":[3]}\nabc',
        b'{"v":1,"commit":"c","start":0,"count":1,"state":"live","kinds":["k"],'
        b'"ts":[true],"sizes":[3]}\nabc',
    ],
)
def test_a_damaged_batch_is_store_unavailable_naming_the_key(body: bytes) -> None:
    with pytest.raises(StoreUnavailableError, match="damaged batch object 'the/key'"):
        decode_batch("the/key", body)


def test_a_record_with_a_bad_kind_or_timestamp_is_named_by_its_position() -> None:
    body = (
        b'{"v":1,"commit":"c","start":4,"count":2,"state":"live","kinds":["k","k"],'
        b'"ts":[1.0,null],"sizes":[1,2]}\nabc'
    )
    with pytest.raises(StoreUnavailableError, match="record 6 has a bad kind or timestamp"):
        decode_batch("the/key", body)
    good = body.replace(b"null", b"2")
    assert [record.position for record in decode_batch("the/key", good).records] == [5, 6]


def test_a_batch_from_a_newer_format_asks_for_an_upgrade() -> None:
    with pytest.raises(SchemaError, match="upgrade loom-store-s3"):
        decode_batch("k", b'{"v":2,"commit":"c","start":0,"count":0,"state":"tomb"}')


@given(stream_ids, st.integers(0, 10**19))
def test_a_key_in_a_stream_directory_is_an_entry_only_when_it_is_loom_s(
    name: str, start: int
) -> None:
    layout = Layout("p", 4)
    directory = layout.stream_dir(name)
    batch = layout.batch_key(name, start)
    assert Layout.parse_entry(directory, batch) == ("R", start)
    digits = batch[len(directory) + 1 :]
    for foreign in ("X" + digits, "Rx" + digits[1:], "R" + digits[:-1] + "x", "R" + digits + "0"):
        assert Layout.parse_entry(directory, directory + foreign) is None, foreign


def test_a_streams_shard_is_a_fixed_function_of_its_name() -> None:
    """The shard is part of every key: a bucket written by one version of the store
    is read by the next only if each stream's shard stays what it was."""
    assert [Layout("", 16).shard(s) for s in ["ex/a", "ex/b", "runs/open/00", "timers/x", "q"]] == [
        10,
        4,
        8,
        13,
        5,
    ]
    assert Layout("", 256).shard("ex/a") == 42
    assert Layout("p/", 1).shard("ex/a") == 0
