"""Retention on every store: what a sweep deletes, what it never deletes, a crash at
every store call of a deletion, and an id started again after its run was deleted
(the DBOS #769 scenario: a reused workflow id replayed a stale step result)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dying_store import Crash, DyingStore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel import (
    Context,
    Engine,
    ExecutionNotFoundError,
    InvalidArgumentError,
    MemoryStore,
    Retention,
    Status,
    Worker,
    flow,
    open_store,
)
from loom_kernel._engine import parts_of
from loom_kernel.spi import JournalStore
from loom_kernel.testing import FakeClock
from store_kinds import StoreFactory

effects: list[tuple[str, Any]] = []


@flow(name="ret.once")
def once(ctx: Context, value: Any) -> Any:
    """One step with an effect, a published value, and the step's result returned."""

    def effect() -> Any:
        effects.append(("effect", value))
        return value

    got = ctx.step("effect", effect)
    ctx.set_event("got", got)
    return got


@flow(name="ret.parks")
def parks(ctx: Context, value: Any) -> Any:
    """Parks until a message comes."""
    return [value, ctx.receive("go")]


@flow(name="ret.parent")
def parent(ctx: Context, value: Any) -> Any:
    """Starts a child that ends at once, then parks."""
    ctx.step(
        "child",
        lambda: (
            ctx.engine.start("ret.once", value, key=f"child-of-{value}", parent=ctx.execution_id).id
        ),
    )
    return ctx.receive("go")


FLOWS = [once, parks, parent]


def _engine(store: JournalStore, clock: FakeClock, **options: Any) -> Engine:
    return Engine(store, FLOWS, clock=clock, listeners=[], **options)


def test_an_id_started_after_its_run_was_deleted_is_a_new_run(new_store: StoreFactory) -> None:
    """DBOS #769: the new run of the id runs its step again and sees nothing of the
    deleted run: not its step results, its messages or its published values."""
    effects.clear()
    store, clock = new_store(), FakeClock(1_000.0)
    engine = _engine(store, clock)
    assert engine.start("ret.once", "old", key="order-7").result == "old"
    clock.advance(3600)
    swept = engine.gc(Retention(keep_for=60))
    assert swept.deleted == ("order-7",)
    with pytest.raises(ExecutionNotFoundError, match="deleted"):
        engine.get("order-7")
    with pytest.raises(ExecutionNotFoundError):
        engine.send("order-7", "late")
    again = engine.start("ret.once", "new", key="order-7")
    assert again.id == "order-7"
    assert again.result == "new"
    assert effects == [("effect", "old"), ("effect", "new")], "the step ran again"
    assert engine.get_events("order-7") == {"got": "new"}
    assert engine.state("order-7").generation == 2
    other = _engine(store, clock)  # a fresh reader sees the same
    assert other.get("order-7").result == "new"
    assert engine.start("ret.once", "third", key="order-7").result == "new", "a K9 start"


def test_a_cached_reader_never_answers_with_the_deleted_run(new_store: StoreFactory) -> None:
    """An engine that folded the run before it was deleted (its cache holds the ended
    state) starts the id again as a new run, not as the old one's result."""
    effects.clear()
    store, clock = new_store(), FakeClock(1_000.0)
    reader = _engine(store, clock)
    assert reader.start("ret.once", "old", key="k").result == "old"
    clock.advance(100)
    _engine(store, clock).gc(Retention(keep_last=0))
    with pytest.raises(ExecutionNotFoundError):
        reader.get("k")
    assert reader.start("ret.once", "new", key="k").result == "new"


def test_a_new_generation_has_an_inbox_of_its_own(new_store: StoreFactory) -> None:
    store, clock = new_store(), FakeClock(1_000.0)
    engine = _engine(store, clock)
    engine.start("ret.parks", 1, key="p")
    engine.send("p", "first", topic="go")
    assert engine.get("p").result == [1, "first"]
    clock.advance(10)
    assert engine.gc(Retention(keep_last=0)).deleted == ("p",)
    run = engine.start("ret.parks", 2, key="p")
    assert run.status is Status.SUSPENDED, "the old message is not the new run's"
    assert engine.inbox("p") == []
    engine.send("p", "second", topic="go")
    assert engine.get("p").result == [2, "second"]


