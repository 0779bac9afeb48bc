"""Starts by key (`_engine/_starts.py`): a key starts one run, whoever starts it and
however many race for it; an engine whose start loses the race for the run's first
record drives nothing; and a second start of the key writes no second hint to the run
index."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from counter_flow import counter
from engine_helpers import EngineFactory
from loom_kernel import Context, Engine, MemoryStore, Status, flow
from loom_kernel._engine import parts_of
from loom_kernel.events import ExecutionClaimed
from loom_kernel.testing import sandbox


def test_idempotent_start_returns_the_same_execution(make_engine: EngineFactory) -> None:
    runs: list[Any] = []

    @flow
    def work(ctx: Context, value: Any) -> Any:
        runs.append(value)
        return value

    engine = make_engine([work])
    first = engine.start("work", 1, key="job-1")
    second = engine.start("work", 2, key="job-1")
    assert first.id == second.id == "job-1"
    assert second.result == 1
    assert runs == [1]


def test_idempotent_start_under_a_thread_race(make_engine: EngineFactory) -> None:
    started: list[str] = []
    lock = threading.Lock()

    @flow
    def once(ctx: Context, _input: Any) -> str:
        def mark() -> str:
            with lock:
                started.append("run")
            return "ok"

        return ctx.step("mark", mark)  # type: ignore[no-any-return]

    engines = [make_engine([once]) for _ in range(8)]
    barrier = threading.Barrier(len(engines))
    ids: list[str] = []

    def race(engine: Engine) -> None:
        barrier.wait()
        ids.append(engine.start("once", key="the-one").id)

    threads = [threading.Thread(target=race, args=(engine,)) for engine in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert ids == ["the-one"] * 8
    assert started == ["run"]


class _CostlyHeads(MemoryStore):
    """A store whose head is a round trip (as on S3): no owner check before a step."""

    head_is_cheap = False


@pytest.mark.usefixtures("flow_loop")
@pytest.mark.parametrize("store_type", [MemoryStore, _CostlyHeads])
def test_a_start_by_key_that_loses_the_race_for_its_first_record_drives_nothing(
    store_type: type[MemoryStore],
) -> None:
    """Two engines start the same key at once; the second's head check saw no run, but
    the first's start landed before its own: it returns the run the first started and
    drives nothing (its steps ran once)."""
    ran: list[str] = []

    def once(tag: str) -> str:
        ran.append(tag)
        return tag

    @flow(name="raced", version="1")
    def raced(ctx: Context, tag: str) -> Any:
        return ctx.step("once", once, tag)

    store = store_type()
    first = Engine(store, [raced], listeners=[])
    second = Engine(store, [raced], listeners=[])
    opened = parts_of(second).driver.runs.opened

    def opened_after_the_first_start(*args: Any, **options: Any) -> None:
        first.start("raced", "first", key="k")  # lands between the check and the append
        opened(*args, **options)

    parts_of(second).driver.runs.opened = opened_after_the_first_start  # type: ignore[method-assign]
    view = second.start("raced", "second", key="k")
    assert view.status is Status.COMPLETED
    assert view.result == "first"
    assert ran == ["first"]
    assert [record.kind for record in store.read("ex/k")].count("EXECUTION_STARTED") == 1


@pytest.mark.usefixtures("flow_loop")
def test_a_second_start_by_key_of_a_run_just_started_writes_no_second_hint() -> None:
    from loom_kernel._coordination import partition_of

    box = sandbox(counter)
    box.engine.enqueue("counter", 0, key="once")  # no worker: its start is its only record
    assert box.store.head("ex/once") == 1
    hints = f"runs/open/{partition_of('once')}"
    before = box.store.head(hints)
    box.engine.enqueue("counter", 0, key="once")
    box.engine.start("counter", 0, key="once")
    assert box.store.head(hints) == before


@flow(name="order_approval", version="3")
def order_approval(ctx: Context, order: dict[str, int]) -> Any:
    return ctx.step("approve", lambda: {"approved": order["n"]})


def test_a_process_with_no_flow_code_starts_runs_by_name_that_a_worker_completes() -> None:
    """A web tier starts runs by name without importing the flow (as DBOS's and
    Temporal's clients do): each run waits for a worker that has the code, and is
    pinned at its first drive to that worker's newest version."""
    from loom_kernel import InvalidArgumentError, Queue, UnknownFlowError, Worker

    store = MemoryStore()
    web = Engine(store, [], listeners=[], queues=[Queue("q")])
    handles = [web.enqueue("order_approval", {"n": n}, key=f"o{n}") for n in range(3)]
    handles.append(web.enqueue("order_approval", {"n": 9}, queue="q"))
    handles.append(web.dispatch("order_approval", {"n": 7}, key="child"))
    assert web.enqueue("order_approval", {"n": 5}, key="o0") == handles[0], "K9: one run a key"
    assert {web.get(handle.id).code_hash for handle in handles} == {""}, "pinned to no code yet"
    with pytest.raises(UnknownFlowError):
        web.start("order_approval", {"n": 1})  # inline: this process cannot drive it
    with pytest.raises(InvalidArgumentError, match="invalid flow name"):
        web.enqueue("order approval!", {"n": 1})
    worker = Engine(store, [order_approval], listeners=[], queues=[Queue("q")])
    with Worker(worker, idle_poll=0.02):
        results = [web.handle(handle.id).result(timeout=10) for handle in handles]
    assert results == [{"approved": n} for n in (0, 1, 2, 9, 7)]
    for handle in handles:
        state = worker.state(handle.id)
        assert state.code_hash == "version:3"
        assert state.variables["_migrations"] == [
            {"from": "", "to": "version:3", "reason": "pinned at its first drive"}
        ]


def test_a_start_another_worker_took_over_mid_drive_says_so_in_its_view(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """This engine's lease lapsed during its drive and another worker claimed the run:
    the drive stops at its next append, and `start` returns the run's view as it is,
    running and owned by the other worker (with when it was seen), not a silent RUNNING
    that looks like this engine's own."""
    from loom_kernel.testing import FakeClock

    store, clock = MemoryStore(), FakeClock()
    other = Engine(store, [], listeners=[], worker_id="other", clock=clock)

    @flow(name="fenced")
    def fenced(ctx: Context, _input: None) -> str:
        def taken_meanwhile() -> str:
            driver = parts_of(other).driver
            state = driver.checkout("f")
            clock.advance(3600)  # this engine's lease lapses
            driver.append(state, [ExecutionClaimed("other", state.owner)])
            return "done"

        ctx.step("taken", taken_meanwhile)
        return "finished"

    engine = Engine(store, [fenced], listeners=[], worker_id="here", clock=clock)
    with caplog.at_level("WARNING", logger="loom"):
        view = engine.start("fenced", key="f")
    assert (view.status, view.owner) == (Status.RUNNING, "other")
    assert view.owner_seen_at is not None
    assert "f: other took this run over during its drive here" in caplog.text


def test_a_start_cancelled_from_another_engine_mid_drive_is_no_take_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The drive stops at its next append, as when another worker claims the run, but
    the run ended: its view is the cancelled run, with no word of a take-over."""
    store = MemoryStore()
    other = Engine(store, [], listeners=[], worker_id="other")

    @flow(name="cancelled_meanwhile")
    def cancelled_meanwhile(ctx: Context, _input: None) -> str:
        ctx.step("cancelled", lambda: other.cancel("c", reason="from afar") and "done")
        return "finished"

    engine = Engine(store, [cancelled_meanwhile], listeners=[], worker_id="here")
    with caplog.at_level("WARNING", logger="loom"):
        view = engine.start("cancelled_meanwhile", key="c")
    assert view.status is Status.CANCELLED
    assert view.owner is None
    assert "took this run over" not in caplog.text
