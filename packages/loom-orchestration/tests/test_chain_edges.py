"""Chains at their edges (each found by an adversarial review): a bad topic or an item
too big for a run's inbox is refused writing nothing; a chain that rotates without
parking runs a run after a run, not one inside another; a backlog of hundreds of
rotations is delivered in one call; a resume refused earlier in a delivery is tried
again once the run parks at its gate; a look that catches a run as it rotates looks
again; racing resends of a key get the first position; a run named like the chain's
but started by hand is not routed to; a second rotate is refused."""

from __future__ import annotations

import random
from typing import Any

import pytest
from chain_helpers import FLOWS, receipts
from loom_kernel import (
    Context,
    Engine,
    InvalidArgumentError,
    MemoryStore,
    SchemaError,
    Status,
    flow,
)
from loom_kernel.testing import Interleaving
from loom_orchestration import (
    chain_runs,
    current_run,
    resume_chain,
    rotate,
    send_to_chain,
    start_chain,
)
from loom_orchestration._chains import _api


@flow(name="chain.pages", version="1")
def pages(ctx: Context, run: dict[str, Any]) -> Any:
    """A page of ten steps a run, then the next page, until `last`: continue-as-new
    with no wait in between."""
    page = run["carry"]["page"]
    total = sum(ctx.step(f"row{row}", lambda row=row: page * 10 + row) for row in range(10))
    if page == run["carry"]["last"]:
        return total
    return rotate(ctx, {"page": page + 1, "last": run["carry"]["last"]})


@flow(name="chain.twice", version="1")
def twice(ctx: Context, run: dict[str, Any]) -> Any:
    rotate(ctx, "first")
    return rotate(ctx, "second")


@flow(name="chain.gate_then_rotate", version="1")
def gate_then_rotate(ctx: Context, run: dict[str, Any]) -> Any:
    ctx.receive("go")
    return ctx.suspend("approve")


def _engine(store: Any = None) -> Engine:
    return Engine(store or MemoryStore(), [*FLOWS, pages, twice, gate_then_rotate])


class Small(MemoryStore):
    max_record_bytes = 400


def test_a_bad_topic_or_an_item_too_big_to_forward_is_refused_writing_nothing() -> None:
    e = Engine(Small(), FLOWS)
    start_chain(e, "c", "chain.pairs", {"limit": 4, "got": []})
    for topic in ("t" * 201, "\ud800", ""):
        with pytest.raises(InvalidArgumentError, match="at most 200 characters"):
            send_to_chain(e, "c", "x", topic=topic)
    with pytest.raises(InvalidArgumentError, match="at most 200 characters"):
        resume_chain(e, "c", "x", on="g" * 300)
    # 150 characters of UTF-8 fit a 400-byte record; escaped as the kernel writes, not.
    with pytest.raises(InvalidArgumentError, match="over the store's limit"):
        send_to_chain(e, "c", "é" * 150, topic="a")
    assert e.store.head("chain-inbox/c") == 0, "nothing written"
    send_to_chain(e, "c", "fine", topic="a")
    send_to_chain(e, "c", "also", topic="a")
    assert current_run(e, "c").id == "c@2", "the chain was not held up"


def test_a_chain_that_rotates_without_parking_is_not_a_stack_of_frames() -> None:
    e = _engine()
    last = start_chain(e, "p", "chain.pages", {"page": 0, "last": 299})
    assert last.id == "p@1"
    newest = current_run(e, "p")
    assert newest.id == "p@300"
    assert newest.result == sum(2990 + row for row in range(10))
    assert all(run.status is Status.COMPLETED for run in chain_runs(e, "p"))


def test_a_backlog_of_hundreds_of_rotations_is_delivered_in_one_call() -> None:
    store = MemoryStore()
    web = Engine(store, [], listeners=[])  # no flow code: forwards, drives nothing
    worker = _engine(store)
    start_chain(worker, "b", "chain.pairs", {"limit": 400, "got": []})
    for number in range(260):
        send_to_chain(web, "b", number, topic="a")
    worker.recover()
    assert current_run(worker, "b").id == "b@131"
    assert sorted(p for _run, p in receipts(worker, "b")) == list(range(1, 261))


