"""Misuse is refused at the call with the kernel's own error, and journals nothing: a
flow that swallows its park or its stop stays where it was, and a coroutine it never
awaits is closed, not left to warn."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from loom_kernel import AsyncContext, Context, Engine, MemoryStore, Queue, RetryPolicy, Status, flow
from loom_kernel.spi import InvalidArgumentError, NewRecord, StoreUnavailableError
from loom_kernel.testing import FakeClock, sandbox

#: Each test runs with a loop per drive and on one loop of another thread.
pytestmark = pytest.mark.usefixtures("flow_loop")

INSIDE_A_STEP: dict[str, Callable[[Any], Any]] = {
    "step": lambda ctx: ctx.step("inner", lambda: 1),
    "now": lambda ctx: ctx.now(),
    "random": lambda ctx: ctx.random(),
    "uuid": lambda ctx: ctx.uuid(),
    "suspend": lambda ctx: ctx.suspend("gate"),
    "sleep": lambda ctx: ctx.sleep(5),
}


@pytest.mark.parametrize("call", sorted(INSIDE_A_STEP))
def test_a_ctx_call_inside_a_step_function_is_refused(call: str) -> None:
    @flow
    def nested(ctx: Context, _input: Any) -> Any:
        return ctx.step("outer", lambda: INSIDE_A_STEP[call](ctx))

    store = MemoryStore()
    engine = Engine(store, [nested], retry=RetryPolicy(attempts=3, backoff=0), listeners=[])
    inside = "inside the function of step 'outer'"
    with pytest.raises(InvalidArgumentError, match=inside) as refused:
        engine.start("nested", key="n")
    assert [r.kind for r in store.read("ex/n")] == ["EXECUTION_STARTED"], "nothing journaled"
    named = {"suspend": "ctx.suspend('gate')", "sleep": "ctx.sleep", "step": "ctx.step('inner')"}
    if call in named:
        assert str(refused.value).startswith(f"{named[call]} was called inside"), refused.value
    assert store.streams("timers/") == []


def test_a_refused_ctx_call_inside_a_step_is_not_an_exception_the_flow_can_catch() -> None:
    caught: list[str] = []

    @flow
    def catching(ctx: Context, _input: Any) -> Any:
        try:
            ctx.step("outer", lambda: ctx.step("inner", lambda: 1))
        except Exception as exc:  # the refusal is a stop, not an error of the flow's
            caught.append(type(exc).__name__)
        return "went on"

    engine = Engine(MemoryStore(), [catching], listeners=[])
    with pytest.raises(InvalidArgumentError, match="inside the function of step 'outer'"):
        engine.start("catching", key="c")
    assert caught == []


@pytest.mark.parametrize("call", ["suspend", "receive", "wait_first"])
@pytest.mark.parametrize("timeout", ["soon", float("nan"), 1e200, True])
def test_a_gate_timeout_that_cannot_be_a_timer_is_refused_at_the_call(
    call: str, timeout: Any
) -> None:
    @flow
    def waiter(ctx: Context, _input: Any) -> Any:
        if call == "suspend":
            return ctx.suspend("gate", timeout=timeout)
        if call == "receive":
            return ctx.receive(timeout=timeout)
        return ctx.wait_first(["gate"], timeout=timeout)

    store = MemoryStore()
    engine = Engine(store, [waiter], clock=FakeClock(), listeners=[])
    with pytest.raises(InvalidArgumentError, match=r"a timeout (takes a finite number|is at most)"):
        engine.start("waiter", key="w")
    assert [r.kind for r in store.read("ex/w")] == ["EXECUTION_STARTED"], "it did not park"
    assert store.streams("timers/") == []


def test_a_ctx_call_inside_an_async_step_is_refused_but_gathered_steps_are_not() -> None:
    @flow
    async def gathered(ctx: AsyncContext, _input: Any) -> Any:
        async def slow(value: int) -> int:
            await asyncio.sleep(0.01)
            return value

        return await asyncio.gather(ctx.step("a", slow, 1), ctx.step("b", slow, 2))

    @flow
    async def nested(ctx: AsyncContext, _input: Any) -> Any:
        async def outer() -> Any:
            return await ctx.step("inner", lambda: 1)

        return await ctx.step("outer", outer)

    engine = Engine(MemoryStore(), [gathered, nested], listeners=[])
    assert engine.start("gathered").result == [1, 2]
    with pytest.raises(InvalidArgumentError, match="inside the function of step 'outer'"):
        engine.start("nested")


def test_starting_another_flow_from_a_step_is_allowed() -> None:
    @flow
    def child(ctx: Context, value: int) -> Any:
        return ctx.step("double", lambda: value * 2)

    @flow
    def parent(ctx: Context, _input: Any) -> Any:
        return ctx.step("start", lambda: ctx.engine.start("child", 21).result)

    assert Engine(MemoryStore(), [parent, child], listeners=[]).start("parent").result == 42


def test_a_huge_retry_policy_waits_at_most_its_cap_and_never_overflows() -> None:
    policy = RetryPolicy(attempts=5000, factor=2, max_backoff=60)
    assert [policy.delay(n) for n in (1, 2, 7, 1025, 5000, 10**9)] == [1, 2, 60, 60, 60, 60]
    small = RetryPolicy(attempts=4, backoff=0.25, factor=2, max_backoff=1)
    assert [small.delay(n) for n in (1, 2, 3, 4)] == [0.25, 0.5, 1, 1]
    assert RetryPolicy(attempts=2, backoff=1, max_backoff=0).delay(1) == 0, "a cap of 0"
    failures = {"left": 1100}

    def flaky() -> str:
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("try again")
        return "through"

    @flow
    def persistent(ctx: Context, _input: Any) -> Any:
        return ctx.step("call", flaky, retry=policy)

    waited: list[float] = []
    engine = Engine(MemoryStore(), [persistent], sleep=waited.append, listeners=[])
    done = engine.start("persistent")
    assert done.status is Status.COMPLETED
    assert engine.frames(done.id)[0].attempts == 1101
    assert max(waited) == 60


@given(
    backoff=st.floats(0, 1e6),
    factor=st.floats(1, 1e6),
    cap=st.floats(0, 1e9),
    attempt=st.integers(1, 10**12),
)
def test_retry_delays_are_finite_capped_and_never_shrink(
    backoff: float, factor: float, cap: float, attempt: int
) -> None:
    policy = RetryPolicy(attempts=2, backoff=backoff, factor=factor, max_backoff=cap)
    delay = policy.delay(attempt)
    assert math.isfinite(delay)
    assert 0 <= delay <= cap
    assert policy.delay(attempt + 1) >= delay


@pytest.mark.parametrize(
    "bad",
    [
        {"attempts": 0},
        {"attempts": 2.5},
        {"backoff": float("nan")},
        {"factor": float("inf")},
        {"factor": 0.5},
        {"max_backoff": -1},
        {"retry_on": (int,)},
        {"factor": 10**400},
        {"backoff": 10**400},
        {"max_backoff": 10**400},
    ],
)
def test_a_malformed_retry_policy_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        RetryPolicy(**bad)


@pytest.mark.parametrize(
    "duration",
    [1e200, float("inf"), float("nan"), 10**30, -(10**400), timedelta.max, "5", None, True],
)
def test_a_sleep_that_cannot_be_a_timer_is_refused_at_the_call(duration: Any) -> None:
    @flow
    def sleeper(ctx: Context, _input: Any) -> str:
        ctx.sleep(duration)
        return "woke"

    store = MemoryStore()
    engine = Engine(store, [sleeper], clock=FakeClock(), listeners=[])
    with pytest.raises(InvalidArgumentError, match="sleep"):
        engine.start("sleeper", key="s")
    assert [r.kind for r in store.read("ex/s")] == ["EXECUTION_STARTED"], "the run did not fail"
    assert store.streams("timers/") == []


def test_the_longest_sleep_parks_and_wakes() -> None:
    @flow
    def century(ctx: Context, _input: Any) -> str:
        ctx.sleep(timedelta(days=36_500))
        return "woke"

    clock = FakeClock()
    engine = Engine(MemoryStore(), [century], clock=clock, listeners=[])
    execution = engine.start("century")
    assert execution.status is Status.SUSPENDED
    clock.advance(36_500 * 86_400)
    assert engine.fire_due_timers() == [execution.id]


@pytest.mark.parametrize("timestamp", [float("nan"), float("inf"), -float("inf"), 10**400])
def test_a_record_timestamp_must_be_finite(timestamp: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="finite"):
        NewRecord("k", b"", timestamp)


class FailingTimerStore(MemoryStore):
    """Refuses the first write of a timer hint (a transient fault)."""

    failed = False

    def _append(self, stream: str, expected: int, records: Any) -> int:
        if stream.startswith("timers/") and not self.failed:
            self.failed = True
            raise StoreUnavailableError("injected: the timer index is unreachable")
        return super()._append(stream, expected, records)


def test_a_store_fault_while_a_sleep_parks_stops_the_run_without_failing_it() -> None:
    @flow
    def sleeper(ctx: Context, _input: Any) -> str:
        ctx.sleep(30)
        return "woke"

    store, clock = FailingTimerStore(), FakeClock()
    engine = Engine(store, [sleeper], clock=clock, listeners=[])
    with pytest.raises(StoreUnavailableError):
        engine.start("sleeper", key="s")
    assert engine.get("s").status is Status.RUNNING, "a store fault is not the flow's failure"
    assert engine.recover() == ["s"]
    clock.advance(30)
    assert engine.fire_due_timers() == ["s"]


def test_kernel_errors_cross_a_process_pool_whole() -> None:
    """What a ProcessPoolExecutor does with an error raised in a child process."""
    import pickle

    from loom_kernel import ConflictError, GateTimeoutError, RunFinishedError

    for error in (
        ConflictError("s", 1, 2),
        GateTimeoutError("r", "approve", 5.0),
        RunFinishedError("r", "completed", 3),
    ):
        again = pickle.loads(pickle.dumps(error))
        assert (type(again), str(again), vars(again)) == (type(error), str(error), vars(error))


@pytest.mark.parametrize("thing", [7, "a string"])
def test_flow_refuses_what_is_not_a_function(thing: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="@flow needs a Python function"):
        flow(thing)


@pytest.mark.parametrize("name", ["", "1st", "has space", "x" * 101, "slash/ed", "é"])
def test_flow_refuses_a_name_the_rules_do_not_allow(name: str) -> None:
    with pytest.raises(InvalidArgumentError, match="invalid flow name"):
        flow(name=name)(lambda ctx, _input: None)


@pytest.mark.parametrize("name", ["a", "_x", "orders.v2:charge-1", "x" * 100])
def test_flow_takes_a_name_the_rules_allow(name: str) -> None:
    assert flow(name=name)(lambda ctx, _input: None).name == name


def test_a_queue_has_at_most_256_partitions_and_an_engine_takes_only_queues() -> None:
    assert Queue("q", partitions=256).partitions == 256
    with pytest.raises(InvalidArgumentError, match="partitions is at most 256, not 257"):
        Queue("q", partitions=257)
    with pytest.raises(InvalidArgumentError, match="queues holds Queue objects, not 'q'"):
        Engine(MemoryStore(), [], queues=["q"])  # type: ignore[list-item]


def test_a_run_handle_is_named_by_its_id_and_hashes_as_it() -> None:
    engine = Engine(MemoryStore(), [])
    handle = engine.handle("order-1")
    assert repr(handle) == "RunHandle('order-1')"
    assert handle == engine.handle("order-1") != engine.handle("order-2")
    assert len({handle, engine.handle("order-1"), engine.handle("order-2")}) == 2
    assert hash(handle) == hash("order-1")


def _sample(annotation: str, name: str) -> Any:
    if annotation.startswith("int"):
        return 3
    if annotation.startswith("float"):
        return 1.5
    if annotation.startswith("list"):
        return ["sha256:a", "version:1"]
    return f"{name}-value"


def test_every_error_with_attributes_keeps_each_argument_and_crosses_a_pickle() -> None:
    """Each error of the tree that takes arguments keeps every one under its own name
    (callers read them: `exc.stream`, `exc.after`), and pickles whole."""
    import inspect
    import pickle

    import loom_kernel

    checked = []
    for name in sorted(loom_kernel.__all__):
        cls = getattr(loom_kernel, name)
        if not (inspect.isclass(cls) and issubclass(cls, loom_kernel.LoomError)):
            continue
        if "__init__" not in vars(cls):
            continue
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
        arguments = {p.name: _sample(str(p.annotation), p.name) for p in parameters}
        error = cls(**arguments)
        kept = {key: value for key, value in arguments.items() if key not in ("message", "detail")}
        assert {key: getattr(error, key, "(missing)") for key in kept} == kept, name
        again = pickle.loads(pickle.dumps(error))
        assert (type(again), str(again), vars(again)) == (type(error), str(error), vars(error))
        checked.append(name)
    assert {"TrimmedError", "ResultTimeoutError", "ConflictError"} <= set(checked), checked


class _SaysAscii(str):
    """A str whose own methods claim it is ASCII and encodes, whatever it holds."""

    def isascii(self) -> bool:
        return True

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"charge"


@pytest.mark.parametrize("subclass", [str, _SaysAscii])
@pytest.mark.parametrize("call", ["step", "suspend", "patched"])
def test_a_name_with_no_utf8_form_is_refused_before_anything_runs(
    call: str, subclass: type[str]
) -> None:
    """The journal records names as UTF-8: a lone surrogate would fail the run after
    the step's work was done; it is refused at the call, the journal as it was."""
    ran: list[str] = []

    @flow(name="surrogates")
    def surrogates(ctx: Context, _input: Any) -> Any:
        name = subclass("charge\ud800")
        if call == "step":
            return ctx.step(name, lambda: ran.append(name))
        if call == "suspend":
            return ctx.suspend(name)
        return ctx.patched(name)

    store = MemoryStore()
    engine = Engine(store, [surrogates], listeners=[])
    with pytest.raises(InvalidArgumentError, match="lone surrogate"):
        engine.start("surrogates", key="s")
    assert ran == []
    assert [record.kind for record in store.read("ex/s")] == ["EXECUTION_STARTED"]