def test_sweeps_keep_what_is_not_ended_or_still_awaited(new_store: StoreFactory) -> None:
    store, clock = new_store(), FakeClock(1_000.0)
    engine = _engine(store, clock)
    engine.start("ret.parks", 0, key="parked")
    engine.enqueue("ret.once", 0, key="queued")  # no worker: it waits
    engine.start("ret.parent", 1, key="parent")  # its child ended, the parent parks
    engine.start("ret.once", 2, key="done")
    clock.advance(10_000)
    swept = engine.gc(Retention(keep_for=0))
    assert swept.deleted == ("done",)
    assert swept.kept == 1, "the child, past its retention but awaited, is counted kept"
    assert engine.get("parked").status is Status.SUSPENDED
    assert engine.get("queued").status is Status.RUNNING
    assert engine.get("child-of-1").status is Status.COMPLETED, "its parent may await it"
    engine.send("parent", "go", topic="go")
    assert engine.get("parent").status is Status.COMPLETED
    clock.advance(1)
    assert set(engine.gc(Retention(keep_for=0)).deleted) == {"child-of-1", "parent"}


def test_keep_for_counts_from_the_end_and_keep_last_keeps_the_newest(
    new_store: StoreFactory,
) -> None:
    store, clock = new_store(), FakeClock(1_000.0)
    engine = _engine(store, clock)
    for number in range(6):
        engine.start("ret.once", number, key=f"r{number}")
        clock.advance(100)
    # r0 ended at 1000, ..., r5 at 1500; now 1600
    dry = engine.gc(Retention(keep_for=350), dry_run=True)
    assert sorted(dry.deleted) == ["r0", "r1", "r2"]
    assert engine.get("r0").status is Status.COMPLETED, "a dry run deletes nothing"
    assert sorted(engine.gc(Retention(keep_last=2)).deleted) == ["r0", "r1", "r2", "r3"]
    assert [e.id for e in engine.executions()] == ["r4", "r5"]
    assert engine.gc(Retention(keep_last=2)).deleted == ()


def test_a_sweep_goes_in_batches() -> None:
    store, clock = MemoryStore(), FakeClock(1_000.0)
    engine = _engine(store, clock)
    for number in range(7):
        engine.start("ret.once", number, key=f"b{number}")
    clock.advance(10)
    retention = Retention(keep_for=0, batch=3)
    sizes = []
    while True:
        swept = engine.gc(retention)
        sizes.append(len(swept.deleted))
        if not swept.more:
            break
    assert sum(sizes) == 7
    assert max(sizes) == 3
    assert list(engine.executions()) == []


def test_retention_refuses_what_it_cannot_mean() -> None:
    for bad in (
        {},
        {"keep_for": -1},
        {"keep_for": float("nan")},
        {"keep_last": -1},
        {"keep_last": True},
        {"keep_for": 1, "every": 0},
        {"keep_for": 1, "batch": 0},
    ):
        with pytest.raises(InvalidArgumentError):
            Retention(**bad)
    with pytest.raises(InvalidArgumentError, match="needs a Retention"):
        Engine(MemoryStore()).gc()


def test_retention_takes_timedeltas_and_the_least_of_each_bound() -> None:
    from datetime import timedelta

    given = Retention(keep_for=timedelta(days=1), every=timedelta(minutes=5), batch=1)
    assert (given.keep_for, given.every, given.batch) == (86_400.0, 300.0, 1)
    least = Retention(keep_for=0, keep_last=0, every=0.001)
    assert (least.keep_for, least.keep_last, least.every) == (0.0, 0, 0.001)


def test_a_worker_sweeps_on_its_cadence() -> None:
    store = MemoryStore()
    engine = Engine(store, FLOWS, listeners=[], retention=Retention(keep_for=0, every=0.05))
    engine.start("ret.once", 1, key="w")
    with Worker(engine, idle_poll=0.02):
        for _ in range(200):
            try:
                engine.get("w")
            except ExecutionNotFoundError:
                break
            __import__("time").sleep(0.02)
        else:
            pytest.fail("the worker never swept")


@st.composite
def _population(draw: st.DrawFn) -> list[tuple[str, int]]:
    """Runs to make: (kind, minutes it ends after the first)."""
    kinds = st.sampled_from(["done", "done", "done", "parked", "queued", "parent"])
    return draw(st.lists(st.tuples(kinds, st.integers(0, 50)), min_size=1, max_size=10))


