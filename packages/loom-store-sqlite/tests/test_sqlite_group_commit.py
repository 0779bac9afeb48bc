"""Group commit: appends of concurrent threads share a transaction, and each keeps
its own head check, its own conflict and its own failure."""

from __future__ import annotations

import linecache
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel._spi._group_commit import PendingAppend, Wake
from loom_kernel.spi import (
    ConflictError,
    InvalidArgumentError,
    NewRecord,
    StoreUnavailableError,
)
from loom_store_sqlite import SqliteOptions, SqliteStore
from loom_store_sqlite.testing import connection_stand_in, queued_appends, raw_connection


def _record(tag: str) -> list[NewRecord]:
    return [NewRecord("k", tag.encode(), 1.0)]


class GatedStore(SqliteStore):
    """Holds the first group's commit until `gate` is set, and records each group."""

    def __init__(self, path: str) -> None:
        super().__init__(path, SqliteOptions(synchronous="normal"))
        self.gate = threading.Event()
        self.groups: list[list[tuple[str, int]]] = []
        self.interrupt_first = False

    def _commit_group(self, batch: list[PendingAppend]) -> None:
        self.groups.append([(append.stream, append.expected) for append in batch])
        if len(self.groups) == 1:
            assert self.gate.wait(10)
            if self.interrupt_first:
                raise KeyboardInterrupt
        super()._commit_group(batch)


def _append_in_thread(store: SqliteStore, stream: str, expected: int, tag: str) -> Any:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["head"] = store.append(stream, expected, _record(tag))
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def _wait_leading(store: GatedStore) -> None:
    deadline = time.monotonic() + 10
    while not store.groups:
        assert time.monotonic() < deadline, "no append ever committed"
        time.sleep(0.001)


def _wait_queued(store: SqliteStore, count: int) -> None:
    deadline = time.monotonic() + 10
    while queued_appends(store) < count:
        assert time.monotonic() < deadline, "the appends never queued"
        time.sleep(0.001)


def test_appends_queued_behind_a_commit_go_in_one_transaction_each_with_its_own_check(
    tmp_path: Path,
) -> None:
    store = GatedStore(str(tmp_path / "g.db"))
    leader = _append_in_thread(store, "a", 0, "a1")
    _wait_leading(store)
    followers = [
        _append_in_thread(store, "b", 0, "b1"),
        _append_in_thread(store, "a", 0, "a-stale"),  # the leader's append moves a to 1
        _append_in_thread(store, "c", 0, "c1"),
        _append_in_thread(store, "c", 0, "c-again"),  # conflicts with the one before it
    ]
    _wait_queued(store, 4)
    store.gate.set()
    for thread, _ in [leader, *followers]:
        thread.join(10)
    assert leader[1] == {"head": 1}
    outcomes = [outcome for _, outcome in followers]
    assert len(store.groups) == 2, store.groups
    assert len(store.groups[1]) == 4, store.groups
    by_tag = dict(zip(["b1", "a-stale", "c1", "c-again"], outcomes, strict=True))
    assert by_tag["b1"] == {"head": 1}
    assert isinstance(by_tag["a-stale"]["error"], ConflictError)
    assert by_tag["a-stale"]["error"].actual == 1
    first_c, second_c = (by_tag["c1"], by_tag["c-again"])
    assert sorted([("head" in first_c), ("head" in second_c)]) == [False, True], (
        "one of the two appends at c's head 0 lands, the other conflicts"
    )
    assert [r.payload for r in store.read("a")] == [b"a1"]
    assert [r.payload for r in store.read("b")] == [b"b1"]
    assert len(store.read("c")) == 1
    assert queued_appends(store) == 0, "a group taken is off the queue: never committed twice"


