"""The coordination streams' one helper (`_coordination/_streams.py`): a fold kept per
stream and brought up to date by what was appended since, through checkpoints and
the trims that follow them, by any number of readers; a stream's last record and what
it retains, through trims."""

from __future__ import annotations

import json
import threading
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loom_kernel import MemoryStore, SchemaError, StoreUnavailableError
from loom_kernel._coordination._streams import StreamFolds, latest, retained
from loom_kernel.spi import NewRecord, Record, TrimmedError

_ITEM = "test.item"
_CHECKPOINT = "test.checkpoint"


@attrs.define
class _Items:
    stream: str
    head: int = 0
    items: list[int] = attrs.Factory(list)

    def copy(self) -> _Items:
        return _Items(self.stream, self.head, list(self.items))


def _apply(fold: _Items, record: Record) -> None:
    data = json.loads(record.payload)
    if record.kind == _CHECKPOINT:
        fold.items = list(data)
    elif record.kind == _ITEM:
        if not isinstance(data, int):
            raise SchemaError("not an item", stream=fold.stream, position=record.position)
        fold.items.append(data)
    else:
        raise SchemaError(f"unknown kind {record.kind!r}", position=record.position)


def _item(value: int) -> NewRecord:
    return NewRecord(_ITEM, json.dumps(value).encode(), 1.0)


