"""The engine: steps run once, starts are idempotent, bad input loses nothing."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from loom_kernel import (
    AsyncContext,
    Context,
    Engine,
    ExecutionNotFoundError,
    MemoryStore,
    NonDeterminismError,
    NotSuspendedError,
    RetryPolicy,
    Status,
    StepFailedError,
    UnknownFlowError,
    code_hash,
    flow,
)
from loom_kernel._core import encode_event
from loom_kernel._engine import parts_of
from loom_kernel._replay import _writer, drive_here
from loom_kernel.events import ExecutionClaimed
from loom_kernel.spi import (
    ConflictError,
    InvalidArgumentError,
    InvalidIdError,
    JournalStore,
    NewRecord,
)
from loom_kernel.testing import FakeClock

EngineFactory = Callable[..., Engine]


def _journal(store: JournalStore, execution_id: str) -> list[tuple[int, str, bytes]]:
    return [(r.position, r.kind, r.payload) for r in store.read("ex/" + execution_id)]


def test_a_step_runs_once_and_replays_after(make_engine: EngineFactory) -> None:
    calls: list[int] = []

    @flow
    def once(ctx: Context, _input: Any) -> Any:
        def count() -> int:
            calls.append(1)
            return len(calls)

        value = ctx.step("count", count)
        gate = ctx.suspend("go")
        return [value, gate]

    engine = make_engine([once])
    ex = engine.start("once")
    assert calls == [1]
    assert make_engine([once]).resume(ex.id, "on").result == [1, "on"]
    assert calls == [1], "a fresh engine replays the step from its frame"


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


class RendezvousStore(MemoryStore):
    """Holds every resume append until all racers have loaded the run and reached it."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(parties)

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        if records[0].kind == "EXECUTION_RESUMED":
            self.barrier.wait(timeout=10)
        return super()._append(stream, expected, records)