def test_an_interrupted_leader_lands_nothing_and_its_followers_are_told_to_retry(
    tmp_path: Path,
) -> None:
    store = GatedStore(str(tmp_path / "i.db"))
    store.interrupt_first = True
    leader = _append_in_thread(store, "a", 0, "a1")
    _wait_leading(store)
    follower = _append_in_thread(store, "b", 0, "b1")
    _wait_queued(store, 1)
    store.gate.set()
    leader[0].join(10)
    follower[0].join(10)
    assert isinstance(leader[1]["error"], KeyboardInterrupt)
    # The follower was handed the lead and committed its own group.
    assert follower[1] == {"head": 1}
    assert store.head("a") == 0
    assert store.append("a", 0, _record("a1")) == 1, "nothing held the write lock"


def test_a_follower_whose_group_was_interrupted_is_told_its_append_did_not_land(
    tmp_path: Path,
) -> None:
    class InterruptedSecondGroup(GatedStore):
        def _commit_group(self, batch: list[PendingAppend]) -> None:
            if len(self.groups) == 1:
                self.groups.append([(a.stream, a.expected) for a in batch])
                raise KeyboardInterrupt  # the second group's leader, before it commits
            super()._commit_group(batch)

    store = InterruptedSecondGroup(str(tmp_path / "f.db"))
    leader = _append_in_thread(store, "a", 0, "a1")
    _wait_leading(store)
    second = _append_in_thread(store, "b", 0, "b1")
    _wait_queued(store, 1)
    third = _append_in_thread(store, "c", 0, "c1")
    _wait_queued(store, 2)
    store.gate.set()
    for thread, _ in (leader, second, third):
        thread.join(10)
    assert leader[1] == {"head": 1}
    assert isinstance(second[1]["error"], KeyboardInterrupt)
    error = third[1]["error"]
    assert isinstance(error, StoreUnavailableError)
    assert "did not land" in str(error)
    assert store.head("c") == 0


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rounds=st.lists(
        st.lists(st.tuples(st.sampled_from("xy"), st.integers(-1, 1)), min_size=2, max_size=5),
        min_size=1,
        max_size=4,
    )
)
def test_racing_appends_in_groups_keep_every_stream_gapless_and_every_answer_true(
    tmp_path_factory: pytest.TempPathFactory, rounds: list[list[tuple[str, int]]]
) -> None:
    """Each round, threads append at once (some at a stale or future head); the
    leader's commit is slowed so the others queue into groups. Every success is in
    the journal at the positions it was told, every conflict names a real head."""

    class SlowCommits(SqliteStore):
        def _commit_group(self, batch: list[PendingAppend]) -> None:
            time.sleep(0.002)
            super()._commit_group(batch)

    store = SlowCommits(str(tmp_path_factory.mktemp("h") / "h.db"), SqliteOptions("normal"))
    landed: dict[str, dict[int, bytes]] = {"x": {}, "y": {}}
    for number, appends in enumerate(rounds):
        results = _race(store, number, appends)
        for stream, expected, tag, outcome in results:
            if isinstance(outcome, ConflictError):
                assert outcome.actual != expected
            else:
                assert outcome == expected + 1
                assert expected + 1 not in landed[stream], "two appends told the same head"
                landed[stream][expected + 1] = tag
    for stream in "xy":
        records = store.read(stream)
        assert [r.position for r in records] == list(range(1, len(records) + 1))
        assert {r.position: r.payload for r in records} == landed[stream]
    store.close()


