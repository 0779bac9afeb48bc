"""Behaviours that no test pinned until mutation sampling showed a change to each went
unnoticed (docs/contributing.md: the mutation sampler)."""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
from loom_kernel import Context, Engine, InvalidIdError, MemoryStore, Status, flow
from loom_kernel._core import validate_prefix, validate_stream_id
from loom_kernel._engine import parts_of
from loom_kernel.spi import InvalidArgumentError, NewRecord
from loom_kernel.testing import FakeClock, sandbox

#: Each test runs with a loop per drive and on one loop of another thread.
pytestmark = pytest.mark.usefixtures("flow_loop")


@pytest.mark.parametrize("bad", [123, None, b"id", 1.5])
def test_an_execution_id_that_is_not_a_str_is_an_invalid_id(bad: Any) -> None:
    with pytest.raises(InvalidIdError, match="an execution id is a str"):
        Engine.stream_of(bad)


@pytest.mark.parametrize("bad", ["a//b", "../x", 7])
def test_a_handle_to_an_invalid_id_is_refused_at_once(bad: Any) -> None:
    engine = Engine(MemoryStore(), [], listeners=[])
    with pytest.raises(InvalidIdError):
        engine.handle(bad)


def test_the_id_limit_is_two_hundred_characters() -> None:
    assert validate_stream_id("x" * 200) == "x" * 200
    with pytest.raises(InvalidIdError, match="longer than 200"):
        validate_stream_id("x" * 201)
    assert validate_prefix("x" * 200) == "x" * 200
    with pytest.raises(InvalidIdError):
        validate_prefix("x" * 201)


@pytest.mark.parametrize("after", ["a//b", "/a", "a b", "../x", 7])
def test_a_listing_cursor_is_checked_like_a_prefix(after: Any) -> None:
    store = MemoryStore()
    with pytest.raises(InvalidArgumentError):
        store.streams("", after)


@flow(name="counter", version="1")
def counter(ctx: Context, _input: Any) -> Any:
    total = 0
    for number in range(5):
        total += ctx.step(f"n{number}", lambda number=number: number)
        ctx.suspend(f"g{number}")
    return total


def test_an_engine_whose_cached_copy_was_compacted_past_shows_the_current_state() -> None:
    box = sandbox(counter, listeners=[])
    run = box.engine.start("counter", key="c")
    box.engine.resume(run.id, 0)
    stale = box.new_engine()
    assert stale.get(run.id).waiting_on == "g1"  # cached at this position
    other = box.new_engine()
    for payload in (1, 2, 3):
        other.resume(run.id, payload)
    other.compact(run.id)  # the stale engine's next read after its position is trimmed
    assert stale.get(run.id) == other.get(run.id)
    assert stale.get(run.id).waiting_on == "g4"


class VanishingBucketStore(MemoryStore):
    """Deletes a timer bucket between the listing that names it and the read of it."""

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        names = super()._streams(prefix, after, limit)
        if prefix == "timers/" and names:
            super()._delete(names[0])
        return names


@flow(name="nap", version="1")
def nap(ctx: Context, seconds: float) -> str:
    ctx.sleep(seconds)
    return "woke"


def test_a_bucket_deleted_between_listing_and_reading_is_skipped() -> None:
    store, clock = VanishingBucketStore(), FakeClock(6000.0)
    engine = Engine(store, [nap], clock=clock, listeners=[])
    engine.start("nap", 10, key="first")  # minute 100: deleted under the poll
    engine.start("nap", 70, key="second")  # minute 101: fires
    clock.advance(100)
    assert engine.fire_due_timers() == ["second"]
    assert engine.get("first").status is Status.SUSPENDED, "its hint is gone, not doubled"


def test_the_state_cache_drops_the_least_recently_used_first() -> None:
    from loom_kernel._core import ExecutionState
    from loom_kernel._engine._cache import StateCache

    cache = StateCache(2)
    for name in ("a", "b"):
        cache.give_back(ExecutionState(id=name))
    used = cache.take("a")
    assert used is not None
    cache.give_back(used)  # "a" is now the most recently used
    cache.give_back(ExecutionState(id="c"))
    assert cache.take("b") is None, "the least recently used went"
    assert cache.take("a") is used
    assert cache.take("c") is not None


