"""Reading a run (`_engine/_reading.py`, `_engine/_cache.py`, and the load of
`_coordination/_executions.py`): a cached copy is brought to the current state, even
past a compaction, and the least recently used is dropped first; a load leaves the
garbage collector as it found it and gives up on a journal compacted under every read;
a run deleted or never started is not found; a prefix that is not a str is named so."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from counter_flow import counter
from loom_kernel import Context, Engine, InvalidIdError, MemoryStore, flow
from loom_kernel.testing import sandbox

pytestmark = pytest.mark.usefixtures("flow_loop")


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


def test_the_history_of_a_deleted_execution_is_not_found() -> None:
    from loom_kernel import ExecutionNotFoundError

    box = sandbox(counter)
    box.engine.start("counter", key="gone")
    box.store.delete("ex/gone")
    with pytest.raises(ExecutionNotFoundError, match="was deleted"):
        box.engine.history("gone")


def test_the_history_of_an_execution_never_started_is_not_found() -> None:
    from loom_kernel import ExecutionNotFoundError

    with pytest.raises(ExecutionNotFoundError, match="no execution with id"):
        sandbox(counter).engine.history("never")


def test_a_prefix_that_is_not_a_str_is_named_as_such() -> None:
    box = sandbox(counter)
    with pytest.raises(InvalidIdError, match="an execution id prefix is a str"):
        list(box.engine.executions(123))  # type: ignore[arg-type]