def _folds(store: MemoryStore, kept: int | None = None) -> StreamFolds[_Items]:
    return StreamFolds(store, _Items, _apply, kept=kept)


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 1), st.integers(0, 99)),
        st.tuples(st.just("checkpoint"), st.integers(0, 1), st.just(0)),
        st.tuples(st.just("read"), st.integers(0, 1), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(_OPS)
def test_every_reader_folds_what_was_appended_whatever_the_checkpoints(ops: Any) -> None:
    """Two readers append and checkpoint at will (each checkpoint trims what it covers
    under the other): each reader's fold is always every item appended, in order."""
    store = MemoryStore()
    readers = [_folds(store), _folds(store)]
    appended: list[int] = []
    for op, who, value in ops:
        reader = readers[who]
        if op == "append":
            reader.append("s", [_item(value)])
            appended.append(value)
        elif op == "checkpoint":
            with reader.holding("s"):
                fold = reader.refresh("s")
                mark = NewRecord(_CHECKPOINT, json.dumps(fold.items).encode(), 1.0)
                assert reader.checkpoint("s", fold, mark), "nobody else writes meanwhile"
        for other in readers:
            assert other.read("s").items == appended
    assert _folds(store).read("s").items == appended, "a fresh reader starts from the floor"


def test_a_checkpoint_of_a_fold_that_fell_behind_is_refused_and_writes_nothing() -> None:
    store = MemoryStore()
    first, second = _folds(store), _folds(store)
    first.append("s", [_item(1)])
    with first.holding("s"):
        stale = first.refresh("s")
    second.append("s", [_item(2)])
    mark = NewRecord(_CHECKPOINT, json.dumps(stale.items).encode(), 1.0)
    assert not first.checkpoint("s", stale, mark)
    assert [record.kind for record in store.read("s")] == [_ITEM, _ITEM]
    assert first.read("s").items == [1, 2]


def test_a_damaged_record_is_a_schema_error_and_the_fold_is_read_afresh() -> None:
    store = MemoryStore()
    folds = _folds(store)
    folds.append("s", [_item(1)])
    assert folds.read("s").items == [1]
    store.append("s", 1, [NewRecord(_ITEM, b'"not an int"', 1.0)])
    with pytest.raises(SchemaError, match="not an item"):
        folds.read("s")
    assert folds.kept() == [], "a fold folded in part is not kept"


def test_a_deleted_stream_folds_as_empty() -> None:
    store = MemoryStore()
    folds = _folds(store)
    folds.append("s", [_item(1)])
    store.delete("s")
    assert folds.read("s").items == []


def test_a_stream_trimmed_under_every_read_gives_up_with_a_clear_error() -> None:
    class AlwaysTrimmed(MemoryStore):
        def _read(self, stream: str, after: int, limit: int | None) -> Any:
            raise TrimmedError(stream, after, after + 1)

    with pytest.raises(StoreUnavailableError, match="kept compacting it"):
        _folds(AlwaysTrimmed()).read("s")


def test_an_append_guesses_the_head_from_this_readers_last_look() -> None:
    """A quiet stream costs one append; one that moved costs one more."""
    heads: list[int] = []

    class Counting(MemoryStore):
        def _append(self, stream: str, expected: int, records: Any) -> int:
            heads.append(expected)
            return super()._append(stream, expected, records)

    store = Counting()
    folds = _folds(store)
    assert folds.append("s", [_item(1)]) == 1
    assert folds.append("s", [_item(2)]) == 2
    store.append("s", 2, [_item(3)])  # another writer
    heads.clear()
    assert folds.append("s", [_item(4)]) == 4
    assert heads == [2, 3], "the guess, then the head the conflict named"


def test_the_folds_kept_are_bounded_and_a_held_streams_lock_outlives_its_fold() -> None:
    """With room for two folds, reading a third lets the least recent go; a stream held
    meanwhile keeps one lock, so a second caller still waits for the first."""
    store = MemoryStore()
    folds = _folds(store, kept=2)
    for stream in ("a", "b", "c"):
        folds.append(stream, [_item(1)])
        folds.read(stream)
    assert folds.kept() == ["b", "c"]
    entered, release, order = threading.Event(), threading.Event(), []

    def holder() -> None:
        with folds.holding("b"):
            folds.refresh("b")
            entered.set()
            release.wait(10)
            order.append("first")

    thread = threading.Thread(target=holder)
    thread.start()
    assert entered.wait(10)
    for stream in ("d", "e"):  # "b" is let go from the folds kept while held
        folds.append(stream, [_item(1)])
        folds.read(stream)
    assert "b" not in folds.kept()

    def second_caller() -> None:
        folds.read("b")
        order.append("second")

    second = threading.Thread(target=second_caller)
    second.start()
    second.join(0.2)
    assert second.is_alive(), "the second caller waits for the first"
    release.set()
    thread.join(10)
    second.join(10)
    assert order == ["first", "second"]


def test_latest_reads_through_trims_and_says_when_it_cannot() -> None:
    store = MemoryStore()
    assert latest(store, "s") is None
    store.append("s", 0, [_item(1), _item(2)])
    store.trim("s", 2)
    found = latest(store, "s")
    assert found is not None
    assert (found.position, json.loads(found.payload)) == (2, 2)

    class Churning(MemoryStore):
        def _read(self, stream: str, after: int, limit: int | None) -> Any:
            raise TrimmedError(stream, after, after + 1)  # a newer record, every time

    churning = Churning()
    churning.append("s", 0, [_item(1)])
    with pytest.raises(StoreUnavailableError, match="kept changing"):
        latest(churning, "s")


def test_retained_reads_from_the_floor_and_none_once_deleted() -> None:
    store = MemoryStore()
    store.append("s", 0, [_item(1), _item(2), _item(3)])
    store.trim("s", 3)
    kept = retained(store, "s")
    assert kept is not None
    assert [record.position for record in kept] == [3]
    store.delete("s")
    assert retained(store, "s") is None


def test_a_fold_cut_short_by_an_interrupt_is_dropped_not_kept_half_made() -> None:
    """An interrupt between two changes a record makes to a fold (a message's key noted,
    the message not yet listed) would leave the kept fold half made, and every later
    read would build on it. The fold is dropped: the next read starts afresh."""
    store = MemoryStore()
    interrupt = [True]

    def halfway(fold: _Items, record: Record) -> None:
        fold.items.append(-1)  # a first change
        if interrupt[0] and json.loads(record.payload) == 2:
            interrupt[0] = False
            raise KeyboardInterrupt
        fold.items[-1] = json.loads(record.payload)  # the second

    folds = StreamFolds(store, _Items, halfway)
    folds.append("s", [_item(1)])
    assert folds.read("s").items == [1]
    folds.append("s", [_item(2), _item(3)])
    with pytest.raises(KeyboardInterrupt):
        folds.read("s")
    assert folds.read("s").items == [1, 2, 3], "read afresh, not on the half-made fold"