def test_the_history_of_a_deleted_execution_is_not_found() -> None:
    from loom_kernel import ExecutionNotFoundError

    box = sandbox(counter)
    box.engine.start("counter", key="gone")
    box.store.delete("ex/gone")
    with pytest.raises(ExecutionNotFoundError, match="was deleted"):
        box.engine.history("gone")


def test_decoding_no_records_gives_no_events() -> None:
    from loom_kernel._core import decode_events, parse_envelopes

    assert parse_envelopes([]) == []
    assert decode_events([]) == []


def _legacy_store(frame_fields: tuple[str, ...] = ()) -> MemoryStore:
    """The 1.15 fixture run, compacted, its snapshot's step frames without `frame_fields`."""
    import json
    from pathlib import Path

    from loom_kernel.spi import NewRecord

    fixture = json.loads((Path(__file__).parent / "fixtures" / "journal_1_15.json").read_text())
    store = MemoryStore()
    stream = "ex/" + fixture["execution_id"]
    store.append(
        stream,
        0,
        [
            NewRecord(r["kind"], json.dumps(r["payload"]).encode(), r["timestamp"])
            for r in fixture["records"]
        ],
    )
    for _index, frame in fixture["snapshot"]["state"]["steps"]:
        for field in frame_fields:
            del frame[field]
    snapshot = json.dumps(fixture["snapshot"]).encode()
    store.append("snap/" + fixture["execution_id"], 0, [NewRecord("loom.snapshot", snapshot, 0.0)])
    store.trim(stream, 5)
    return store


def test_a_snapshot_frame_without_attempts_counts_one() -> None:
    engine = Engine(_legacy_store(("attempts",)), [], clock=FakeClock(), listeners=[])
    assert engine.frames("legacy-1")[0].attempts == 1


def test_a_journaled_step_without_attempts_counts_one() -> None:
    """A completed step of the current schema whose data lacks `attempts` (a writer
    that leaves the default out) is not the fast fold's exact shape: it is decoded,
    and counts one attempt."""

    @flow(name="one_step")
    def one_step(ctx: Context, _input: Any) -> Any:
        return ctx.step("a", lambda: 5)

    written = MemoryStore()
    Engine(written, [one_step], listeners=[]).start("one_step", key="x")
    started, step, _completed = written.read("ex/x")
    envelope = json.loads(step.payload)
    del envelope["d"]["attempts"]
    store = MemoryStore()
    store.append(
        "ex/x",
        0,
        [
            NewRecord(started.kind, started.payload, started.timestamp),
            NewRecord(step.kind, json.dumps(envelope).encode(), step.timestamp),
        ],
    )
    frames = Engine(store, [one_step], listeners=[]).frames("x")
    assert (frames[0].result, frames[0].attempts) == (5, 1)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_load_leaves_the_collector_as_it_found_it(enabled: bool) -> None:
    @flow(name="loaded")
    def loaded(ctx: Context, _input: Any) -> Any:
        return ctx.step("a", lambda: 1)

    store = MemoryStore()
    Engine(store, [loaded], listeners=[]).start("loaded", key="l")
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        assert Engine(store, [loaded], listeners=[]).get("l").result == 1  # a cold load
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def test_a_snapshot_from_before_migrations_existed_migrates() -> None:
    store = _legacy_store()

    @flow(name="single_gate", version="2")
    def single_gate_v2(ctx: Context, order: Any) -> Any:
        quote = ctx.step("quote", lambda: {"total": 42})
        return {"order": order, "quote": quote, "approval": ctx.suspend("approval")}

    @flow(name="single_gate", version="1")
    def single_gate_v1(ctx: Context, order: Any) -> Any:
        quote = ctx.step("quote", lambda: {"total": 42})
        return {"order": order, "quote": quote, "approval": ctx.suspend("approval")}

    engine = Engine(store, [single_gate_v1, single_gate_v2], clock=FakeClock(), listeners=[])
    assert engine.state("legacy-1").variables["_migrations"] == []
    moved = engine.resume_as("legacy-1", "2", reason="test")
    assert moved.code_hash == "version:2"
    assert len(engine.state("legacy-1").variables["_migrations"]) == 1