def test_two_engines_resuming_one_gate_at_once_one_wins(clock: FakeClock) -> None:
    @flow
    def two(ctx: Context, _input: Any) -> Any:
        return [ctx.suspend("a"), ctx.suspend("b")]

    store = RendezvousStore(parties=2)
    first, second = Engine(store, [two], clock=clock), Engine(store, [two], clock=clock)
    ex = first.start("two")
    outcomes: dict[str, str] = {}

    def resume(name: str, engine: Engine) -> None:
        try:
            engine.resume(ex.id, f"from-{name}")
            outcomes[name] = "won"
        except ConflictError:
            outcomes[name] = "conflict"

    threads = [
        threading.Thread(target=resume, args=("first", first)),
        threading.Thread(target=resume, args=("second", second)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes.values()) == ["conflict", "won"]
    winner = next(name for name, outcome in outcomes.items() if outcome == "won")
    state = first.state(ex.id)
    assert state.resume_payloads == [f"from-{winner}"], "the loser fed no gate"
    assert first.get(ex.id).waiting_on == "b"
    kinds = [r.kind for r in store.read("ex/" + ex.id)]
    assert kinds.count("EXECUTION_RESUMED") == 1


def test_resume_can_name_the_gate_it_means(make_engine: EngineFactory) -> None:
    engine = make_engine([flow(lambda ctx, _i: [ctx.suspend("a"), ctx.suspend("b")], name="ab")])
    ex = engine.start("ab")
    engine.resume(ex.id, "for-a", on="a")
    with pytest.raises(NotSuspendedError, match="it waits on 'b', not 'a'"):
        engine.resume(ex.id, "also-for-a", on="a")
    assert engine.resume(ex.id, "for-b", on="b").result == ["for-a", "for-b"]


def test_racing_resumes_in_threads_deliver_exactly_once(
    store: JournalStore, clock: FakeClock
) -> None:
    @flow
    def two(ctx: Context, _input: Any) -> Any:
        return [ctx.suspend("a"), ctx.suspend("b")]

    ex = Engine(store, [two], clock=clock).start("two")
    engines = [Engine(store, [two], clock=clock) for _ in range(6)]
    for engine in engines:
        engine.get(ex.id)
    barrier = threading.Barrier(len(engines))
    outcomes: list[str] = []

    def race(number: int, engine: Engine) -> None:
        barrier.wait()
        try:
            engine.resume(ex.id, f"p{number}")
            outcomes.append("won")
        except (ConflictError, NotSuspendedError):
            outcomes.append("refused")

    threads = [threading.Thread(target=race, args=(n, e)) for n, e in enumerate(engines)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    state = engines[0].state(ex.id)
    # Each winner fed exactly the gate it saw; nothing was buffered for a later gate.
    assert len(state.resume_payloads) == outcomes.count("won") <= 2
    positions = [r.position for r in store.read("ex/" + ex.id)]
    assert positions == list(range(1, len(positions) + 1))


def test_resume_dedupe_key_makes_redelivery_a_no_op(
    make_engine: EngineFactory, store: JournalStore
) -> None:
    engine = make_engine([flow(lambda ctx, _i: [ctx.suspend("a"), ctx.suspend("b")], name="gates")])
    ex = engine.start("gates")
    engine.resume(ex.id, "first", key="notice-1")
    before = _journal(store, ex.id)
    again = engine.resume(ex.id, "first", key="notice-1")
    assert again.waiting_on == "b", "the re-delivered notice did not feed gate b"
    assert _journal(store, ex.id) == before
    engine.resume(ex.id, "second", key="notice-2")
    assert engine.get(ex.id).result == ["first", "second"]
    assert engine.resume(ex.id, "late", key="notice-2").status is Status.COMPLETED


def test_resume_of_a_run_not_at_a_gate_is_refused(
    make_engine: EngineFactory, store: JournalStore
) -> None:
    @flow
    def nap(ctx: Context, _input: Any) -> str:
        ctx.sleep(100)
        return "up"

    engine = make_engine([nap, flow(lambda ctx, i: i, name="echo")])
    sleeping = engine.start("nap")
    with pytest.raises(NotSuspendedError, match="fire_due_timers"):
        engine.resume(sleeping.id, "early")
    done = engine.start("echo", 5)
    before = _journal(store, done.id)
    with pytest.raises(NotSuspendedError, match="completed, not parked"):
        engine.resume(done.id, "late")
    assert _journal(store, done.id) == before


def test_replay_is_idempotent(make_engine: EngineFactory, store: JournalStore) -> None:
    @flow
    def parked(ctx: Context, _input: Any) -> Any:
        ctx.step("a", lambda: 1)
        ctx.now()
        return ctx.suspend("wait")

    engine = make_engine([parked])
    ex = engine.start("parked")
    before = _journal(store, ex.id)
    for _ in range(3):
        state = engine.state(ex.id)
        drive_here(parts_of(make_engine([parked])).driver.drive(state))  # a re-run with nothing new
        state.status = Status.RUNNING
        drive_here(parts_of(make_engine([parked])).driver.drive(state))
    assert make_engine([parked]).recover() == []
    assert _journal(store, ex.id) == before


def test_now_random_and_uuid_are_journaled(make_engine: EngineFactory, clock: FakeClock) -> None:
    @flow
    def chance(ctx: Context, _input: Any) -> Any:
        values = [ctx.now(), ctx.random(), ctx.uuid()]
        ctx.suspend("look")
        return values

    engine = make_engine([chance])
    ex = engine.start("chance")
    first = engine.state(ex.id).steps
    clock.advance(1000)
    done = make_engine([chance]).resume(ex.id, None)
    assert done.result == [first[0].result, first[1].result, first[2].result]
    assert done.result[0] == clock.now - 1000


def test_step_retries_then_succeeds(make_engine: EngineFactory) -> None:
    attempts: list[int] = []
    waits: list[float] = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("try again")
        return "ok"

    @flow
    def job(ctx: Context, _input: Any) -> Any:
        return ctx.step("flaky", flaky, retry=RetryPolicy(attempts=5, backoff=2, factor=3))

    engine = make_engine([job], sleep=waits.append)
    ex = engine.start("job")
    assert ex.result == "ok"
    assert waits == [2.0, 6.0]
    assert engine.state(ex.id).steps[0].attempts == 3


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_run_cancelled_between_a_steps_attempts_makes_no_more(
    make_engine: EngineFactory, kind: str
) -> None:
    """A cancel during a retry's backoff: the run never starts another attempt (a
    cancelled run never starts another step), and nothing of the step is journaled."""
    attempts: list[int] = []
    holder: list[Engine] = []

    def failing(run_id: str) -> str:
        attempts.append(1)
        holder[0].cancel(run_id, "enough")  # lands while the step runs
        raise ConnectionError("try again")

    policy = RetryPolicy(attempts=5, backoff=0)
    if kind == "sync":

        @flow(name="retrier")
        def retrier(ctx: Context, _input: Any) -> Any:
            return ctx.step("flaky", failing, ctx.execution_id, retry=policy)

    else:

        @flow(name="retrier")
        async def retrier(ctx: AsyncContext, _input: Any) -> Any:
            return await ctx.step("flaky", failing, ctx.execution_id, retry=policy)

    holder.append(make_engine([retrier]))
    holder[0].start("retrier", key="r")
    assert attempts == [1]
    assert holder[0].get("r").status is Status.CANCELLED
    assert holder[0].state("r").steps == {}


def test_exhausted_step_raises_inside_the_flow_which_may_catch_it(
    make_engine: EngineFactory,
) -> None:
    @flow
    def careful(ctx: Context, _input: Any) -> Any:
        try:
            ctx.step("boom", _fail, retry=RetryPolicy(attempts=2, backoff=0))
        except StepFailedError as exc:
            return {
                "caught": exc.error_type,
                "message": exc.error_message,
                "attempts": exc.attempts,
            }
        return "unreachable"

    engine = make_engine([careful])
    ex = engine.start("careful")
    assert ex.result == {"caught": "ValueError", "message": "no luck", "attempts": 2}


def _fail() -> None:
    raise ValueError("no luck")


def test_uncaught_error_fails_the_execution_with_type_and_message(
    make_engine: EngineFactory,
) -> None:
    class PaymentDeclinedError(Exception):
        pass

    @flow
    def strict(ctx: Context, _input: Any) -> Any:
        ctx.step("check", lambda: 1)
        raise PaymentDeclinedError("card 4242 declined")

    ex = make_engine([strict]).start("strict")
    assert ex.status is Status.FAILED
    assert ex.error is not None
    assert ex.error.type.endswith("PaymentDeclinedError")
    assert ex.error.message == "card 4242 declined"


def test_a_failed_step_replays_as_the_same_failure(make_engine: EngineFactory) -> None:
    calls: list[int] = []

    def boom() -> None:
        calls.append(1)
        raise KeyError("gone")

    @flow
    def replayed(ctx: Context, _input: Any) -> Any:
        try:
            ctx.step("boom", boom)
        except StepFailedError as exc:
            first = exc.error_type
        return [first, ctx.suspend("next")]

    engine = make_engine([replayed])
    ex = engine.start("replayed")
    assert make_engine([replayed]).resume(ex.id, 1).result == ["KeyError", 1]
    assert calls == [1]


@attrs.frozen
class Quote:
    total: float
    currency: str


@dataclasses.dataclass
class Line:
    sku: str
    qty: int


def test_attrs_and_dataclass_results_go_through_the_converter(make_engine: EngineFactory) -> None:
    @flow
    def typed(ctx: Context, _input: Any) -> Any:
        quote = ctx.step("quote", lambda: Quote(12.5, "EUR"), returns=Quote)
        line = ctx.step("line", lambda: Line("a", 2))
        assert isinstance(quote, Quote)
        gate = ctx.suspend("go")
        return {"quote": quote, "line": line, "gate": gate}

    engine = make_engine([typed])
    ex = engine.start("typed")
    done = make_engine([typed]).resume(ex.id, True)
    assert done.result == {
        "quote": {"total": 12.5, "currency": "EUR"},
        "line": {"sku": "a", "qty": 2},
        "gate": True,
    }


@attrs.define
class _Half:
    """An attrs class; an instance made without __init__ lacks its field."""

    n: int


@pytest.mark.parametrize(
    "value",
    # A lone surrogate has no UTF-8 form; cattrs cannot unstructure a half-made instance.
    [{1, 2}, "\ud800", {"key": ["\udfff"]}, object.__new__(_Half)],
    ids=["set", "lone surrogate", "nested lone surrogate", "unreadable attrs instance"],
)
def test_a_step_result_that_is_not_json_is_refused_before_it_is_journaled(
    make_engine: EngineFactory, store: JournalStore, value: Any
) -> None:
    @flow
    def bad(ctx: Context, _input: Any) -> Any:
        ctx.step("ok", lambda: 1)
        return ctx.step("bad", lambda: value)

    engine = make_engine([bad])
    with pytest.raises(InvalidArgumentError, match="result of step 'bad' is not JSON"):
        engine.start("bad", key="bad-1")
    kinds = [kind for _, kind, _ in _journal(store, "bad-1")]
    assert kinds == ["EXECUTION_STARTED", "STEP_COMPLETED"]
    assert engine.get("bad-1").status is Status.RUNNING
    with pytest.raises(InvalidArgumentError, match="not JSON"):
        engine.start("bad", value, key="bad-2")  # the same goes for a flow's input
    assert store.head(engine.stream_of("bad-2")) == 0


@pytest.mark.parametrize(
    ("body", "error", "message"),
    [
        (lambda ctx: ctx.step(42, lambda: 1), InvalidArgumentError, "step name is a non-empty str"),
        (lambda ctx: ctx.suspend(""), InvalidArgumentError, "gate name"),
        (lambda ctx: ctx.suspend("loom.timer"), InvalidArgumentError, "gate name"),
        (lambda ctx: ctx.sleep("soon"), InvalidArgumentError, "seconds or a timedelta"),
        (
            lambda ctx: ctx.step("coro", _coroutine),
            InvalidArgumentError,
            "awaitable in a sync flow",
        ),
    ],
)
def test_misuse_is_a_clear_error_and_leaves_the_journal_alone(
    make_engine: EngineFactory,
    store: JournalStore,
    body: Callable[[Context], Any],
    error: type[Exception],
    message: str,
) -> None:
    engine = make_engine([flow(lambda ctx, _i: body(ctx), name="misuse")])
    with pytest.raises(error, match=message):
        engine.start("misuse", key="m")
    assert [kind for _, kind, _ in _journal(store, "m")] == ["EXECUTION_STARTED"]


async def _coroutine() -> int:
    return 1


def test_bad_input_gets_kernel_errors_and_changes_nothing(
    make_engine: EngineFactory, store: JournalStore
) -> None:
    engine = make_engine([flow(lambda ctx, _i: ctx.suspend("g"), name="gate")])
    with pytest.raises(UnknownFlowError, match=r"no flow named 'nope'.*registered: gate"):
        engine.start("nope")
    with pytest.raises(InvalidArgumentError, match="flow input is not JSON"):
        engine.start("gate", {"when": object()})
    with pytest.raises(InvalidIdError):
        engine.start("gate", key="../escape")
    with pytest.raises(ExecutionNotFoundError):
        engine.resume("missing", 1)
    with pytest.raises(ExecutionNotFoundError):
        engine.get("missing")
    ex = engine.start("gate", key="g1")
    before = _journal(store, "g1")
    with pytest.raises(InvalidArgumentError, match="resume payload is not JSON"):
        engine.resume("g1", float("nan"))
    with pytest.raises(InvalidArgumentError, match="resume key"):
        engine.resume("g1", 1, key=5)  # type: ignore[arg-type]
    assert _journal(store, ex.id) == before
    assert store.streams("ex/") == ["ex/g1"]
    assert store.streams("snap/") == store.streams("timers/") == []


def test_non_determinism_names_index_and_both_names(store: JournalStore, clock: FakeClock) -> None:
    @flow(name="shifty", version="1")
    def before(ctx: Context, _input: Any) -> Any:
        ctx.step("charge", lambda: 1)
        return ctx.suspend("ok")

    @flow(name="shifty", version="1")
    def after(ctx: Context, _input: Any) -> Any:
        ctx.step("refund", lambda: 1)
        return ctx.suspend("ok")

    ex = Engine(store, [before], clock=clock).start("shifty")
    journal = _journal(store, ex.id)
    with pytest.raises(NonDeterminismError) as caught:
        Engine(store, [after], clock=clock).resume(ex.id, "go")
    error = caught.value
    assert (error.index, error.recorded, error.found) == (0, "charge", "refund")
    assert "step #0 was recorded as 'charge' but the code now asks for 'refund'" in str(error)
    assert _journal(store, ex.id) == journal, "a resume that cannot replay journals nothing"
    fixed = Engine(store, [before], clock=clock)
    assert fixed.get(ex.id).waiting_on == "ok", "the run stays parked at its gate"
    assert fixed.resume(ex.id, "go").result == "go", "fixed code takes the same payload"


def test_cancel_ends_the_run_and_no_step_runs_after(make_engine: EngineFactory) -> None:
    ran: list[str] = []

    @flow
    def long(ctx: Context, _input: Any) -> Any:
        ctx.step("one", lambda: ran.append("one"))
        ctx.suspend("wait")
        ctx.step("two", lambda: ran.append("two"))
        return "done"

    engine = make_engine([long])
    ex = engine.start("long")
    assert engine.cancel(ex.id, "operator").status is Status.CANCELLED
    with pytest.raises(NotSuspendedError):
        engine.resume(ex.id, 1)
    assert make_engine([long]).recover() == []
    assert ran == ["one"]
    assert engine.cancel(ex.id).status is Status.CANCELLED  # idempotent


def test_cancel_from_another_engine_stops_a_running_flow_before_its_next_step(
    store: JournalStore, clock: FakeClock
) -> None:
    ran: list[str] = []
    other = Engine(store, [], clock=clock)

    @flow
    def racing(ctx: Context, _input: Any) -> Any:
        ctx.step("one", lambda: ran.append("one"))
        other.cancel(ctx.execution_id, "meanwhile")  # lands while this run is mid-flight
        ctx.step("two", lambda: ran.append("two"))
        return "done"

    engine = Engine(store, [racing], clock=clock)
    ex = engine.start("racing", key="r")
    assert ran == ["one"]
    assert engine.get(ex.id).status is Status.CANCELLED


class _CountedHeads(MemoryStore):
    """Counts head() calls; can write a claim by another worker, as another process
    would, right after the run's first step is journaled (past the process's count)."""

    def __init__(self, *, foreign_claim: bool = False) -> None:
        super().__init__()
        self.heads = 0
        self.foreign_claim = foreign_claim

    def _head(self, stream: str) -> int:
        self.heads += 1
        return super()._head(stream)

    def _append(self, stream: str, expected: int, records: Any) -> int:
        head = super()._append(stream, expected, records)
        if self.foreign_claim and stream == "ex/r" and records[0].kind == "STEP_COMPLETED":
            self.foreign_claim = False
            claim = encode_event(ExecutionClaimed("thief", "x"), 0.0)
            head = super()._append(stream, head, (claim,))
        return head


def test_steps_in_a_tight_loop_do_not_look_at_the_head_between_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_writer, "_FRESH_HEAD", 60.0)  # a loaded machine's pauses

    @flow(name="loop", version="1")
    def loop(ctx: Context, steps: int) -> Any:
        return [ctx.step(f"s{index}", lambda index=index: index) for index in range(steps)]

    looks = []
    for steps in (1, 20):
        store = _CountedHeads()
        Engine(store, [loop], listeners=[]).start("loop", steps, key="r")
        looks.append(store.heads)
    assert looks[0] == looks[1]  # the first step's look; none after the drive's own appends


def test_a_step_long_after_the_last_append_looks_at_the_head_first() -> None:
    import time

    store = _CountedHeads(foreign_claim=True)
    effects: list[str] = []

    @flow(name="slow", version="1")
    def slow(ctx: Context, _input: Any) -> Any:
        ctx.step("first", lambda: "first")
        time.sleep(0.01)  # flow code between steps, far longer than an instant
        return ctx.step("second", lambda: effects.append("second"))

    Engine(store, [slow], listeners=[]).start("slow", key="r")
    assert effects == [], "it saw the other worker's claim before starting the step"


def test_a_move_by_another_process_in_the_instant_after_an_append_is_found_at_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_writer, "_FRESH_HEAD", 60.0)  # the instant, however slow
    store = _CountedHeads(foreign_claim=True)
    effects: list[str] = []

    @flow(name="quick", version="1")
    def quick(ctx: Context, _input: Any) -> Any:
        ctx.step("first", lambda: "first")
        return ctx.step("second", lambda: effects.append("second"))

    engine = Engine(store, [quick], listeners=[])
    engine.start("quick", key="r")
    # The step ran (no look at the head in that instant), its append was refused.
    assert effects == ["second"]
    assert engine.get("r").owner == "thief"
    assert [record.kind for record in store.read("ex/r")].count("STEP_COMPLETED") == 1


