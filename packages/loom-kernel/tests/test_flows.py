"""A flow (`_replay/_flows.py`): still the function it decorates, its version a
non-empty str, its code hash pinned at a run's start (from its bytecode where its source
cannot be read), and the retry policy's documented defaults."""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import EngineFactory
from loom_kernel import Context, Status, code_hash, flow
from loom_kernel.spi import InvalidArgumentError
from loom_kernel.testing import sandbox


@pytest.mark.usefixtures("flow_loop")
def test_a_flow_can_still_be_called_as_the_function_it_decorates() -> None:
    @flow(name="plain", version="1")
    def plain(_ctx: Any, number: int) -> int:
        return number * 2

    assert plain(None, 21) == 42


@pytest.mark.usefixtures("flow_loop")
@pytest.mark.parametrize("version", ["", 5, b"1"])
def test_a_flow_version_is_a_non_empty_str(version: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="a flow version is a non-empty str"):
        flow(name="versioned", version=version)(lambda ctx, _input: None)


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


@pytest.mark.usefixtures("flow_loop")
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


@pytest.mark.usefixtures("flow_loop")
def test_retry_none_is_the_engine_default_and_no_retry_is_one_attempt() -> None:
    """`retry=None` read as "no retries" ran a charge three times: `NO_RETRY` says one."""
    from loom_kernel import NO_RETRY, RetryPolicy, StepFailedError

    assert RetryPolicy(attempts=1) == NO_RETRY
    tries: list[str] = []

    def charge(tag: str) -> None:
        tries.append(tag)
        raise RuntimeError("declined")

    @flow(name="charges", version="1")
    def charges(ctx: Context, _input: Any) -> Any:
        outcomes = []
        for tag, policy in (("default", None), ("once", NO_RETRY)):
            try:
                ctx.step(tag, charge, tag, retry=policy)
            except StepFailedError as exc:
                outcomes.append(exc.attempts)
        return outcomes

    box = sandbox(charges)
    assert box.engine.start("charges").result == [3, 1]
    assert tries == ["default"] * 3 + ["once"]