def test_the_parsed_version_cache_stays_bounded() -> None:
    from loom_kernel._core._codec import _versions, decode_event
    from loom_kernel.spi import Record

    for minor in range(200):
        payload = b'{"v":"1.%d.0","d":{"reason":null}}' % minor
        record = Record(1, "EXECUTION_CANCELLED", payload, 0.0)
        decode_event(record, "ex/v")
    assert len(_versions) <= 64


def test_a_park_is_not_an_exception_a_flow_can_catch() -> None:
    seen: list[str] = []

    @flow(name="guarded", version="1")
    def guarded(ctx: Context, _input: Any) -> Any:
        try:
            return ctx.suspend("go")
        except Exception:
            seen.append("caught")  # must never run: parking is not a failure
            raise

    box = sandbox(guarded)
    assert box.engine.start("guarded", key="g").status is Status.SUSPENDED
    assert seen == []


def test_an_async_flow_that_survives_a_cancel_of_its_own_task_goes_on() -> None:
    import asyncio

    from loom_kernel import AsyncContext

    @flow(name="self_cancel", version="1")
    async def self_cancel(ctx: AsyncContext, _input: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            task.uncancel()
        await asyncio.sleep(0)  # the cancel was delivered once, not again
        return await ctx.step("after", lambda: "went on")

    box = sandbox(self_cancel)
    assert box.engine.start("self_cancel", key="c").result == "went on"


def test_a_flow_that_looks_at_a_concurrent_step_after_its_own_decides_alike_on_replay() -> None:
    import asyncio

    from loom_kernel import AsyncContext

    async def work(name: str, delay: float) -> str:
        await asyncio.sleep(delay)
        return name

    @flow(name="peek", version="1")
    async def peek(ctx: AsyncContext, _input: Any) -> Any:
        quick = asyncio.ensure_future(ctx.step("quick", work, "quick", 0.0))
        await ctx.step("slower", work, "slower", 0.01)
        branch = "done" if quick.done() else "pending"
        await ctx.step(branch, lambda: branch)
        await quick
        await ctx.suspend("end")
        return branch

    box = sandbox(peek)
    box.engine.start("peek", key="p")
    assert box.new_engine().resume("p", "ok").status is Status.COMPLETED


def test_a_prefix_that_is_not_a_str_is_named_as_such() -> None:
    box = sandbox(counter)
    with pytest.raises(InvalidIdError, match="an execution id prefix is a str"):
        list(box.engine.executions(123))  # type: ignore[arg-type]


def test_an_unhashable_id_is_an_invalid_id_not_a_type_error() -> None:
    with pytest.raises(InvalidIdError):
        validate_stream_id(["ex", "1"])


def test_a_kind_of_65_characters_is_refused() -> None:
    from loom_kernel.spi import MAX_KIND_LENGTH, NewRecord

    store = MemoryStore()
    assert MAX_KIND_LENGTH == 64
    store.append("s", 0, [NewRecord("k" * 64, b"", 0.0)])
    with pytest.raises(InvalidArgumentError):
        store.append("s", 1, [NewRecord("k" * 65, b"", 0.0)])


def test_appending_past_the_head_of_a_missing_stream_conflicts() -> None:
    from loom_kernel import ConflictError
    from loom_kernel.spi import NewRecord

    with pytest.raises(ConflictError):
        MemoryStore().append("missing", 3, [NewRecord("k", b"", 0.0)])


def test_a_second_compaction_drops_the_older_snapshot() -> None:
    from loom_kernel import TrimmedError

    @flow(name="parked", version="1")
    def parked(ctx: Context, _input: Any) -> Any:
        ctx.step("one", lambda: 1)
        first = ctx.suspend("a")
        return [first, ctx.suspend("b")]

    box = sandbox(parked)
    box.engine.start("parked", key="p")
    box.engine.compact("p")
    box.engine.resume("p", "x")
    box.engine.compact("p")
    with pytest.raises(TrimmedError):
        box.store.read("snap/p", 0)
    assert len(box.store.read("snap/p", box.store.head("snap/p") - 1)) == 1


def test_a_record_holding_two_json_values_is_a_schema_error() -> None:
    from loom_kernel._core import decode_events
    from loom_kernel.spi import Record, SchemaError

    two = b'{"v":"1.17.0","d":{"reason":null}},{"v":"1.17.0","d":{"reason":null}}'
    with pytest.raises(SchemaError):
        decode_events([Record(1, "EXECUTION_CANCELLED", two, 0.0)], "ex/two")


@pytest.mark.parametrize(
    "then",
    [lambda ctx: ctx.suspend("second"), lambda ctx: ctx.patched("later")],
    ids=["a gate", "patched"],
)
def test_a_call_after_a_swallowed_park_journals_nothing(then: Callable[[Context], Any]) -> None:
    import contextlib

    @flow(name="stubborn", version="1")
    def stubborn(ctx: Context, _input: Any) -> Any:
        with contextlib.suppress(BaseException):
            ctx.suspend("first")
        with contextlib.suppress(BaseException):
            then(ctx)
        return "went on"

    box = sandbox(stubborn)
    assert box.engine.start("stubborn", key="s").waiting_on == "first"
    kinds = [record.kind for record in box.store.read("ex/s")]
    assert kinds == ["EXECUTION_STARTED", "EXECUTION_SUSPENDED"]


@pytest.mark.parametrize("change", ["", 7, None])
def test_a_change_id_must_be_a_non_empty_str(change: Any) -> None:
    @flow(name="patchy", version="1")
    def patchy(ctx: Context, _input: Any) -> Any:
        return ctx.patched(change)

    with pytest.raises(InvalidArgumentError, match="a change id is a non-empty str"):
        sandbox(patchy).engine.start("patchy", key="p")


def test_a_recorded_step_asked_for_from_another_task_is_refused_on_replay() -> None:
    import asyncio

    from loom_kernel import AsyncContext

    @flow(name="moved", version="1")
    async def recorded(ctx: AsyncContext, _input: Any) -> Any:
        first = await ctx.step("a", lambda: 1)
        return [first, await ctx.suspend("go")]

    @flow(name="moved", version="1")
    async def helper_task(ctx: AsyncContext, _input: Any) -> Any:
        async def helper() -> Any:
            return await ctx.step("a", lambda: 1)

        first = await asyncio.create_task(helper())
        return [first, await ctx.suspend("go")]

    box = sandbox(recorded)
    box.engine.start("moved", key="m")
    changed = Engine(box.store, [helper_task], listeners=[])
    with pytest.raises(InvalidArgumentError, match="another task than the flow's own"):
        changed.resume("m", "ok")


def test_the_history_of_an_execution_never_started_is_not_found() -> None:
    from loom_kernel import ExecutionNotFoundError

    with pytest.raises(ExecutionNotFoundError, match="no execution with id"):
        sandbox(counter).engine.history("never")


def test_a_stale_timer_hint_wakes_nothing() -> None:
    @flow(name="napper", version="1")
    def napper(ctx: Context, _input: Any) -> Any:
        ctx.sleep(60)
        return ctx.suspend("human")

    box = sandbox(napper)
    box.engine.start("napper", key="n")
    box.clock.advance(61)
    assert box.engine.fire_due_timers() == ["n"]
    assert box.engine.get("n").waiting_on == "human"
    now = box.clock()
    parts_of(box.engine).driver.timers.add("n", 0, now - 1)  # the timer gate, already woken
    parts_of(box.engine).driver.timers.add("n", 1, now - 1)  # a human gate: no timer wakes it
    assert box.engine.fire_due_timers() == []
    assert box.engine.get("n").waiting_on == "human"


def test_a_cancel_landing_between_two_steps_stops_the_next_one_on_a_store_with_costly_heads() -> (
    None
):
    effects: list[str] = []
    engines: list[Engine] = []

    class CancelledBetweenSteps(MemoryStore):
        head_is_cheap = False

        def _append(self, stream: str, expected: int, records: Any) -> int:
            head = super()._append(stream, expected, records)
            if stream == "ex/c" and b'"name":"a"' in records[0].payload:
                engines[0].cancel("c", "between the steps")
            return head

    @flow(name="pair", version="1")
    def pair(ctx: Context, _input: Any) -> Any:
        ctx.step("a", lambda: effects.append("a"))
        ctx.step("b", lambda: effects.append("b"))
        return "done"

    engine = Engine(CancelledBetweenSteps(), [pair], listeners=[])
    engines.append(engine)
    assert engine.start("pair", key="c").status is Status.CANCELLED
    assert effects == ["a"], "the cancel stopped the run before step b ran"


def test_a_flow_can_still_be_called_as_the_function_it_decorates() -> None:
    @flow(name="plain", version="1")
    def plain(_ctx: Any, number: int) -> int:
        return number * 2

    assert plain(None, 21) == 42


def test_ctx_position_is_the_index_the_next_step_takes_on_every_run() -> None:
    seen: list[list[int]] = []

    @flow(name="positions", version="1")
    def positions(ctx: Context, _input: Any) -> Any:
        at = [ctx.position]
        ctx.step("one", lambda: 1)
        at.append(ctx.position)
        ctx.step("two", lambda: 2)
        at.append(ctx.position)
        seen.append(at)
        ctx.suspend("go")
        return at

    box = sandbox(positions, listeners=[])
    box.engine.start("positions", key="p")
    assert box.engine.resume("p").result == [0, 1, 2]
    assert seen == [[0, 1, 2], [0, 1, 2]], "the same on the replay"


def test_a_coroutine_a_sync_step_returns_is_closed_not_left_to_warn() -> None:
    async def forgotten() -> int:
        return 1

    @flow(name="returns_coroutine", version="1")
    def returns_coroutine(ctx: Context, _input: Any) -> Any:
        return ctx.step("oops", forgotten)

    _refused_with_no_never_awaited_warning(
        sandbox(returns_coroutine, listeners=[]).engine,
        "returns_coroutine",
        "returned an awaitable",
    )


def _refused_with_no_never_awaited_warning(engine: Engine, flow_name: str, match: str) -> None:
    """Start `flow_name`: refused with `match`, and no coroutine left to warn when collected."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(InvalidArgumentError, match=match):
            engine.start(flow_name)
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


@pytest.mark.parametrize("version", ["", 5, b"1"])
def test_a_flow_version_is_a_non_empty_str(version: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="a flow version is a non-empty str"):
        flow(name="versioned", version=version)(lambda ctx, _input: None)


def test_a_load_that_keeps_meeting_compactions_gives_up_with_store_unavailable() -> None:
    from loom_kernel import StoreUnavailableError
    from loom_kernel.spi import NewRecord, TrimmedError

    class EndlesslyCompacted(MemoryStore):
        """Each read of the journal meets a trim floor a newer snapshot moved on."""

        compacting = False

        def _read(self, stream: str, after: int, limit: int | None) -> Any:
            if self.compacting and stream == "ex/c":
                (latest,) = super()._read("snap/c", self._head("snap/c") - 1, 1)
                copy = NewRecord(latest.kind, latest.payload, latest.timestamp)
                super()._append("snap/c", self._head("snap/c"), (copy,))
                raise TrimmedError(stream, after, after + 1)
            return super()._read(stream, after, limit)

    store = EndlesslyCompacted()
    box = sandbox(counter, store=store, listeners=[])
    box.engine.start("counter", key="c")
    box.engine.compact("c")
    store.compacting = True
    with pytest.raises(StoreUnavailableError, match="kept being compacted"):
        sandbox(counter, store=store, listeners=[]).engine.get("c")


def test_ctx_input_is_the_runs_input() -> None:
    @flow(name="echo_input", version="1")
    def echo_input(ctx: Context, _input: Any) -> Any:
        return ctx.input

    box = sandbox(echo_input)
    assert box.engine.start("echo_input", {"a": [1, 2]}).result == {"a": [1, 2]}


def test_an_async_sleep_that_woke_is_not_taken_for_an_unawaited_call_at_the_next_gate() -> None:
    from loom_kernel import AsyncContext

    @flow(name="two_naps", version="1")
    async def two_naps(ctx: AsyncContext, _input: Any) -> Any:
        await ctx.sleep(30)
        await ctx.sleep(30)
        return "rested twice"

    clock = FakeClock()
    box = sandbox(two_naps, clock=clock)
    run = box.engine.start("two_naps")
    clock.advance(31)
    assert box.engine.fire_due_timers() == [run.id]
    assert box.engine.get(run.id).status is Status.SUSPENDED, "parked at the second nap"
    clock.advance(31)
    box.engine.fire_due_timers()
    assert box.engine.get(run.id).result == "rested twice"


def test_a_flow_that_swallows_a_park_and_then_raises_stays_parked_not_failed() -> None:
    @flow(name="swallower", version="1")
    def swallower(ctx: Context, _input: Any) -> Any:
        import contextlib

        with contextlib.suppress(BaseException):  # the misuse under test
            ctx.suspend("wait")
        raise ValueError("went on past the park")

    box = sandbox(swallower)
    run = box.engine.start("swallower", key="sw")
    assert (run.status, run.waiting_on) == (Status.SUSPENDED, "wait")


def test_a_sleep_awaited_in_a_task_of_its_own_is_refused_and_journals_nothing() -> None:
    import asyncio

    from loom_kernel import AsyncContext

    @flow(name="nap_in_a_task", version="1")
    async def nap_in_a_task(ctx: AsyncContext, _input: Any) -> Any:
        await asyncio.ensure_future(ctx.sleep(60))
        return "rested"

    box = sandbox(nap_in_a_task)
    with pytest.raises(InvalidArgumentError, match="another task than the flow's own"):
        box.engine.start("nap_in_a_task", key="t")
    assert [record.kind for record in box.store.read("ex/t")] == ["EXECUTION_STARTED"]
    assert box.store.streams("timers/") == []


def test_the_documented_retry_defaults() -> None:
    from loom_kernel import RetryPolicy

    policy = RetryPolicy()
    assert (policy.attempts, policy.backoff, policy.factor, policy.max_backoff) == (
        3,
        1.0,
        2.0,
        60.0,
    )
    assert policy.retry_on == (Exception,)
    tries: list[int] = []

    def always_fails() -> None:
        tries.append(1)
        raise RuntimeError("no")

    @flow(name="fails_thrice", version="1")
    def fails_thrice(ctx: Context, _input: Any) -> Any:
        return ctx.step("fail", always_fails)

    box = sandbox(fails_thrice)  # the engine's default policy, with a no-op sleep
    assert box.engine.start("fails_thrice").status is Status.FAILED
    assert len(tries) == 3


@pytest.mark.parametrize("payload", ["text", bytearray(b"x"), None, 7])
def test_a_record_payload_that_is_not_bytes_is_refused(payload: Any) -> None:
    from loom_kernel.spi import NewRecord

    with pytest.raises(InvalidArgumentError, match="payload must be bytes"):
        NewRecord("k", payload, 1.0)


def test_a_workers_beats_are_trimmed_as_they_go() -> None:
    from loom_kernel.spi import TrimmedError

    store = MemoryStore()
    engine = Engine(store, [], worker_id="beating", listeners=[])
    for _ in range(40):
        parts_of(engine).driver.heartbeat.beat()
    assert store.head("workers/beating") == 40
    with pytest.raises(TrimmedError):
        store.read("workers/beating", 0)
    (last,) = store.read("workers/beating", 39)
    assert last.position == 40


def test_a_memory_store_confirmation_tells_another_writers_commit_from_its_own() -> None:
    from loom_kernel.spi import ConflictError, NewRecord

    store = MemoryStore()
    store.append("s", 0, [NewRecord("k", b"theirs", 1.0)])
    with pytest.raises(ConflictError):
        store._confirm("s", 0, 1, "a commit id that never landed")
    with pytest.raises(ConflictError):
        store._confirm("never", 0, 1, "x")


def test_start_returns_the_run_as_its_listeners_left_it() -> None:
    def approve_at_once(engine: Engine, execution: Any) -> None:
        if execution.status is Status.SUSPENDED and execution.waiting_on == "auto":
            engine.resume(execution.id, "yes")

    @flow(name="auto_approved", version="1")
    def auto_approved(ctx: Context, _input: Any) -> Any:
        return ctx.suspend("auto")

    box = sandbox(auto_approved, listeners=[approve_at_once])
    run = box.engine.start("auto_approved")
    assert (run.status, run.result) == (Status.COMPLETED, "yes")


@pytest.mark.parametrize("payload", [b"[1, 2]", b'"a step"', b"7"])
def test_a_step_record_that_is_not_a_json_object_is_a_schema_error(payload: bytes) -> None:
    from loom_kernel.spi import NewRecord, SchemaError

    @flow(name="one_step", version="1")
    def one_step(ctx: Context, _input: Any) -> Any:
        return ctx.step("s", lambda: 1)

    box = sandbox(one_step)
    box.engine.start("one_step", key="j")
    stream = "ex/j"
    box.store.append(stream, box.store.head(stream), [NewRecord("STEP_COMPLETED", payload, 1.0)])
    with pytest.raises(SchemaError):
        box.new_engine().get("j")


def test_looking_whether_another_process_lives_sends_it_no_signal() -> None:
    import subprocess
    import sys

    from loom_kernel._coordination import abandoned_here, default_worker_id

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        machine = default_worker_id().partition(":")[0]
        assert abandoned_here(f"{machine}:{child.pid}:nonce", "r") is False, "it lives"
        with pytest.raises(subprocess.TimeoutExpired):  # the look did not signal it
            child.wait(timeout=0.5)
    finally:
        child.kill()
        child.wait()
    assert abandoned_here(f"{machine}:{child.pid}:nonce", "r") is True, "it exited"


@pytest.mark.parametrize(
    "data",
    [
        b'{"index":"0","name":"s","result":1,"attempts":1}',
        b'{"index":0,"name":7,"result":1,"attempts":1}',
        b'{"index":0,"name":"s","result":1,"attempts":"1"}',
    ],
)
def test_a_step_record_with_a_field_of_the_wrong_type_is_a_schema_error(data: bytes) -> None:
    from loom_kernel import SchemaError
    from loom_kernel.events import EVENT_SCHEMA, ExecutionStarted, encode_event
    from loom_kernel.spi import NewRecord

    store = MemoryStore()
    start = encode_event(ExecutionStarted("counter", counter.code_hash, 0), 1.0)
    step = NewRecord(
        "STEP_COMPLETED", b'{"v":"' + EVENT_SCHEMA.encode() + b'","d":' + data + b"}", 1.0
    )
    store.append("ex/typed", 0, [start, step])
    with pytest.raises(SchemaError):
        Engine(store, [counter]).get("typed")


@pytest.mark.parametrize("to", ["", 5, 1.5])
def test_a_version_that_is_neither_a_flow_nor_a_name_is_refused(to: Any) -> None:
    box = sandbox(counter)
    box.engine.start("counter", 0, key="versioned")
    with pytest.raises(InvalidArgumentError, match="a version is a Flow"):
        box.engine.replay_check("versioned", to=to)


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


class _CostlyHeads(MemoryStore):
    """A store whose head is a round trip (as on S3): no owner check before a step."""

    head_is_cheap = False


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

    def opened_after_the_first_start(*args: Any) -> None:
        first.start("raced", "first", key="k")  # lands between the check and the append
        opened(*args)

    parts_of(second).driver.runs.opened = opened_after_the_first_start  # type: ignore[method-assign,assignment]
    view = second.start("raced", "second", key="k")
    assert view.status is Status.COMPLETED
    assert view.result == "first"
    assert ran == ["first"]
    assert [record.kind for record in store.read("ex/k")].count("EXECUTION_STARTED") == 1


def test_a_step_an_async_flow_never_awaited_is_closed_not_left_to_warn() -> None:
    from loom_kernel import AsyncContext

    async def instant() -> int:
        return 1

    @flow(name="forgets_a_step", version="1")
    async def forgets_a_step(ctx: AsyncContext, _input: Any) -> Any:
        ctx.step("never", instant)  # type: ignore[unused-coroutine]
        return "done"

    _refused_with_no_never_awaited_warning(
        sandbox(forgets_a_step, listeners=[]).engine,
        "forgets_a_step",
        "never awaited before the flow returned",
    )


def test_a_recorded_value_is_journaled_as_taken_at_the_first_attempt() -> None:
    from loom_kernel.events import StepCompleted

    @flow(name="records_values", version="1")
    def records_values(ctx: Context, _input: Any) -> Any:
        return [ctx.now(), ctx.random(), ctx.uuid(), ctx.patched("p")]

    box = sandbox(records_values, listeners=[])
    box.engine.start("records_values", key="r")
    steps = [e.event for e in box.engine.history("r") if isinstance(e.event, StepCompleted)]
    assert [(step.name, step.attempts) for step in steps] == [
        ("loom.now", 1),
        ("loom.random", 1),
        ("loom.uuid", 1),
        (steps[3].name, 1),
    ]


def test_an_engine_keeps_no_record_of_drives_that_ended() -> None:
    """A long-lived worker drives any number of runs: what each drive held is let go."""

    @flow(name="ends_or_parks", version="1")
    def ends_or_parks(ctx: Context, park: bool) -> Any:
        ctx.step("s", lambda: 1)
        return ctx.suspend("go") if park else "done"

    engine = Engine(MemoryStore(), [ends_or_parks], listeners=[])
    for number in range(5):
        engine.start("ends_or_parks", number % 2 == 1, key=f"r{number}")
    engine.resume("r1", "yes")
    assert parts_of(engine).driver.drives_in_progress() == 0


def test_the_kernel_alone_folds_without_msgspec(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import json
    import sys

    from loom_kernel._core import _fast_fold

    monkeypatch.setitem(sys.modules, "msgspec", None)  # an import of it fails
    spec = importlib.util.spec_from_file_location("_fold_without_msgspec", _fast_fold.__file__)
    assert spec is not None
    assert spec.loader is not None
    alone = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(alone)
    assert alone.decode_step_runs is None
    assert alone.parse_many is json.loads

    assert alone.step_runs([]) is None, "the general path"


def test_a_beat_that_fails_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    import time

    from loom_kernel import StoreUnavailableError
    from loom_kernel._coordination import Heartbeat

    class NoBeats(MemoryStore):
        def _append(self, stream: str, expected: int, records: Any) -> int:
            if stream.startswith("workers/"):
                raise StoreUnavailableError("the beat did not land (injected)")
            return super()._append(stream, expected, records)

    heartbeat = Heartbeat(NoBeats(), lambda: "w-failing", 0.15, FakeClock())
    deadline = time.monotonic() + 10
    with caplog.at_level("WARNING", logger="loom"), heartbeat.holding("r"):
        while "was not renewed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "the lease of w-failing was not renewed: the beat did not land" in caplog.text


def test_an_error_that_replaced_a_pass_ending_to_run_again_is_not_replaced_by_a_later_one() -> None:
    """The first stop holds, except that an error replaces a pass ending to run again;
    once it has, a later error (a flow that swallowed the stop) replaces nothing."""

    @flow(name="two_errors", version="1")
    def two_errors(ctx: Context, _input: Any) -> Any:
        ctx._replay_again()  # as an async pass does, about to see concurrent steps end
        with contextlib.suppress(BaseException):  # a flow swallowing its stop
            ctx.step(123, lambda: 1)  # type: ignore[arg-type]
        return ctx.step(456, lambda: 1)  # type: ignore[arg-type]

    box = sandbox(two_errors, listeners=[])
    with pytest.raises(InvalidArgumentError, match="not 123"):
        box.engine.start("two_errors")


def test_a_deleted_stream_error_says_what_happened() -> None:
    from loom_kernel import StreamDeletedError

    error = StreamDeletedError("orders/7", 3)
    assert (error.stream, error.head) == ("orders/7", 3)
    assert str(error) == (
        "stream 'orders/7' was deleted at head 3; a deleted stream's name is retired and "
        "its positions are never reused"
    )


def test_a_queue_place_defaults_to_the_first_partition_the_middle_priority_and_no_key() -> None:
    from loom_kernel.events import QueuePlace

    assert QueuePlace("q") == QueuePlace("q", partition=0, priority=0, key=None)


def test_a_handle_waiting_on_a_run_driven_here_sleeps_between_its_looks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It sleeps until this engine ends a run (or its next look is due), not spins."""
    running, go = threading.Event(), threading.Event()

    def wait_for_go() -> bool:
        running.set()
        return go.wait(10)

    @flow(name="waits_for_go")
    def waits_for_go(ctx: Context, _input: Any) -> Any:
        return ctx.step("go", wait_for_go)

    engine = Engine(MemoryStore(), [waits_for_go], listeners=[])
    driver = threading.Thread(target=engine.start, args=("waits_for_go",), kwargs={"key": "w"})
    driver.start()
    try:
        assert running.wait(10)
        handle = engine.handle("w")
        looks = [0]
        real_get = engine.get

        def counted(execution_id: str) -> Any:
            looks[0] += 1
            return real_get(execution_id)

        monkeypatch.setattr(engine, "get", counted)
        threading.Timer(0.3, go.set).start()
        assert handle.result(timeout=10) is True
    finally:
        go.set()
        driver.join(10)
    assert looks[0] < 100, looks[0]
