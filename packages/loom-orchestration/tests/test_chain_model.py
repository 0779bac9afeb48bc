"""A model of a chain under keyed sends, rotations, deaths at any store call and
recoveries (hypothesis picks them): every item sent is received exactly once, per
topic in send order, and a resend of a key is never received again."""

from __future__ import annotations

import contextlib
from typing import Any

from chain_helpers import FLOWS, receipts
from dying_store import Crash, DyingStore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel import Engine, MemoryStore
from loom_kernel.spi import JournalStore
from loom_kernel.testing import FakeClock
from loom_orchestration import chain_runs, send_to_chain, start_chain
from loom_orchestration._chains._inbox import items

_sends = st.tuples(st.just("send"), st.sampled_from(["a", "b"]), st.integers(0, 12))
_deaths = st.tuples(st.just("die"), st.integers(1, 60), st.booleans())


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
)
@given(operations=st.lists(st.one_of(_sends, _deaths), min_size=1, max_size=24))
def test_every_item_is_received_once_in_send_order_per_topic(
    operations: list[tuple[Any, ...]],
) -> None:
    clock = FakeClock(1000.0)
    store = MemoryStore()
    start_chain(
        Engine(store, FLOWS, clock=clock, worker_id="w0"), "h", "chain.mixed", {"per_run": 2}
    )
    death: tuple[int, bool] | None = None
    crashed: list[tuple[str, str]] = []
    rescues = 0

    def rescue() -> None:
        nonlocal rescues
        rescues += 1
        clock.advance(3600)  # every lease lapses
        Engine(store, FLOWS, clock=clock, worker_id=f"rescuer{rescues}").recover()

    for number, operation in enumerate(operations):
        if operation[0] == "die":
            death = operation[1], operation[2]
            continue
        _send, topic, key_number = operation
        key = f"k{key_number}"
        target: JournalStore = store
        if death is not None:
            target = DyingStore(store, death[0], after=death[1], as_it_dies=lambda: None)
            death = None
        engine = Engine(target, FLOWS, clock=clock, worker_id=f"w{number + 1}")
        try:
            send_to_chain(engine, "h", key, topic=topic, key=key)
        except Crash:
            crashed.append((topic, key))
            rescue()
    rescue()
    final = Engine(store, FLOWS, clock=clock, worker_id="final")
    for topic, key in crashed:  # the senders retry, with their keys
        with contextlib.suppress(Crash):
            send_to_chain(final, "h", key, topic=topic, key=key)
    final.recover()

    sent = items(store, "h")
    assert len({item.key for item in sent}) == len(sent), "one item a key"
    got = receipts(final, "h")
    assert sorted(position for _run, position in got) == [item.position for item in sent], (
        "every item received, each once"
    )
    topic_of = {item.position: item.name for item in sent}
    for topic in "ab":
        order = [position for _run, position in got if topic_of[position] == topic]
        assert order == sorted(order), f"topic {topic} in send order"
    runs = chain_runs(final, "h")
    assert [run.id for run in runs] == [f"h@{n}" for n in range(1, len(runs) + 1)]
    assert [run.id for run in runs if not run.status.finished] == [runs[-1].id], "one live run"
    assert len(runs) == len(sent) // 2 + 1, "a rotation every two items"