def _race(
    store: SqliteStore, number: int, appends: list[tuple[str, int]]
) -> list[tuple[str, int, bytes, Any]]:
    """One round: each thread reads its stream's head, shifts it by its offset, and
    all append at once; (stream, expected, payload, new head or ConflictError)."""
    barrier = threading.Barrier(len(appends))
    results: list[tuple[str, int, bytes, Any]] = []
    lock = threading.Lock()

    def run(stream: str, offset: int, tag: bytes) -> None:
        expected = max(0, store.head(stream) + offset)
        barrier.wait()
        try:
            outcome: Any = store.append(stream, expected, [NewRecord("k", tag, 1.0)])
        except ConflictError as exc:
            outcome = exc
        with lock:
            results.append((stream, expected, tag, outcome))

    threads = [
        threading.Thread(target=run, args=(stream, offset, f"{number}.{i}".encode()))
        for i, (stream, offset) in enumerate(appends)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def _group_of(store: GatedStore, appends: list[tuple[str, bytes]]) -> list[Any]:
    """Commit `appends` (each at head 0) as the second group, behind a held first."""
    leader = _append_in_thread(store, "lead", 0, "lead")
    _wait_leading(store)
    queued = []
    for stream, payload in appends:
        outcome: dict[str, Any] = {}

        def run(stream: str = stream, payload: bytes = payload, outcome: Any = outcome) -> None:
            try:
                outcome["head"] = store.append(stream, 0, [NewRecord("k", payload, 1.0)])
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        queued.append((thread, outcome))
        _wait_queued(store, len(queued))
    store.gate.set()
    for thread, _ in [leader, *queued]:
        thread.join(10)
    return [outcome for _, outcome in queued]


class SmallRecords(GatedStore):
    """Refuses records over 100 KB inside a group, as a full disk would refuse a write
    (the SPI's own check of `max_record_bytes` turned off, so the group meets it)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.max_record_bytes = None

    def _connect(self) -> sqlite3.Connection:
        connection = super()._connect()
        connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 100_000)
        return connection


def test_an_append_sqlite_refuses_fails_alone_and_the_rest_of_its_group_lands(
    tmp_path: Path,
) -> None:
    store = SmallRecords(str(tmp_path / "s.db"))
    first, second, big = _group_of(store, [("k", b"a"), ("k", b"b"), ("big", b"z" * 200_000)])
    assert first == {"head": 1}
    assert isinstance(second["error"], ConflictError), "the first landed: a true conflict"
    assert isinstance(big["error"], InvalidArgumentError), "bad input, not a fault to retry"
    assert "too big" in str(big["error"])
    assert [r.payload for r in store.read("k")] == [b"a"]


def test_the_appends_of_a_group_that_landed_are_told_so_without_reading_back(
    tmp_path: Path,
) -> None:
    """Only an append whose outcome the store does not know is confirmed by reading
    its commit id back: a group that committed tells each of its appends at once."""

    class CountsConfirmations(GatedStore):
        confirmed = 0

        def _confirm(self, *args: Any) -> int:
            type(self).confirmed += 1
            return super()._confirm(*args)

    store = CountsConfirmations(str(tmp_path / "c.db"))
    outcomes = _group_of(store, [("a", b"1"), ("b", b"2"), ("c", b"3")])
    assert outcomes == [{"head": 1}] * 3
    assert len(store.groups) == 2
    assert CountsConfirmations.confirmed == 0


def test_in_a_group_of_two_the_append_sqlite_refuses_fails_and_the_other_lands(
    tmp_path: Path,
) -> None:
    """The smallest group that is tried again with savepoints: neither append is told
    the other's outcome."""
    store = SmallRecords(str(tmp_path / "two.db"))
    fine, big = _group_of(store, [("k", b"a"), ("big", b"z" * 200_000)])
    assert fine == {"head": 1}
    assert isinstance(big["error"], InvalidArgumentError)
    assert "too big" in str(big["error"])
    assert [r.payload for r in store.read("k")] == [b"a"]
    assert store.read("big") == []


def test_a_group_whose_commit_fails_takes_back_the_conflicts_it_judged_on_its_own_appends(
    tmp_path: Path,
) -> None:
    class CommitFails(GatedStore):
        def _commit_group(self, batch: list[PendingAppend]) -> None:
            if len(self.groups) == 1:  # the second group: COMMIT refused, nothing lands
                self.groups.append([(a.stream, a.expected) for a in batch])
                real = raw_connection(self)  # this thread's, opened if need be
                with connection_stand_in(self, _RefusingCommit(real)):
                    super()._commit_group(batch)
                return
            super()._commit_group(batch)

    store = CommitFails(str(tmp_path / "c.db"))
    first, second = _group_of(store, [("k", b"a"), ("k", b"b")])
    for outcome in (first, second):  # neither landed: both are told to retry
        assert isinstance(outcome["error"], StoreUnavailableError), outcome
        assert "did not land" in str(outcome["error"])
    assert store.head("k") == 0


class _RefusingCommit:
    """A connection whose COMMIT fails before it commits (SQLITE_BUSY, say)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def execute(self, sql: str, *parameters: Any) -> Any:
        if sql == "COMMIT":
            import sqlite3

            raise sqlite3.OperationalError("database is locked")
        return self._real.execute(sql, *parameters)


def test_an_append_interrupted_while_queued_leaves_the_store_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = GatedStore(str(tmp_path / "q.db"))
    leader = _append_in_thread(store, "a", 0, "a1")
    _wait_leading(store)

    class Interrupted(Wake):
        def wait(self, timeout: float) -> bool:
            raise KeyboardInterrupt  # Ctrl-C while it waits behind the leader

    monkeypatch.setattr("loom_kernel._spi._group_commit.Wake", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.append("b", 0, _record("b1"))
    monkeypatch.undo()
    assert queued_appends(store) == 0, "taken out of the queue: it never happens"
    store.gate.set()
    leader[0].join(10)
    assert leader[1] == {"head": 1}
    assert store.append("c", 0, _record("c1")) == 1, "the lead was not left stranded"


def test_an_interrupt_between_a_groups_two_tries_leaves_no_conflict_judged_on_the_first(
    tmp_path: Path,
) -> None:
    store = SmallRecords(str(tmp_path / "s.db"))
    store.gate.set()
    first_try = store._transact

    def interrupted(connection: Any, batch: Any, *, isolated: bool) -> Any:
        landed = first_try(connection, batch, isolated=isolated)
        if landed is None:
            raise KeyboardInterrupt  # Ctrl-C as the first try returns
        return landed

    store._transact = interrupted  # type: ignore[method-assign]
    rows = [("k", 1, 1, b"a", 1.0, 7)]
    first = PendingAppend("k", 0, rows)
    second = PendingAppend("k", 0, [("k", 1, 1, b"b", 1.0, 7)])  # conflicts with first
    big = PendingAppend("big", 0, [("big", 1, 1, b"z" * 200_000, 1.0, 7)])
    with pytest.raises(KeyboardInterrupt):
        store._commit_group([first, second, big])
    assert store.head("k") == 0
    assert not isinstance(second.error, ConflictError), "nothing landed to conflict with"
    store.close()


class _SavepointsFail:
    """A connection on which the insert of stream `b`'s second record fails, and so does
    the rollback to its savepoint (the transaction staying open)."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._connection = connection

    def execute(self, sql: str, parameters: Any = ()) -> Any:
        if sql == "ROLLBACK TO loom_append":
            raise sqlite3.OperationalError("cannot rollback savepoint - statements in progress")
        return self._connection.execute(sql, parameters)

    def executemany(self, sql: str, rows: Any) -> Any:
        rows = list(rows)
        if any(row[0] == "b" for row in rows):
            raise sqlite3.OperationalError("database or disk is full")
        return self._connection.executemany(sql, rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)


def test_a_failed_rollback_to_an_appends_savepoint_fails_the_group_and_tears_no_append(
    tmp_path: Path,
) -> None:
    store = SqliteStore(str(tmp_path / "torn.db"))
    store.append("a", 0, _record("a0"))
    store.append("b", 0, _record("b0"))
    lone = PendingAppend("a", 1, [("a", 2, 1, b"a1", 1.0, 7)])
    pair = PendingAppend("b", 1, [("b", 2, 1, b"b1", 1.0, 7), ("b", 3, 1, b"b2", 1.0, None)])
    with connection_stand_in(store, _SavepointsFail(raw_connection(store))):
        store._commit_group([lone, pair])
        assert isinstance(pair.error, StoreUnavailableError)
        assert [record.payload for record in store.read("b")] == [b"b0"], "no half of it landed"
        assert [record.payload for record in store.read("a")] == [b"a0"]
        assert lone.error is not None, "rolled back with the group: its caller confirms, not told"


class _InterruptAt:
    """A trace hook for this thread: raises KeyboardInterrupt at the `nth` line run in
    the group commit's module (as a signal handler raising there would).

    Not where a `with` block's lock is being let go (its line seen again as the block
    ends): a trace hook can raise there, before `__exit__`, but a signal cannot (the
    interpreter looks for one after the call that releases the lock, not before)."""

    def __init__(self, nth: int) -> None:
        from loom_kernel._spi import _group_commit as _group

        self._file = _group.__file__
        self._left = nth
        self.fired = False

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != self._file:
            return None
        seen: set[int] = set()

        def line(frame: Any, event: str, arg: Any) -> Any:
            if event != "line" or self.fired:
                return line
            again = frame.f_lineno in seen
            seen.add(frame.f_lineno)
            if again and linecache.getline(self._file, frame.f_lineno).strip().startswith("with "):
                return line
            if self._left == 0:
                self.fired = True
                raise KeyboardInterrupt("a signal lands here")
            self._left -= 1
            return line

        return line


def _submit_interrupted(group: Any, append: PendingAppend, nth: int) -> bool:
    """`group.submit(append)` on this thread, interrupted at its `nth` line; whether
    the interrupt fired."""
    import sys

    hook = _InterruptAt(nth)
    before = sys.gettrace()
    sys.settrace(hook)
    try:
        group.submit(append)
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(before)
    return hook.fired


def _in_a_thread(call: Any) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def _round_interrupted_at(role: str, nth: int) -> bool:
    """One round of the test below, the append on this thread interrupted at its
    `nth` line; whether the interrupt fired (it did not: the append ran fewer lines)."""
    from loom_kernel._spi import _group_commit as _group

    committed: list[PendingAppend] = []
    gate = threading.Event()

    def commit(batch: list[PendingAppend]) -> None:
        if batch[0].stream == "first":
            gate.wait(10)
        committed.extend(batch)

    group = _group.GroupCommit(commit)
    told: list[PendingAppend] = []

    def submit(append: PendingAppend) -> None:
        try:
            group.submit(append)
        except StoreUnavailableError:
            return  # told to confirm by its commit id: landed or not
        told.append(append)  # returned with no error: it says it landed

    def queue_behind() -> None:
        while group.queued < 1 and not gate.is_set():  # behind mine, if it queues
            time.sleep(0.001)
        submit(PendingAppend("behind", 1, []))

    def open_gate() -> None:
        while group.queued < 2 and not gate.is_set():
            time.sleep(0.001)
        gate.set()

    threads = []
    if role != "alone":
        threads.append(_in_a_thread(lambda: submit(PendingAppend("first", 1, []))))
        threads += [_in_a_thread(queue_behind), _in_a_thread(open_gate)]
        while not group.leading:
            time.sleep(0.001)  # the first leads, held at the gate
    fired = _submit_interrupted(group, PendingAppend("mine", 1, []), nth)
    gate.set()
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive(), f"an append waits for good (line {nth})"
    later = PendingAppend("later", 1, [])
    thread = _in_a_thread(lambda: submit(later))
    thread.join(5)
    assert later in told, f"a later append commits (line {nth})"
    assert (group.leading, group.queued) == (False, 0), f"line {nth}"
    assert all(append in committed for append in told), f"line {nth}"
    return fired


@pytest.mark.parametrize("role", ["alone", "handed the lead of a group"])
def test_an_interrupt_at_any_line_of_group_commit_leaves_no_append_waiting_for_good(
    monkeypatch: pytest.MonkeyPatch, role: str
) -> None:
    """Interrupted at each line it runs in turn, an append that leads (alone, or handed
    the lead with another append queued behind it) leaves the store working: every
    other append ends, a later one commits, the leading ends, and no append is told it
    landed unless a group committed it."""
    from loom_kernel._spi import _group_commit as _group

    monkeypatch.setattr(_group, "LOOK_AGAIN", 0.01)
    nth = 0
    while _round_interrupted_at(role, nth):
        nth += 1
        assert nth < 300, "an append keeps running lines of the group commit: it never ends"
    assert nth > 10, "the sweep ran past the group commit's lines"