class _CostlyHeadStore(MemoryStore):
    """A store that says its head is a round trip, as S3's is."""

    head_is_cheap = False

    def __init__(self) -> None:
        super().__init__()
        self.heads = 0

    def _head(self, stream: str) -> int:
        if stream.startswith("ex/"):  # a run's journal (the run index has its own heads)
            self.heads += 1
        return super()._head(stream)


def test_a_store_with_a_costly_head_is_not_asked_before_each_step_yet_a_cancel_holds(
    clock: FakeClock,
) -> None:
    store = _CostlyHeadStore()
    ran: list[str] = []
    other = Engine(store, [], clock=clock)

    @flow
    def racing(ctx: Context, _input: Any) -> Any:
        ctx.step("one", lambda: ran.append("one"))
        other.cancel(ctx.execution_id, "meanwhile")
        ctx.step("two", lambda: ran.append("two"))  # runs: nobody looked at the head
        return "done"

    @flow
    def ten(ctx: Context, _input: Any) -> Any:
        return [ctx.step(f"s{index}", lambda index=index: index) for index in range(10)]

    engine = Engine(store, [racing, ten], clock=clock)
    store.heads = 0
    engine.start("ten")
    assert store.heads == 0, "no head lookups between steps"
    ex = engine.start("racing", key="r")
    assert ran == ["one", "two"]  # at least once, as documented ...
    view = engine.get(ex.id)
    assert view.status is Status.CANCELLED  # ... but its result was never journaled
    assert [frame.name for frame in engine.frames(ex.id).values()] == ["one"]


