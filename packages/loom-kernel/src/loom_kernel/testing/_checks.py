"""Example checks of every operation and error of the journal contract (docs/spi.md)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from loom_kernel._core._errors import (
    ConflictError,
    InvalidArgumentError,
    InvalidIdError,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
)
from loom_kernel._core._ids import ID_ALPHABET, MAX_ID_LENGTH
from loom_kernel._core._records import MAX_KIND_LENGTH, NewRecord, Record
from loom_kernel._spi._faults import Fault, SupportsFaultInjection
from loom_kernel._spi._journal import JournalStore
from loom_kernel.testing._harness import NotApplicable, StoreHarness

__all__ = ["BAD_IDS", "CHECKS", "Check", "list_in_pages", "read_in_pages", "records"]

Check = Callable[[StoreHarness], None]
CHECKS: dict[str, Check] = {}

#: Ids every store must refuse with InvalidIdError, writing nothing.
BAD_IDS: tuple[Any, ...] = (
    "",
    "/a",
    "a/",
    "a//b",
    ".",
    "..",
    "a/./b",
    "a/../b",
    "../escape",
    "a b",
    "a\\b",
    "a%2Fb",
    "é",
    "a\x00b",
    "a\nb",
    "x" * (MAX_ID_LENGTH + 1),
    7,
    None,
    b"bytes",
)


def _check(func: Check) -> Check:
    CHECKS[func.__name__.removeprefix("check_")] = func
    return func


def records(count: int, tag: str = "r", start_ts: float = 1_700_000_000.25) -> list[NewRecord]:
    """Make `count` distinct records (kind, payload and timestamp all differ)."""
    return [
        NewRecord(f"test.{tag}", f'{{"{tag}":{index}}}'.encode(), start_ts + index)
        for index in range(count)
    ]


def _same(got: list[Record], want: list[NewRecord], first: int) -> None:
    assert [r.position for r in got] == list(range(first, first + len(want))), (
        f"positions {[r.position for r in got]} are not {first}..{first + len(want) - 1}"
    )
    for record, sent in zip(got, want, strict=True):
        assert (record.kind, record.payload, record.timestamp) == (
            sent.kind,
            sent.payload,
            sent.timestamp,
        ), f"record {record.position} came back as {record!r}, sent {sent!r}"


#: More pages than any paging in the kit can need: reaching it means the cursor is ignored.
_MAX_PAGES = 500


def read_in_pages(store: JournalStore, stream: str, after: int, size: int) -> list[Record]:
    """Read a stream page by page, each page starting after the last record of the one before."""
    joined: list[Record] = []
    for _ in range(_MAX_PAGES):
        page = store.read(stream, joined[-1].position if joined else after, size)
        assert len(page) <= size, f"read returned {len(page)} records for limit {size}"
        if not page:
            return joined
        joined.extend(page)
    raise AssertionError(f"reading {stream!r} in pages of {size} did not end")


def list_in_pages(store: JournalStore, prefix: str, size: int) -> list[str]:
    """List streams page by page, each page starting after the last name of the one before."""
    names: list[str] = []
    for _ in range(_MAX_PAGES):
        page = store.streams(prefix, names[-1] if names else None, size)
        assert len(page) <= size, f"streams returned {len(page)} names for limit {size}"
        if not page:
            return names
        names.extend(page)
    raise AssertionError(f"listing {prefix!r} in pages of {size} did not end")


@contextmanager
def _store(harness: StoreHarness) -> Iterator[JournalStore]:
    store = harness.open()
    try:
        yield store
    finally:
        store.close()


@contextmanager
def _twins(harness: StoreHarness) -> Iterator[tuple[JournalStore, JournalStore]]:
    """A store and a second instance over the same data."""
    if harness.twin is None:
        raise NotApplicable(
            "the harness opens no second instance over the same data "
            "(StoreHarness.twin, StoreContract.twin_store)"
        )
    with _store(harness) as store:
        twin = harness.twin(store)
        try:
            yield store, twin
        finally:
            twin.close()


def _raises(kind: type[BaseException], func: Callable[[], object], what: str) -> BaseException:
    try:
        result = func()
    except kind as exc:
        return exc
    except Exception as exc:
        raise AssertionError(
            f"{what}: raised {type(exc).__name__}: {exc}, not {kind.__name__}"
        ) from exc
    raise AssertionError(f"{what}: returned {result!r} instead of raising {kind.__name__}")


@_check
def check_empty_stream(harness: StoreHarness) -> None:
    with _store(harness) as store:
        assert store.head("a") == 0, "a stream never written must have head 0"
        assert store.read("a") == [], "a stream never written must read as empty"
        assert store.streams() == [], "a new store must list no streams"


@_check
def check_append_and_read_back(harness: StoreHarness) -> None:
    with _store(harness) as store:
        first, second = records(3, "x"), records(2, "y")
        assert store.append("s", 0, first) == 3, "append at 0 must return the new head 3"
        assert store.append("s", 3, second) == 5, "append at 3 must return the new head 5"
        assert store.head("s") == 5
        _same(store.read("s"), first + second, 1)


@_check
def check_payloads_and_timestamps_are_opaque(harness: StoreHarness) -> None:
    big_json = '{ "b" : 1.0, "z": -0.0, "b": 2, "s": "\\ud83d", "pad": "' + "x" * 70_000 + '" }'
    payloads = [
        b"",
        b"\x00\xff\xfe not utf-8",
        bytes(range(256)),
        b"x" * 300_000,
        '{"é":"😀"}'.encode(),
        big_json.encode(),  # JSON as no canonical form writes it: kept byte for byte
        big_json.encode("utf-16"),
    ]
    timestamps = [0.0, 1.5, 1_700_000_000.123456, -12.25, 2.0**40 + 0.5]
    sent = [
        NewRecord("k." + str(index), payload, timestamps[index % len(timestamps)])
        for index, payload in enumerate(payloads)
    ]
    with _store(harness) as store:
        store.append("opaque", 0, sent)
        _same(store.read("opaque"), sent, 1)


@_check
def check_stale_append_conflicts_and_writes_nothing(harness: StoreHarness) -> None:
    with _store(harness) as store:
        store.append("s", 0, records(2))
        for expected in (0, 1, 3, 4, 100):
            exc = _raises(
                ConflictError,
                partial(store.append, "s", expected, records(3, "stale")),
                f"append at expected={expected} when the head is 2",
            )
            assert isinstance(exc, ConflictError)
            assert (exc.stream, exc.expected) == ("s", expected), f"conflict names {exc!r}"
            assert exc.actual == 2, f"conflict must report the actual head 2, not {exc.actual}"
        assert store.head("s") == 2, "a refused append must not move the head"
        _same(store.read("s"), records(2), 1)


@_check
def check_expected_inside_a_batch_conflicts(harness: StoreHarness) -> None:
    with _store(harness) as store:
        store.append("s", 0, records(3, "a"))
        store.append("s", 3, records(3, "b"))
        for inside in (1, 2, 4, 5):
            _raises(
                ConflictError,
                partial(store.append, "s", inside, records(1, "c")),
                f"append at {inside}, a position inside an earlier batch",
            )
        assert store.head("s") == 6
        _same(store.read("s"), records(3, "a") + records(3, "b"), 1)


@_check
def check_append_to_new_stream_needs_zero(harness: StoreHarness) -> None:
    with _store(harness) as store:
        _raises(
            ConflictError, lambda: store.append("new", 1, records(1)), "append at 1 to a new stream"
        )
        assert store.head("new") == 0
        assert store.streams() == [], "a refused append must not create the stream"


@_check
def check_read_windows_and_pages(harness: StoreHarness) -> None:
    with _store(harness) as store:
        sent = records(10)
        store.append("s", 0, sent[:4])
        store.append("s", 4, sent[4:])
        for after in range(11):
            _same(store.read("s", after), sent[after:], after + 1)
            for limit in (1, 3, 10, 20):
                _same(store.read("s", after, limit), sent[after : after + limit], after + 1)
        assert store.read("s", 15) == [], "reading after the head must return nothing"
        _same(read_in_pages(store, "s", 0, 3), sent, 1)


@_check
def check_streams_prefix_order_and_paging(harness: StoreHarness) -> None:
    names = [
        "a",
        "a/b",
        "a/b/c",
        "a/c",
        "a-z",
        "a.b",
        "ab",
        "b",
        "b/a",
        "Z",
        "0",
        "a~",
        "a:1",
        "a@x",
    ]
    with _store(harness) as store:
        for name in names:
            store.append(name, 0, records(1))
        assert store.streams() == sorted(names), f"streams() gave {store.streams()}"
        for prefix in ("", "a", "a/", "a/b", "ab", "b/", "c", "a~"):
            want = sorted(n for n in names if n.startswith(prefix))
            assert store.streams(prefix) == want, (
                f"streams({prefix!r}) gave {store.streams(prefix)}"
            )
            for limit in (1, 2, 5):
                paged = list_in_pages(store, prefix, limit)
                assert paged == want, f"paging streams({prefix!r}) by {limit} gave {paged}"
        assert store.streams("a/", "a/b") == ["a/b/c", "a/c"], "after must be exclusive"
        assert store.streams("b", "a") == ["b", "b/a"], "an after below the prefix lists it all"


@_check
def check_trim_keeps_head_and_positions(harness: StoreHarness) -> None:
    with _store(harness) as store:
        sent = records(6)
        store.append("s", 0, sent)
        store.trim("s", 4)
        assert store.head("s") == 6, "trim must never move the head"
        _same(store.read("s", 3), sent[3:], 4)
        _raises(TrimmedError, lambda: store.read("s", 2), "read below the trim floor")
        _raises(TrimmedError, lambda: store.read("s"), "read from 0 of a trimmed stream")
        store.trim("s", 2)  # below the floor: a no-op
        _same(store.read("s", 3), sent[3:], 4)
        _raises(
            ConflictError, lambda: store.append("s", 3, records(1, "reuse")), "append at the floor"
        )
        assert store.append("s", 6, records(1, "more")) == 7, "appends continue after a trim"
        store.trim("s", 8)  # everything
        assert store.head("s") == 7
        assert store.read("s", 7) == []
        _raises(InvalidArgumentError, lambda: store.trim("s", 9), "trim beyond head + 1")
        assert store.append("s", 7, records(1, "last")) == 8, "a fully trimmed stream still appends"
        assert store.streams() == ["s"], "a trimmed stream is still listed"


@_check
def check_delete_retires_the_name(harness: StoreHarness) -> None:
    with _store(harness) as store:
        store.append("gone", 0, records(3))
        store.append("kept", 0, records(1))
        store.delete("gone")
        assert store.streams() == ["kept"], "a deleted stream must not be listed"
        _raises(StreamDeletedError, lambda: store.head("gone"), "head of a deleted stream")
        _raises(StreamDeletedError, lambda: store.read("gone"), "read of a deleted stream")
        for expected in (0, 3):
            _raises(
                StreamDeletedError,
                partial(store.append, "gone", expected, records(1)),
                f"append at {expected} to a deleted stream (its positions must never be reused)",
            )
        store.delete("gone")  # idempotent
        store.delete("never")  # retires a name never used
        _raises(
            StreamDeletedError,
            lambda: store.append("never", 0, records(1)),
            "append to a retired name",
        )
        assert store.streams() == ["kept"]
        _same(store.read("kept"), records(1), 1)


@_check
def check_invalid_ids_are_refused(harness: StoreHarness) -> None:
    with _store(harness) as store:
        store.append("ok", 0, records(1))
        operations: list[tuple[str, Callable[[Any], object]]] = [
            ("append", lambda bad: store.append(bad, 0, records(1))),
            ("read", store.read),
            ("head", store.head),
            ("trim", lambda bad: store.trim(bad, 1)),
            ("delete", store.delete),
        ]
        for bad in BAD_IDS:
            for name, operation in operations:
                _raises(InvalidIdError, partial(operation, bad), f"{name}({bad!r})")
        bad_prefixes: tuple[Any, ...] = ("/a", "a//", "../", "a b", "é", 3)
        for bad_prefix in bad_prefixes:
            _raises(InvalidIdError, partial(store.streams, bad_prefix), f"streams({bad_prefix!r})")
        assert store.streams() == ["ok"], f"refused ids left streams behind: {store.streams()}"
        _same(store.read("ok"), records(1), 1)


@_check
def check_whole_charset_round_trips_in_order(harness: StoreHarness) -> None:
    names = sorted(
        {f"c{ch}" for ch in ID_ALPHABET if ch != "/"} | {"c/" + ID_ALPHABET.replace("/", "")}
    )
    names.append("x" * MAX_ID_LENGTH)
    names.sort()
    with _store(harness) as store:
        for name in names:
            store.append(name, 0, [NewRecord("k", name.encode(), 1.0)])
        assert store.streams() == names, "listing must follow the ids' lexicographic order"
        assert store.streams("c") == [n for n in names if n.startswith("c")]
        for name in names:
            assert [r.payload for r in store.read(name)] == [name.encode()], (
                f"{name!r} read back wrong"
            )


@_check
def check_bad_arguments_are_refused(harness: StoreHarness) -> None:
    with _store(harness) as store:
        cases: list[tuple[str, Callable[[], object]]] = [
            ("append with no records", lambda: store.append("s", 0, [])),
            ("append at -1", lambda: store.append("s", -1, records(1))),
            ("append of a non-record", lambda: store.append("s", 0, ["x"])),  # type: ignore[list-item]
            ("read after -1", lambda: store.read("s", -1)),
            ("read with limit 0", lambda: store.read("s", 0, 0)),
            ("streams with limit 0", lambda: store.streams("", None, 0)),
            ("trim at -1", lambda: store.trim("s", -1)),
        ]
        for what, call in cases:
            _raises(InvalidArgumentError, call, what)
        assert store.streams() == [], "refused calls must write nothing"


@_check
def check_trim_at_the_head_keeps_the_head_record(harness: StoreHarness) -> None:
    with _store(harness) as store:
        sent = records(5)
        store.append("s", 0, sent)
        store.trim("s", 5)
        _same(store.read("s", 4), sent[4:], 5)
        _raises(TrimmedError, lambda: store.read("s", 3), "read below a floor of 4")
        assert store.head("s") == 5, "trimming at the head must not move it"
        assert store.append("s", 5, records(1, "after")) == 6


@_check
def check_limits_are_kept_exactly(harness: StoreHarness) -> None:
    printable = "".join(chr(code) for code in range(32, 127))
    kinds = [
        "k" * MAX_KIND_LENGTH,
        (printable * 2)[:MAX_KIND_LENGTH],
        (printable * 2)[MAX_KIND_LENGTH : 2 * MAX_KIND_LENGTH],
        "~" * MAX_KIND_LENGTH,
    ]
    timestamps = [
        5e-324,  # the smallest positive float
        1.7976931348623157e308,  # the largest
        -1.7976931348623157e308,
        0.1 + 0.2,  # not 0.3: every bit counts
        1_700_000_000.1234567,
        2.0**53 + 2,
        1e-300,
        -0.000123456789,
    ]
    sent = [
        NewRecord(kinds[index % len(kinds)], f"{index}".encode(), timestamp)
        for index, timestamp in enumerate(timestamps)
    ]
    with _store(harness) as store:
        store.append("limits", 0, sent)
        got = store.read("limits")
        _same(got, sent, 1)
        for record, want in zip(got, sent, strict=True):
            kept = float(record.timestamp).hex() == float(want.timestamp).hex()
            assert kept, f"timestamp {want.timestamp!r} came back as {record.timestamp!r}"
        _raises(
            InvalidArgumentError,
            lambda: store.append("limits", 8, [NewRecord("k" * (MAX_KIND_LENGTH + 1), b"", 1.0)]),
            f"a kind of {MAX_KIND_LENGTH + 1} characters",
        )


@_check
def check_deleted_streams_stay_off_every_page(harness: StoreHarness) -> None:
    names = ["p/a", "p/b", "p/c", "p/d", "p/e", "p/f"]
    with _store(harness) as store:
        for name in names:
            store.append(name, 0, records(1))
        for gone in ("p/b", "p/d", "p/f"):
            store.delete(gone)
        live = ["p/a", "p/c", "p/e"]
        assert store.streams("p/") == live
        for size in (1, 2, 3):
            paged = list_in_pages(store, "p/", size)
            assert paged == live, f"listing in pages of {size} gave {paged}, not {live}"
        assert store.streams("p/", "p/a") == ["p/c", "p/e"], "a later page listed a deleted name"
        assert store.streams("p/", "p/c", 1) == ["p/e"], "a later page listed a deleted name"


@_check
def check_a_second_instance_sees_and_refuses_the_same(harness: StoreHarness) -> None:
    with _twins(harness) as (store, twin):
        store.append("s", 0, records(2, "a"))
        assert twin.head("s") == 2, "a second instance must see the first one's append"
        _raises(
            ConflictError,
            lambda: twin.append("s", 0, records(1, "stale")),
            "append at 0 on a second instance after the first wrote 2",
        )
        assert twin.append("s", 2, records(1, "b")) == 3
        _raises(
            ConflictError,
            lambda: store.append("s", 2, records(1, "stale")),
            "append at 2 on the first instance after the second moved the head to 3",
        )
        assert store.head("s") == 3
        _same(store.read("s"), records(2, "a") + records(1, "b"), 1)
        twin.trim("s", 3)
        _raises(TrimmedError, lambda: store.read("s"), "read below a floor the twin set")
        store.delete("s")
        _raises(
            StreamDeletedError,
            lambda: twin.append("s", 3, records(1)),
            "append on a second instance to a stream the first deleted",
        )


@_check
def check_reopen_keeps_everything(harness: StoreHarness) -> None:
    if harness.reopen is None:
        raise NotApplicable(
            "the harness cannot reopen the store (StoreHarness.reopen, StoreContract.reopen_store)"
        )
    store = harness.open()
    try:
        store.append("s", 0, records(3))
        store.append("t/u", 0, records(2, "t"))
        store.trim("s", 2)
        store.delete("t/u")
        store.append("v", 0, records(1))
        store = harness.reopen(store)
        assert store.head("s") == 3
        _same(store.read("s", 1), records(3)[1:], 2)
        _raises(TrimmedError, lambda: store.read("s"), "read below a trim floor after reopening")
        _raises(
            StreamDeletedError,
            lambda: store.append("t/u", 0, records(1)),
            "a deleted name after reopening",
        )
        assert store.streams() == ["s", "v"]
        assert store.append("s", 3, records(1, "again")) == 4
    finally:
        store.close()


@_check
def check_unsynced_appends_keep_the_contract(harness: StoreHarness) -> None:
    """`append(..., sync=False)` differs from an append only in when the store syncs
    it: the same heads, conflicts, refusals and reads, in order with synced appends,
    seen by a second instance and kept by a reopen (a process that ends loses
    nothing; only a power loss may, see docs/spi.md)."""
    store = harness.open()
    try:
        assert store.append("u", 0, records(2, "a"), sync=False) == 2
        assert store.append("u", 2, records(1, "b")) == 3
        assert store.append("u", 3, records(2, "c"), sync=False) == 5
        for expected in (0, 2, 6):
            exc = _raises(
                ConflictError,
                partial(store.append, "u", expected, records(1, "stale"), sync=False),
                f"unsynced append at expected={expected} when the head is 5",
            )
            assert isinstance(exc, ConflictError)
            assert exc.actual == 5, f"the conflict must report the actual head 5: {exc!r}"
        _same(store.read("u"), records(2, "a") + records(1, "b") + records(2, "c"), 1)
        store.delete("u")
        _raises(
            StreamDeletedError,
            lambda: store.append("u", 5, records(1, "gone"), sync=False),
            "unsynced append to a deleted stream",
        )
        _raises(
            InvalidIdError,
            lambda: store.append("../u", 0, records(1), sync=False),
            "unsynced append to a bad id",
        )
        assert store.append("v", 0, records(1, "v"), sync=False) == 1
        want = records(1, "v")
        if harness.twin is not None:
            twin = harness.twin(store)
            try:
                assert twin.head("v") == 1, "a second instance must see an unsynced append"
                assert twin.append("v", 1, records(1, "w"), sync=False) == 2
                want += records(1, "w")
                _raises(
                    ConflictError,
                    lambda: store.append("v", 1, records(1, "x"), sync=False),
                    "an unsynced append at a head a second instance moved",
                )
            finally:
                twin.close()
        if harness.reopen is not None:
            store = harness.reopen(store)  # the last writes were unsynced ones
            _same(store.read("v"), want, 1)
    finally:
        store.close()


@_check
def check_racing_appends_have_one_winner(harness: StoreHarness) -> None:
    threads_count, rounds, batch = 6, 12, 3
    store = harness.open()
    # Half the racers write through a second instance over the same data when the
    # store has one: a head check that lives in one instance cannot stop them.
    twin = harness.twin(store) if harness.twin is not None else store
    try:
        wins: list[list[int]] = [[] for _ in range(rounds)]
        unexpected: list[BaseException] = []
        barrier = threading.Barrier(threads_count)

        def racer(number: int) -> None:
            mine = twin if number % 2 else store
            for round_ in range(rounds):
                barrier.wait()
                try:
                    mine.append("race", round_ * batch, records(batch, f"t{number}"))
                except ConflictError:
                    pass
                except BaseException as exc:  # reported below, never swallowed
                    unexpected.append(exc)
                else:
                    wins[round_].append(number)
                barrier.wait()

        workers = [threading.Thread(target=racer, args=(n,)) for n in range(threads_count)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert not unexpected, f"racing appends raised {unexpected[0]!r}"
        for round_, winners in enumerate(wins):
            assert len(winners) == 1, f"round {round_}: {len(winners)} appends won at the same head"
        got = store.read("race")
        assert len(got) == rounds * batch, f"{len(got)} records for {rounds} winning batches"
        for round_, winners in enumerate(wins):
            window = got[round_ * batch : (round_ + 1) * batch]
            _same(window, records(batch, f"t{winners[0]}"), round_ * batch + 1)
    finally:
        if twin is not store:
            twin.close()
        store.close()


@_check
def check_ambiguous_failures_resolve_exactly_once(harness: StoreHarness) -> None:
    with _store(harness) as store:
        if not isinstance(store, SupportsFaultInjection):
            raise NotApplicable("the store has no fault-injection seam (inject_fault)")
        store.append("s", 0, records(2))
        store.inject_fault(Fault.LOST_REPLY)
        try:
            head = store.append("s", 2, records(2, "lost"))
        except StoreUnavailableError:
            head = store.head("s")  # allowed: it could not confirm; the caller re-reads
        assert head == 4, f"a landed write whose reply was lost must count once (head {head})"
        _same(store.read("s"), records(2) + records(2, "lost"), 1)

        store.inject_fault(Fault.LOST_REPLY)
        _raises(
            ConflictError,
            lambda: store.append("s", 2, records(1, "stale")),
            "stale append, reply lost",
        )
        assert store.head("s") == 4

        store.inject_fault(Fault.UNAVAILABLE)
        _raises(
            StoreUnavailableError,
            lambda: store.append("s", 4, records(1, "u")),
            "unavailable backend",
        )
        assert store.head("s") == 4, "a refused request must write nothing"
        assert store.append("s", 4, records(1, "u")) == 5, "the retry after a transient fault lands"

        store.inject_fault(Fault.LOST_REPLY)
        assert store.append("fresh", 0, records(3, "f")) == 3, (
            "lost reply of a stream's first batch"
        )
        _same(store.read("fresh"), records(3, "f"), 1)


@_check
def check_ambiguous_failures_after_a_trim_resolve_exactly_once(harness: StoreHarness) -> None:
    """A lost reply is resolved against what the stream holds past its floor: the
    records a trim dropped must not shift which write the store finds landed."""
    with _store(harness) as store:
        if not isinstance(store, SupportsFaultInjection):
            raise NotApplicable("the store has no fault-injection seam (inject_fault)")
        store.append("s", 0, records(2, "a"))
        store.append("s", 2, records(2, "b"))
        store.trim("s", 4)  # positions 1 to 3 dropped
        store.inject_fault(Fault.LOST_REPLY)
        try:
            head = store.append("s", 4, records(1, "lost"))
        except StoreUnavailableError:
            head = store.head("s")  # allowed: it could not confirm; the caller re-reads
        assert head == 5, f"a landed write whose reply was lost, after a trim, counts once ({head})"
        _same(store.read("s", 4), records(1, "lost"), 5)
        store.inject_fault(Fault.LOST_REPLY)
        _raises(
            ConflictError,
            lambda: store.append("s", 4, records(1, "stale")),
            "stale append after a trim, reply lost",
        )
        assert store.head("s") == 5