def test_a_sweep_deletes_exactly_the_ended_runs_past_their_retention(
    new_store: StoreFactory,
) -> None:
    @settings(
        max_examples=8 if getattr(new_store, "kind", "") == "moto" else 25,  # 5 s each on moto
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        runs=_population(),
        keep_for=st.none() | st.integers(0, 60).map(lambda m: m * 60.0),
        keep_last=st.none() | st.integers(0, 6),
    )
    def sweep(runs: list[tuple[str, int]], keep_for: float | None, keep_last: int | None) -> None:
        if keep_for is None and keep_last is None:
            keep_last = 1
        store, clock = new_store(), FakeClock(0.0)
        engine = _engine(store, clock)
        ended_at: dict[str, float] = {}
        alive: set[str] = set()
        for number, (kind, minute) in enumerate(sorted(runs, key=lambda run: run[1])):
            clock.advance(minute * 60.0 + number - clock())  # every end at its own time
            key = f"{kind}-{number}"
            if kind == "done":
                engine.start("ret.once", number, key=key)
                ended_at[key] = clock()
            elif kind == "parked":
                engine.start("ret.parks", number, key=key)
                alive.add(key)
            elif kind == "queued":
                engine.enqueue("ret.once", number, key=key)
                alive.add(key)
            else:
                engine.start("ret.parent", number, key=key)
                ended_at[f"child-of-{number}"] = clock()  # counted among the newest ended,
                alive |= {key, f"child-of-{number}"}  # but kept: its parked parent awaits it
        clock.advance(3_600.0 + 100 - clock())
        retention = Retention(keep_for=keep_for, keep_last=keep_last)
        deleted = set(engine.gc(retention).deleted)
        newest = sorted(ended_at, key=ended_at.__getitem__, reverse=True)
        kept_by_count = set(newest if keep_last is None else newest[:keep_last])
        expected = {
            key
            for key, at in ended_at.items()
            if (keep_for is not None and at < clock() - keep_for)
            or (keep_last is not None and key not in kept_by_count)
        } - alive
        assert deleted == expected
        assert not deleted & alive
        for key in alive:
            engine.get(key)  # still there, whole
        assert engine.gc(retention).deleted == (), "nothing more on a second sweep"
        for key in sorted(ended_at.keys() - deleted):
            assert engine.get(key).status is Status.COMPLETED
        for key in sorted(deleted):
            with pytest.raises(ExecutionNotFoundError):
                engine.get(key)

    sweep()


def _populated(store: JournalStore, clock: FakeClock) -> None:
    engine = _engine(store, clock)
    engine.start("ret.once", "a", key="a")
    engine.start("ret.parks", "b", key="b")
    engine.send("b", "go", topic="go")  # ended, with an inbox
    engine.start("ret.parks", "live", key="live")
    clock.advance(1000)


def _calls_of_a_whole_sweep(base: StoreFactory) -> int:
    store, clock = base(), FakeClock(1_000.0)
    _populated(store, clock)
    counting = DyingStore(store, 10**9, after=False, as_it_dies=lambda: None)
    _engine(counting, clock).gc(Retention(keep_for=0))
    return counting.calls


@pytest.mark.parametrize("after", [False, True], ids=["before-it-lands", "after-it-lands"])
def test_a_crash_at_every_store_call_of_a_sweep_loses_nothing_live(
    new_store: StoreFactory, after: bool
) -> None:
    """Kill the sweeper at each store call (before the call reaches the store, or
    after it landed), then sweep again and go on: the live run is whole and finishes,
    the ended ones are gone with every stream of theirs, and their ids start anew."""
    total = _calls_of_a_whole_sweep(new_store)
    assert total > 10
    points = list(range(1, total + 1))
    if getattr(new_store, "kind", "") == "moto":  # a second a point: every 8th, and the last
        points = [*points[::8], total]
    for at in points:
        store, clock = new_store(), FakeClock(1_000.0)
        _populated(store, clock)
        dying = DyingStore(store, at, after=after, as_it_dies=lambda: None)
        with pytest.raises(Crash):
            _engine(dying, clock).gc(Retention(keep_for=0))
        engine = _engine(store, clock)
        engine.gc(Retention(keep_for=0))
        assert engine.get("live").status is Status.SUSPENDED, at
        engine.send("live", "go", topic="go")
        assert engine.get("live").result == ["live", "go"], at
        for key in ("a", "b"):
            with pytest.raises(ExecutionNotFoundError):
                engine.get(key)
        names = set(store.streams())
        assert not {"inbox/a", "inbox/b", "events/a", "events/b"} & names, (at, names)
        assert [h.event.KIND for h in engine.history("b")] == ["EXECUTION_DELETED"], at
        assert engine.start("ret.once", "again", key="a").result == "again", at