def test_code_hash_is_pinned_at_start(make_engine: EngineFactory) -> None:
    @flow
    def pinned(ctx: Context, _input: Any) -> int:
        return 1

    @flow(version="7")
    def versioned(ctx: Context, _input: Any) -> int:
        return 1

    engine = make_engine([pinned, versioned])
    assert engine.start("pinned").code_hash == pinned.code_hash == code_hash(pinned.fn)
    assert pinned.code_hash.startswith("sha256:")
    assert engine.start("versioned").code_hash == "version:7"


def test_crash_mid_flow_then_recover_completes_without_redoing_steps(
    store: JournalStore, clock: FakeClock
) -> None:
    class Crash(BaseException):
        """Stands in for the process dying: nothing in the engine catches it."""

    ran: list[str] = []
    crash_at = ["two"]

    def step(name: str) -> str:
        if crash_at and crash_at[0] == name:
            crash_at.clear()
            raise Crash
        ran.append(name)
        return name

    @flow
    def pipeline(ctx: Context, _input: Any) -> Any:
        return [ctx.step(n, step, n) for n in ("one", "two", "three")]

    with pytest.raises(Crash):
        Engine(store, [pipeline], clock=clock).start("pipeline", key="p")
    assert ran == ["one"]
    recovered = Engine(store, [pipeline], clock=clock)
    assert recovered.get("p").status is Status.RUNNING
    assert recovered.recover() == ["p"]
    assert recovered.get("p").result == ["one", "two", "three"]
    assert ran == ["one", "two", "three"]