def test_a_resume_refused_earlier_in_a_delivery_reaches_the_gate_the_run_parks_at() -> None:
    e = _engine()
    start_chain(e, "r", "chain.gate_then_rotate")
    resume_chain(e, "r", "approved", on="approve")  # not parked there yet: kept
    send_to_chain(e, "r", "go", topic="go")  # the run parks at "approve" in this call
    assert e.get("r@1").result == "approved"


def test_a_run_caught_as_it_rotates_is_looked_for_again(monkeypatch: pytest.MonkeyPatch) -> None:
    e = _engine()
    start_chain(e, "s", "chain.pairs", {"limit": 9, "got": []})
    send_to_chain(e, "s", "a", topic="a")
    send_to_chain(e, "s", "b", topic="a")
    assert current_run(e, "s").id == "s@2"
    stale = [1]
    real = _api.current  # type: ignore[attr-defined]

    def first_stale(engine: Engine, chain: str) -> int | None:
        return stale.pop() if stale else real(engine, chain)

    monkeypatch.setattr(_api, "current", first_stale)
    assert send_to_chain(e, "s", "c", topic="a") == 3, "not ChainEndedError for s@1"


def test_racing_resends_of_a_key_get_the_first_position() -> None:
    for seed in range(40):
        assert _race_two_resends(seed) == {"one": 1, "two": 1}, seed


def _race_two_resends(seed: int) -> dict[str, Any]:
    chance = random.Random(seed)
    store = Interleaving(MemoryStore())
    start_chain(_engine(store.inner), "k", "chain.relay")
    return store.run(
        {
            "one": lambda: send_to_chain(_engine(store), "k", "x", topic="sig", key="K"),
            "two": lambda: send_to_chain(_engine(store), "k", "x", topic="sig", key="K"),
        },
        choose=lambda names: chance.choice(sorted(names)),
    )


def test_a_run_named_like_the_chains_but_started_by_hand_is_not_routed_to() -> None:
    e = _engine()
    start_chain(e, "h", "chain.pairs", {"limit": 9, "got": []})
    e.start("chain.relay", {"not": "a chain run"}, key="h@5")
    assert current_run(e, "h").id == "h@1"
    send_to_chain(e, "h", "a", topic="a")
    send_to_chain(e, "h", "b", topic="a")
    send_to_chain(e, "h", "c", topic="a")
    assert current_run(e, "h").id == "h@2"
    assert [m.message for m in e.inbox("h@2")] == ["c"]


def test_a_run_started_by_hand_under_the_next_number_is_not_listed_as_the_chains() -> None:
    e = _engine()
    start_chain(e, "n", "chain.pairs", {"limit": 9, "got": []})
    e.start("chain.relay", {"not": "a chain run"}, key="n@2")
    assert [run.id for run in chain_runs(e, "n")] == ["n@1"]
    assert current_run(e, "n").id == "n@1"


def test_a_second_rotate_in_one_run_fails_the_run() -> None:
    e = _engine()
    run = start_chain(e, "t", "chain.twice")
    assert run.status is Status.FAILED
    assert run.error is not None
    assert "rotated already" in run.error.message


@pytest.mark.parametrize(
    "payload",
    [b"{not json", b'{"kind": "message"}', b'{"kind": "gift", "name": null, "key": null}'],
)
def test_a_damaged_chain_inbox_item_is_a_schema_error_naming_where(payload: bytes) -> None:
    from loom_kernel.spi import Record
    from loom_orchestration._chains._inbox import KIND, _decode

    with pytest.raises(SchemaError, match="a damaged chain inbox item") as caught:
        _decode(Record(3, KIND, payload, 1.0), "chain-inbox/c")
    assert (caught.value.stream, caught.value.position) == ("chain-inbox/c", 3)


def test_a_chain_inbox_record_of_another_kind_is_a_schema_error_however_it_reads() -> None:
    from loom_kernel.spi import Record
    from loom_orchestration._chains._inbox import _decode

    payload = b'{"kind": "message", "name": null, "key": null, "value": 1}'
    with pytest.raises(SchemaError, match=r"unknown kind 'loom\.other'") as caught:
        _decode(Record(4, "loom.other", payload, 1.0), "chain-inbox/c")
    assert (caught.value.kind, caught.value.position) == ("loom.other", 4)
