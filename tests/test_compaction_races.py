"""Engines compacting one run at once, on every store: no load ever finds a hole.

Each example runs a driver (resuming the run, so its journal grows), two engines
compacting it and a reader, one store call at a time in an order hypothesis picks.
Afterwards a fresh engine must load the run and finish it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_kernel import Context, Engine, Status, flow
from loom_kernel.spi import JournalStore
from loom_kernel.testing import Interleaving
from store_kinds import StoreFactory, store_maker

STEPS = 5
EXAMPLES = {"moto": 12, "rgw": 12}  # a second or more an example on S3


@flow
def ledger(ctx: Context, _input: Any) -> Any:
    total = 0
    for index in range(STEPS):
        total += ctx.step(f"add{index}", lambda index=index: index)
        ctx.suspend(f"next{index}")
    return total


@pytest.fixture(params=["memory", "sqlite", "moto", "rgw"])
def new_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    opened: list[JournalStore] = []
    yield store_maker(request, tmp_path, request.param, opened)
    for store in opened:
        store.close()


def _engine(store: JournalStore) -> Engine:
    return Engine(store, [ledger], listeners=[])


def test_racing_compactions_never_lose_the_journal(new_store: StoreFactory) -> None:
    @settings(
        max_examples=EXAMPLES.get(getattr(new_store, "kind", ""), 30),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(data=st.data(), resumed=st.integers(0, STEPS - 3))
    def race(data: st.DataObject, resumed: int) -> None:
        racing = Interleaving(new_store())
        execution = _engine(racing).start("ledger")
        for index in range(resumed):
            _engine(racing).resume(execution.id, index)
        compacting = [_engine(racing), _engine(racing)]
        for engine in compacting:
            engine.get(
                execution.id
            )  # each holds the run in its cache, as a long-lived engine would

        def drive() -> None:
            driver = _engine(racing)
            for index in range(resumed, resumed + 2):
                driver.resume(execution.id, index)

        outcome = racing.run(
            {
                "driver": drive,
                "first": lambda: compacting[0].compact(execution.id),
                "second": lambda: compacting[1].compact(execution.id),
                "reader": lambda: _engine(racing).get(execution.id).position,
            },
            choose=lambda names: data.draw(st.sampled_from(sorted(names))),
        )
        errors = {
            name: value for name, value in outcome.items() if isinstance(value, BaseException)
        }
        assert not errors, f"racing actors failed: {errors!r}"
        fresh = _engine(racing)
        view = fresh.get(execution.id)
        assert view.waiting_on == f"next{resumed + 2}"
        assert sorted(fresh.frames(execution.id)) == list(range(resumed + 3))
        for index in range(resumed + 2, STEPS):
            view = fresh.resume(execution.id, index)
        assert view.status is Status.COMPLETED
        assert view.result == sum(range(STEPS))
        for engine in compacting:  # engines whose cached copies were compacted past catch up
            assert engine.get(execution.id) == view

    race()