def test_executions_lists_every_run(make_engine: EngineFactory) -> None:
    engine = make_engine([flow(lambda ctx, i: i, name="echo")])
    for n in range(3):
        engine.start("echo", n, key=f"e{n}")
    assert [e.id for e in engine.executions()] == ["e0", "e1", "e2"]


def test_many_steps_replay_linearly(make_engine: EngineFactory) -> None:
    @flow
    def many(ctx: Context, count: int) -> Any:
        total = sum(ctx.step(f"s{i}", lambda i=i: i) for i in range(count))
        ctx.suspend("end")
        return total

    engine = make_engine([many])
    ex = engine.start("many", 2000)
    assert make_engine([many]).resume(ex.id, None).result == sum(range(2000))


def test_recover_and_timers_try_every_run_then_raise_the_first_error(
    store: JournalStore, clock: FakeClock
) -> None:
    @flow(name="nap", version="1")
    def before(ctx: Context, _input: Any) -> str:
        ctx.step("a", lambda: 1)
        ctx.sleep(10)
        return "up"

    @flow(name="nap", version="1")
    def after(ctx: Context, _input: Any) -> str:
        ctx.step("b", lambda: 1)  # diverges from the journal of every run started before
        ctx.sleep(10)
        return "up"

    old = Engine(store, [before], clock=clock)
    old.start("nap", key="broken")
    old.start("nap", key="healthy")
    clock.advance(11)
    mixed = Engine(store, [after], clock=clock)
    with pytest.raises(NonDeterminismError):
        mixed.fire_due_timers()
    # both runs were tried, and neither was moved: nothing journaled, timers kept
    assert {e.id: e.status for e in mixed.executions()} == {
        "broken": Status.SUSPENDED,
        "healthy": Status.SUSPENDED,
    }
    with pytest.raises(NonDeterminismError):
        mixed.fire_due_timers()  # the hints stay until code that replays takes them
    fixed = Engine(store, [before], clock=clock)
    assert sorted(fixed.fire_due_timers()) == ["broken", "healthy"]
    assert {e.id: e.status for e in fixed.executions()} == {
        "broken": Status.COMPLETED,
        "healthy": Status.COMPLETED,
    }


def test_resuming_a_run_whose_flow_this_engine_lacks_names_the_flow_and_changes_nothing(
    make_engine: EngineFactory, store: JournalStore
) -> None:
    make_engine([flow(lambda ctx, _i: ctx.suspend("g"), name="gate")]).start("gate", key="r")
    journal = store.read("ex/r")
    other = make_engine([flow(lambda ctx, _i: 1, name="other")])
    with pytest.raises(UnknownFlowError, match=r"no flow named 'gate'.*registered: other"):
        other.resume("r", 1)
    assert store.read("ex/r") == journal


def test_a_flow_whose_source_cannot_be_read_is_hashed_by_its_bytecode() -> None:
    def first(ctx: Any, value: Any) -> Any:
        return value

    def second(ctx: Any, value: Any) -> Any:
        return [value, value]

    for fn in (first, second):
        fn.__code__ = fn.__code__.replace(co_filename="<built at run time>")
    assert code_hash(first).startswith("sha256:")
    assert code_hash(first) == code_hash(first), "the same code, the same hash"
    assert code_hash(first) != code_hash(second), "other code, another hash"