# -- a park or a stop the flow swallows ------------------------------------------------


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


@pytest.mark.parametrize("change", ["", 7, None])
def test_a_change_id_must_be_a_non_empty_str(change: Any) -> None:
    @flow(name="patchy", version="1")
    def patchy(ctx: Context, _input: Any) -> Any:
        return ctx.patched(change)

    with pytest.raises(InvalidArgumentError, match="a change id is a non-empty str"):
        sandbox(patchy).engine.start("patchy", key="p")


# -- a coroutine never awaited ---------------------------------------------------------


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


def test_a_step_an_async_flow_never_awaited_is_closed_not_left_to_warn() -> None:

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


@pytest.mark.usefixtures("flow_loop")
def test_an_input_or_a_published_value_with_int_keys_is_refused() -> None:
    """JSON turns `{1: "x"}` into `{"1": "x"}`: refused on every path a caller hands
    the kernel, with nothing journaled past what was already there. A step's result
    is the flow's own: it gets the JSON form back, the same on every replay."""

    @flow(name="int_keys", version="1")
    def int_keys(ctx: Context, where: str) -> Any:
        if where == "event":
            ctx.set_event("e", {3: "z"})
        return ctx.step("s", lambda: {1: "x"} if where == "step" else "fine")

    engine = Engine(MemoryStore(), [int_keys], listeners=[])
    with pytest.raises(InvalidArgumentError, match="the flow input is not JSON: a dict key is 2"):
        engine.start("int_keys", {2: "y"}, key="input")
    assert list(engine.executions()) == []
    with pytest.raises(InvalidArgumentError, match="JSON's keys are str"):
        engine.start("int_keys", "event", key="event")
    assert engine.get("event").status is Status.RUNNING, "refused before its journal moved"
    engine.start("int_keys", "step", key="step")
    assert engine.get("step").result == {"1": "x"}
