"""The engine: a step runs once and replays after; retries, failures a flow may catch
and failures that end the run, replayed alike; results converted or refused before
they are journaled; cancels and crashes; bad input and misuse lose nothing; and what
each drive held is let go once it ends."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from engine_helpers import EngineFactory, _journal
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
    flow,
)
from loom_kernel._engine import parts_of
from loom_kernel._replay import drive_here
from loom_kernel.spi import InvalidArgumentError, InvalidIdError, JournalStore
from loom_kernel.testing import FakeClock


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


def test_many_steps_replay_linearly(make_engine: EngineFactory) -> None:
    @flow
    def many(ctx: Context, count: int) -> Any:
        total = sum(ctx.step(f"s{i}", lambda i=i: i) for i in range(count))
        ctx.suspend("end")
        return total

    engine = make_engine([many])
    ex = engine.start("many", 2000)
    assert make_engine([many]).resume(ex.id, None).result == sum(range(2000))


def test_executions_lists_every_run(make_engine: EngineFactory) -> None:
    engine = make_engine([flow(lambda ctx, i: i, name="echo")])
    for n in range(3):
        engine.start("echo", n, key=f"e{n}")
    assert [e.id for e in engine.executions()] == ["e0", "e1", "e2"]


@pytest.mark.usefixtures("flow_loop")
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


# -- retries and failures --------------------------------------------------------------


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

    engine = make_engine([job])
    engine.sleep = waits.append  # set after construction: the next drives wait with it
    ex = engine.start("job")
    assert ex.result == "ok"
    assert waits == [2.0, 6.0]
    assert engine.state(ex.id).steps[0].attempts == 3


def test_the_default_retry_policy_set_after_construction_is_the_next_drives_own(
    make_engine: EngineFactory,
) -> None:
    attempts: list[int] = []

    def never() -> None:
        attempts.append(1)
        raise ConnectionError("down")

    @flow
    def stubborn(ctx: Context, _input: Any) -> Any:
        return ctx.step("never", never)

    engine = make_engine([stubborn])
    engine.retry = RetryPolicy(attempts=7, backoff=0)
    assert engine.retry.attempts == 7
    assert engine.start("stubborn").status is Status.FAILED
    assert len(attempts) == 7
    with pytest.raises(InvalidArgumentError, match="retry is a RetryPolicy"):
        engine.retry = 3  # type: ignore[assignment]


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


# -- results ---------------------------------------------------------------------------


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
def test_a_step_result_that_is_not_json_fails_the_step_once_journaled(
    make_engine: EngineFactory, store: JournalStore, value: Any
) -> None:
    """A result with no JSON form used to stop the drive with the run left running:
    every later drive ran the step's effect again and met the same refusal. The step
    fails instead, journaled, not retried; the flow may catch it."""
    effects: list[str] = []

    def produce() -> Any:
        effects.append("ran")
        return value

    @flow
    def bad(ctx: Context, _input: Any) -> Any:
        ctx.step("ok", lambda: 1)
        return ctx.step("bad", produce)

    @flow
    def careful(ctx: Context, _input: Any) -> Any:
        try:
            return ctx.step("bad", produce)
        except StepFailedError as exc:
            return [exc.error_type, exc.attempts]

    engine = make_engine([bad, careful])
    run = engine.start("bad", key="bad-1")
    assert run.status is Status.FAILED
    assert run.error is not None
    assert "result of step 'bad' is not JSON" in run.error.message
    kinds = [kind for _, kind, _ in _journal(store, "bad-1")]
    assert kinds == ["EXECUTION_STARTED", "STEP_COMPLETED", "STEP_FAILED", "EXECUTION_FAILED"]
    assert effects == ["ran"], "once: no retry could journal it"
    assert engine.start("careful", key="careful-1").result == [
        "loom_kernel.InvalidArgumentError",
        1,
    ]
    with pytest.raises(InvalidArgumentError, match="not JSON"):
        engine.start("bad", value, key="bad-2")  # a flow's input is refused at the call
    assert store.head(engine.stream_of("bad-2")) == 0


# -- misuse and bad input --------------------------------------------------------------


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


# -- cancels and crashes ---------------------------------------------------------------


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


def test_recover_with_an_id_drives_that_run_only(store: JournalStore, clock: FakeClock) -> None:
    @flow
    def two_steps(ctx: Context, _input: Any) -> Any:
        return [ctx.step("a", lambda: "a"), ctx.step("b", lambda: "b")]

    web = Engine(store, [], listeners=[], clock=clock)
    for key in ("x", "y"):
        web.dispatch("two_steps", key=key)  # no code here: journaled, not driven
    worker = Engine(store, [two_steps], clock=clock)
    assert worker.recover("x") == ["x"]
    assert worker.get("x").result == ["a", "b"]
    assert worker.get("y").status is Status.RUNNING, "the other is left alone"
    assert worker.recover("x") == [], "nothing left to drive"
    with pytest.raises(ExecutionNotFoundError):
        worker.recover("nobody")


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
