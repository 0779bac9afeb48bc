"""Run chains on one engine: a rotation starts one successor with its carry; what is
sent to the chain by its name reaches the run current when it reads it, once, in send
order per topic, unread messages handed on; keys dedupe across the whole chain; gates
are re-established from carry-forward; the lineage is read from the journals; misuse
is refused."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from chain_helpers import FLOWS, receipts
from loom_kernel import (
    AsyncContext,
    Context,
    Engine,
    InvalidArgumentError,
    InvalidIdError,
    MemoryStore,
    Status,
    flow,
)
from loom_kernel.spi import TrimmedError
from loom_kernel.testing import FakeClock
from loom_orchestration import (
    ROTATED,
    ChainEndedError,
    ChainNotFoundError,
    Suspension,
    chain_runs,
    current_run,
    reestablish,
    resume_chain,
    rotate,
    send_to_chain,
    start_chain,
)


def _engine(**options: Any) -> Engine:
    return Engine(MemoryStore(), FLOWS, **options)


def test_a_chain_rotates_with_its_carry_and_its_lineage_is_read_from_the_journals() -> None:
    e = _engine()
    first = start_chain(e, "s", "chain.pairs", {"limit": 6, "got": []})
    assert (first.id, first.status) == ("s@1", Status.SUSPENDED)
    assert start_chain(e, "s", "chain.pairs", {"limit": 99, "got": []}).input == first.input
    for number in range(6):
        send_to_chain(e, "s", f"m{number}", topic="a")
    runs = chain_runs(e, "s")
    assert [run.id for run in runs] == ["s@1", "s@2", "s@3"]
    assert [run.result for run in runs[:2]] == [{ROTATED: "s@2"}, {ROTATED: "s@3"}]
    assert runs[2].result == [f"m{n}" for n in range(6)]
    assert runs[1].input["carry"] == {"limit": 6, "got": ["m0", "m1"]}
    assert current_run(e, "s").id == "s@3"
    with pytest.raises(ChainEndedError, match="its last run s@3 is completed") as ended:
        send_to_chain(e, "s", "late", topic="a")
    assert ended.value.position is None, "nothing was appended"
    assert pickle.loads(pickle.dumps(ended.value)).execution_id == "s@3"


def test_messages_a_run_did_not_read_go_to_its_successor_in_send_order_per_topic() -> None:
    e = _engine()
    start_chain(e, "m", "chain.mixed", {"per_run": 2})
    sent = [("b", "b0"), ("b", "b1"), ("a", "a0"), ("b", "b2"), ("a", "a1"), ("a", "a2")]
    positions = [send_to_chain(e, "m", value, topic=topic) for topic, value in sent]
    got = receipts(e, "m")
    assert sorted(position for _run, position in got) == positions, "each received once"
    for topic in "ab":
        mine = [p for p, (t, _v) in zip(positions, sent, strict=True) if t == topic]
        assert [p for _run, p in got if p in mine] == mine, f"topic {topic} in send order"
    assert len({run for run, _p in got}) == 3, "two a run, over three runs"


def test_runs_whose_inboxes_are_compacted_still_receive_each_message_once() -> None:
    """Each run is forwarded 100 messages, so its inbox is compacted as it reads them:
    every message is still received once, in send order, and none is forwarded
    again to the run after it."""
    e = _engine()
    start_chain(e, "big", "chain.mixed", {"per_run": 100})
    positions = [send_to_chain(e, "big", f"m{n}", topic="a") for n in range(250)]
    got = receipts(e, "big")
    assert [position for _run, position in got] == positions, "each once, in send order"
    assert [run.id for run in chain_runs(e, "big")] == ["big@1", "big@2", "big@3"]
    with pytest.raises(TrimmedError):  # compacted as it was read
        e.store.read("inbox/big@1", 0)


def test_what_a_run_left_unread_reaches_its_successor_in_the_call_that_rotated_it() -> None:
    e = _engine()
    start_chain(e, "u", "chain.pairs", {"limit": 99, "got": []})
    send_to_chain(e, "u", "never read by run 1", topic="b", key="b0")
    send_to_chain(e, "u", "a0", topic="a")
    send_to_chain(e, "u", "a1", topic="a")  # run 1 rotates in this call
    assert current_run(e, "u").id == "u@2"
    held = [(m.key, m.message) for m in e.inbox("u@2")]
    assert held == [("chain:1", "never read by run 1")], "forwarded, with no further send"


def test_a_key_is_deduplicated_across_the_whole_chain() -> None:
    e = _engine()
    start_chain(e, "k", "chain.pairs", {"limit": 4, "got": []})
    assert send_to_chain(e, "k", "x", topic="a", key="once") == 1
    send_to_chain(e, "k", "y", topic="a")
    assert current_run(e, "k").id == "k@2"
    assert send_to_chain(e, "k", "x again", topic="a", key="once") == 1, "a resend: a no-op"
    send_to_chain(e, "k", "z", topic="a")
    send_to_chain(e, "k", "w", topic="a")
    assert current_run(e, "k").result == ["x", "y", "z", "w"]


def test_a_gate_is_re_established_by_the_successor_and_a_chain_resume_reaches_it() -> None:
    clock = FakeClock(1000.0)
    e = _engine(clock=clock)
    start_chain(e, "g", "chain.gated", {"deadline": 1600.0})
    successor = current_run(e, "g")
    assert (successor.id, successor.status) == ("g@2", Status.SUSPENDED)
    assert successor.wake_at == pytest.approx(1600.0), "the same absolute deadline"
    assert resume_chain(e, "g", "yes", on="approve", key="r1") == 1
    assert current_run(e, "g").result == {"kind": "gate", "name": "approve", "value": "yes"}
    assert resume_chain(e, "g", "again", on="approve", key="r1") == 1, "a resend"

    start_chain(e, "late", "chain.gated", {"deadline": 1300.0})
    clock.advance(301)
    e.fire_due_timers()
    assert current_run(e, "late").result == {"kind": "timeout", "name": None, "value": None}


def test_a_gate_without_a_deadline_is_handed_on_and_a_bad_deadline_fails_the_rotation() -> None:
    e = _engine()
    start_chain(e, "open", "chain.gated", {"deadline": None})
    successor = current_run(e, "open")
    assert (successor.id, successor.status, successor.wake_at) == (
        "open@2",
        Status.SUSPENDED,
        None,
    ), "parked at the gate with no timer"
    resume_chain(e, "open", "yes", on="approve")
    assert current_run(e, "open").result == {"kind": "gate", "name": "approve", "value": "yes"}
    for number, deadline in enumerate(["soon", True, [1600.0]]):
        start_chain(e, f"bad{number}", "chain.gated", {"deadline": deadline})
        (run,) = chain_runs(e, f"bad{number}")
        assert run.status is Status.FAILED, deadline
        assert run.error is not None
        assert "a suspension's deadline is Unix seconds or None" in run.error.message


def test_a_chain_resume_waits_for_a_run_parked_at_its_gate() -> None:
    e = _engine()
    start_chain(e, "w", "chain.relay")
    position = resume_chain(e, "w", "early", on="nowhere")
    assert position == 1, "kept in the chain's inbox until a run parks at that gate"
    send_to_chain(e, "w", "go", topic="go")
    assert current_run(e, "w").id == "w@2"


def test_misuse_is_refused_and_writes_nothing() -> None:
    e = _engine()
    with pytest.raises(ChainNotFoundError, match="start it with start_chain"):
        send_to_chain(e, "nobody", "x")
    with pytest.raises(ChainNotFoundError):
        current_run(e, "nobody")
    assert chain_runs(e, "nobody") == []
    for bad in ("a@b", "", "x/", 3, "n" * 200):
        with pytest.raises(InvalidIdError):
            start_chain(e, bad, "chain.pairs")  # type: ignore[arg-type]
    start_chain(e, "c", "chain.relay")
    head = e.store.head("chain-inbox/c")
    for kwargs in ({"topic": ""}, {"key": ""}, {"key": 5}, {"topic": 3}):
        with pytest.raises(InvalidArgumentError):
            send_to_chain(e, "c", "x", **kwargs)
    with pytest.raises(InvalidArgumentError):
        send_to_chain(e, "c", {1: "x"})
    with pytest.raises(InvalidArgumentError):
        resume_chain(e, "c", "x", on="")
    assert e.store.head("chain-inbox/c") == head

    @flow(name="plain", version="1")
    def plain(ctx: Context, _input: Any) -> Any:
        return rotate(ctx, None)

    e.register(plain)
    run = e.start("plain", key="plain-1")
    assert run.status is Status.FAILED
    assert run.error is not None
    assert "rotate is for a chain's run" in run.error.message


@flow(name="chain.async", version="1")
async def async_link(ctx: AsyncContext, run: dict[str, Any]) -> Any:
    if run["n"] > 1:
        woken = await reestablish(ctx, run)  # type: ignore[misc]
        assert woken is not None
        if woken.kind == "gate":
            return woken.value
    got = await ctx.receive("a")
    suspensions = [Suspension("approve", ctx.now() + 60)]
    return await rotate(ctx, {"got": got}, suspensions=suspensions)


def test_an_async_flow_rotates_and_re_establishes_with_awaits() -> None:
    clock = FakeClock(1000.0)
    e = Engine(MemoryStore(), [async_link], clock=clock)
    start_chain(e, "as", "chain.async")
    send_to_chain(e, "as", "one", topic="a")
    second = current_run(e, "as")
    assert second.id == "as@2"
    assert second.wake_at == pytest.approx(1060.0)
    assert second.input["carry"] == {"got": "one"}
    resume_chain(e, "as", "approved", on="approve")
    assert current_run(e, "as").result == "approved"


def test_finding_the_current_run_again_reads_two_heads() -> None:
    """Routing by a chain's name remembers the newest run it found: finding it again
    reads two heads (that run's, and its would-be successor's), however long the
    chain grew."""
    from loom_orchestration._chains._routing import current

    store = MemoryStore()
    e = Engine(store, FLOWS)
    start_chain(e, "h", "chain.pairs", {"limit": 6, "got": []})
    for number in range(4):
        send_to_chain(e, "h", f"m{number}", topic="a")
    assert current(e, "h") == 3
    heads: list[str] = []
    head = store.head

    def counted(stream: str) -> int:
        heads.append(stream)
        return head(stream)

    store.head = counted  # type: ignore[method-assign]
    assert current(e, "h") == 3
    assert heads == ["ex/h@3", "ex/h@4"]