def test_a_sweep_finishes_a_deletion_an_interrupt_left_and_says_so() -> None:
    """A deletion whose record landed but whose streams were not yet gone (the
    sweeper died between): the next sweep finishes it and reports it as finished,
    not deleted (it was deleted before)."""
    from loom_kernel._core import encode_event
    from loom_kernel.events import ExecutionDeleted

    store, clock = MemoryStore(), FakeClock(1_000.0)
    engine = _engine(store, clock)
    engine.start("ret.parks", "x", key="a")
    engine.send("a", "go", topic="go")
    assert engine.get("a").status is Status.COMPLETED
    head = store.head("ex/a")
    store.append("ex/a", head, [encode_event(ExecutionDeleted(2, "retention"), clock())])
    assert "inbox/a" in set(store.streams())
    clock.advance(10)
    swept = _engine(store, clock).gc(Retention(keep_for=0))
    assert (swept.deleted, swept.finished) == ((), ("a",))
    assert "inbox/a" not in set(store.streams())
    assert [h.event.KIND for h in engine.history("a")] == ["EXECUTION_DELETED"]


def test_loom_gc_on_the_command_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/loom.db"
    with open_store(url) as store:
        engine = Engine(store, FLOWS, listeners=[])
        engine.start("ret.once", 1, key="cli-done")
        engine.start("ret.parks", 1, key="cli-parked")

    def loom(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "loom_kernel", "gc", "--store", url, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    dry = loom("--keep-for", "0s", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would delete cli-done" in dry.stdout
    assert "cli-parked" not in dry.stdout
    done = loom("--keep-last", "0", "--json")
    assert done.returncode == 0, done.stderr
    assert '"cli-done"' in done.stdout
    refused = loom()
    assert refused.returncode == 1
    assert refused.stderr.startswith("loom: ")
    bad = loom("--keep-for", "soon")
    assert bad.returncode != 0
    assert "Traceback" not in bad.stderr
    with open_store(url) as store:
        engine = Engine(store, FLOWS, listeners=[])
        assert [e.id for e in engine.executions()] == ["cli-parked"]


def test_a_chain_whose_first_run_was_deleted_is_not_started_again() -> None:
    from loom_orchestration import rotate, start_chain

    @flow(name="ret.chained")
    def chained(ctx: Context, run: dict[str, Any]) -> Any:
        if run["n"] == 1:
            return rotate(ctx, "on")
        return ctx.receive("go")

    store, clock = MemoryStore(), FakeClock(1_000.0)
    engine = Engine(store, [chained], clock=clock)
    start_chain(engine, "line", chained)
    engine.recover()  # no worker: the successor is driven here
    assert engine.get("line@2").status is Status.SUSPENDED
    clock.advance(100)
    assert engine.gc(Retention(keep_for=0)).deleted == ("line@1",)
    with pytest.raises(InvalidArgumentError, match="started once"):
        start_chain(engine, "line", chained)
    assert engine.get("line@2").status is Status.SUSPENDED


def test_a_new_run_of_a_parent_id_never_adopts_the_deleted_runs_children() -> None:
    """The deleted run's fire-and-forget child still parks (a live run is kept); the
    id's next run starts a child of its own, under an id that names its generation."""
    from loom_orchestration import start_child

    @flow(name="ret.shipping")
    def shipping(ctx: Context, order: Any) -> Any:
        return [order, ctx.receive("delivered")]

    @flow(name="ret.order")
    def order(ctx: Context, order: Any) -> Any:
        return start_child(ctx, shipping, order)

    store, clock = MemoryStore(), FakeClock(1_000.0)
    engine = Engine(store, [shipping, order], clock=clock)
    first = engine.start("ret.order", 1, key="order-7").result
    clock.advance(100)
    assert engine.gc(Retention(keep_for=0)).deleted == ("order-7",)
    second = engine.start("ret.order", 2, key="order-7").result
    assert second != first
    assert second.startswith("order-7/g2/")
    assert engine.get(second).input == 2
    assert engine.get(first).input == 1


class _Hooked(MemoryStore):
    """A memory store that calls `hook` once, at a read of `ex/<on>` (after it, with
    `late`) or at a stream's deletion: another process acting at that moment."""

    def __init__(self, on: str = "k", *, late: bool = False) -> None:
        super().__init__()
        self.on, self.late = f"ex/{on}", late
        self.hook: Callable[[], Any] | None = None
        self.at_delete: Callable[[], Any] | None = None

    def _read(self, stream: str, after: int, limit: int | None) -> Any:
        hook = self.hook if stream == self.on else None
        if hook is not None and not self.late:
            self.hook = None
            hook()
        found = super()._read(stream, after, limit)
        if hook is not None and self.late:
            self.hook = None
            hook()
        return found

    def _delete(self, stream: str) -> None:
        hook, self.at_delete = self.at_delete, None
        super()._delete(stream)
        if hook is not None:
            hook()


def test_a_keep_last_sweep_that_read_the_index_before_a_restart_keeps_the_new_run() -> None:
    store, clock = _Hooked(), FakeClock(1_000.0)
    first, second = _engine(store, clock), _engine(store, clock)
    for key in ("k", "m1", "m2"):
        first.start("ret.once", key, key=key)
        clock.advance(10)
    keep = Retention(keep_last=2)

    def meanwhile() -> None:
        assert first.gc(keep).deleted == ("k",)
        clock.advance(10)
        assert first.start("ret.once", "k2", key="k").result == "k2"

    store.hook = meanwhile
    assert second.gc(keep).deleted == ()
    assert sorted(e.id for e in first.executions()) == ["k", "m1", "m2"]
    clock.advance(10)
    assert sorted(first.gc(keep).deleted) == ["m1"], "the restarted k is among the newest"


def test_a_start_landing_during_a_sweep_stays_indexed_and_is_swept_later() -> None:
    store, clock = _Hooked(), FakeClock(1_000.0)
    sweeper, other = _engine(store, clock), _engine(store, clock)
    sweeper.start("ret.once", 1, key="k")
    clock.advance(100)
    store.at_delete = lambda: other.start("ret.once", 2, key="k")
    assert sweeper.gc(Retention(keep_for=50)).deleted == ("k",)
    fresh = _engine(store, clock)
    assert fresh.get("k").generation == 2
    assert [e.id for e in fresh.executions(status="completed")] == ["k"]
    clock.advance(100)
    assert fresh.gc(Retention(keep_for=50)).deleted == ("k",), "still in the index"


def test_a_keyed_start_racing_the_deletion_of_its_run_starts_the_next_run() -> None:
    store, clock = _Hooked(late=True), FakeClock(1_000.0)
    starter, sweeper = _engine(store, clock), _engine(store, clock)
    starter.start("ret.once", 1, key="k")
    clock.advance(100)
    store.hook = lambda: sweeper.gc(Retention(keep_for=0))
    again = starter.start("ret.once", 2, key="k")
    assert (again.result, again.generation) == (2, 2)


def test_a_send_racing_the_deletion_says_the_run_was_deleted() -> None:
    store, clock = MemoryStore(), FakeClock(1_000.0)
    sender, sweeper = _engine(store, clock), _engine(store, clock)
    sender.start("ret.parks", 1, key="k")
    driver_view = parts_of(sender).driver.view  # the seam: the sender's look at the run

    def view(execution_id: str, read: Callable[[Any], Any]) -> Any:
        seen = driver_view(execution_id, read)
        if execution_id == "k" and not getattr(view, "once", False):
            view.once = True  # type: ignore[attr-defined]
            sweeper.send("k", "x", topic="go")
            clock.advance(10)
            sweeper.gc(Retention(keep_for=0))
        return seen

    parts_of(sender).driver.view = view  # type: ignore[method-assign]
    with pytest.raises(ExecutionNotFoundError):
        sender.send("k", "late", topic="go")


def test_a_start_of_a_deleted_id_that_died_after_its_hint_leaves_no_open_hint() -> None:
    class Dies(MemoryStore):
        die = False

        def _append(self, stream: str, expected: int, records: Any) -> int:
            if self.die and stream == "ex/k":
                self.die = False
                raise Crash
            return super()._append(stream, expected, records)

    store, clock = Dies(), FakeClock(1_000.0)
    engine = _engine(store, clock)
    engine.start("ret.once", 1, key="k")
    clock.advance(10)
    engine.gc(Retention(keep_for=0))
    store.die = True
    with pytest.raises(Crash):
        _engine(store, clock).start("ret.once", 2, key="k")
    clock.advance(86_400)
    other = _engine(store, clock)
    other.recover()
    assert list(parts_of(other).driver.runs.open_runs()) == []


def test_keep_last_on_an_index_recover_rebuilt_ranks_by_the_runs_ends() -> None:
    from loom_kernel.spi import NewRecord

    clock, old = FakeClock(1_000.0), MemoryStore()
    engine = _engine(old, clock)
    for number, key in enumerate(["z-oldest", "y", "x", "b", "a-newest"]):
        engine.start("ret.once", number, key=key)
        clock.advance(100)
    bare = MemoryStore()  # the journals alone, as a store from before the index holds them
    for name in old.streams("ex/"):
        records = [NewRecord(r.kind, r.payload, r.timestamp) for r in old.read(name)]
        bare.append(name, 0, records)
    clock.advance(1_000)
    rebuilt = _engine(bare, clock)
    rebuilt.recover()
    assert sorted(rebuilt.gc(Retention(keep_last=2)).deleted) == ["x", "y", "z-oldest"]
