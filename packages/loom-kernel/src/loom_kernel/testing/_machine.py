"""A hypothesis state machine that drives a store and the memory model side by side."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings as Settings  # noqa: N812 - it is a class
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from loom_kernel._core._errors import ConflictError, LoomError, TrimmedError
from loom_kernel._core._records import MAX_KIND_LENGTH, NewRecord, Record
from loom_kernel._spi._journal import JournalStore
from loom_kernel._spi._memory_store import MemoryStore
from loom_kernel.testing._checks import BAD_IDS, list_in_pages, read_in_pages
from loom_kernel.testing._harness import StoreHarness

__all__ = ["DEFAULT_SETTINGS", "run_store_machine", "store_machine"]

#: The kit's default: finds every broken store of the kit's own tests, in about a second each.
DEFAULT_SETTINGS = Settings(max_examples=60, stateful_step_count=40, deadline=None)

# Few streams, so rules meet the same stream often; prefixes cut across them.
STREAMS = ("a", "a/b", "a/b:c", "ab", "b~")
PREFIXES = ("", "a", "a/", "a/b", "ab", "b", "c")

_records = st.lists(
    st.builds(
        NewRecord,
        kind=st.sampled_from(["k.one", "k.two", "EXECUTION_STARTED", "k" * MAX_KIND_LENGTH]),
        payload=st.binary(max_size=24),
        timestamp=st.floats(min_value=0, max_value=4e9, allow_nan=False),
    ),
    min_size=1,
    max_size=4,
)


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """Run a call and describe what it did in a form two stores can be compared by."""
    try:
        result = call()
    except ConflictError as exc:
        return ("raised", (ConflictError.__name__, exc.stream, exc.expected))
    except LoomError as exc:
        return ("raised", type(exc).__name__)
    if isinstance(result, list) and result and isinstance(result[0], Record):
        return ("records", [(r.position, r.kind, r.payload, r.timestamp) for r in result])
    return ("returned", result)


def store_machine(harness: StoreHarness) -> type[RuleBasedStateMachine]:
    """Build the state machine class for a store: every rule runs on the store and the model.

    Each outcome (the value returned, or the kernel error raised) must be the same on
    both. With `harness.reopen`, a rule closes and reopens the store mid-run.
    """

    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.store: JournalStore = harness.open()
            self.twin = harness.twin(self.store) if harness.twin is not None else None
            self.model = MemoryStore()

        def on(self, twin: bool) -> JournalStore:
            """The store, or (when drawn and the harness has one) its second instance."""
            return self.twin if twin and self.twin is not None else self.store

        def both(
            self, what: str, call: Callable[[JournalStore], Any], twin: bool = False
        ) -> tuple[str, Any]:
            want = _outcome(lambda: call(self.model))
            target = self.on(twin)
            got = _outcome(lambda: call(target))
            where = "its second instance" if target is not self.store else "the store"
            assert got == want, f"{what}: {where} gave {got!r}, the model {want!r}"
            return got

        def after_write(self, stream: str) -> None:
            """Every write is followed by a look at the head it left behind, from both
            instances when there are two."""
            self.both(f"head({stream!r}) after a write", lambda s: s.head(stream))
            if self.twin is not None:
                self.both(f"head({stream!r}) after a write", lambda s: s.head(stream), True)

        def model_head(self, stream: str) -> int:
            try:
                return self.model.head(stream)
            except LoomError:
                return 0

        @rule(
            stream=st.sampled_from(STREAMS),
            batch=_records,
            twin=st.booleans(),
            sync=st.booleans(),
        )
        def append_at_head(
            self, stream: str, batch: list[NewRecord], twin: bool, sync: bool
        ) -> None:
            expected = self.model_head(stream)
            self.both(
                f"append({stream!r}, {expected}, {len(batch)} records, sync={sync})",
                lambda s: s.append(stream, expected, batch, sync=sync),
                twin,
            )
            self.after_write(stream)

        @rule(
            stream=st.sampled_from(STREAMS),
            offset=st.integers(-5, 5).filter(bool),
            batch=_records,
            twin=st.booleans(),
            sync=st.booleans(),
        )
        def append_at_wrong_head(
            self, stream: str, offset: int, batch: list[NewRecord], twin: bool, sync: bool
        ) -> None:
            expected = max(0, self.model_head(stream) + offset)
            self.both(
                f"append({stream!r}, {expected}, {len(batch)} records, sync={sync})",
                lambda s: s.append(stream, expected, batch, sync=sync),
                twin,
            )
            self.after_write(stream)

        @rule(
            stream=st.sampled_from(STREAMS),
            after=st.integers(0, 25),
            limit=st.none() | st.integers(1, 6),
            twin=st.booleans(),
        )
        def read(self, stream: str, after: int, limit: int | None, twin: bool) -> None:
            self.both(
                f"read({stream!r}, {after}, {limit})",
                lambda s: s.read(stream, after, limit),
                twin,
            )

        @rule(stream=st.sampled_from(STREAMS), size=st.integers(1, 5))
        def read_in_pages(self, stream: str, size: int) -> None:
            start = self.model_floor(stream)

            joined = self.both(
                f"reading {stream!r} in pages of {size}",
                lambda s: read_in_pages(s, stream, start, size),
            )
            whole = self.both(f"read({stream!r}, {start})", lambda s: s.read(stream, start))
            assert joined == whole, f"pages joined {joined!r} differ from one read {whole!r}"

        def model_floor(self, stream: str) -> int:
            try:
                self.model.read(stream, 0, 1)
            except TrimmedError as exc:
                return exc.floor
            except LoomError:
                pass
            return 0

        @rule(stream=st.sampled_from(STREAMS))
        def head(self, stream: str) -> None:
            self.both(f"head({stream!r})", lambda s: s.head(stream))

        @rule(
            prefix=st.sampled_from(PREFIXES),
            after=st.none() | st.sampled_from(STREAMS + PREFIXES[1:]),
            limit=st.none() | st.integers(1, 4),
        )
        def streams(self, prefix: str, after: str | None, limit: int | None) -> None:
            self.both(
                f"streams({prefix!r}, {after!r}, {limit})",
                lambda s: s.streams(prefix, after, limit),
            )

        @rule(prefix=st.sampled_from(PREFIXES), size=st.integers(1, 3))
        def streams_in_pages(self, prefix: str, size: int) -> None:
            self.both(
                f"listing {prefix!r} in pages of {size}",
                lambda s: list_in_pages(s, prefix, size),
            )

        @rule(stream=st.sampled_from(STREAMS), back=st.integers(-1, 6), twin=st.booleans())
        def trim(self, stream: str, back: int, twin: bool) -> None:
            before = max(0, self.model_head(stream) + 1 - back)
            self.both(f"trim({stream!r}, {before})", lambda s: s.trim(stream, before), twin)
            self.after_write(stream)
            kept = max(0, before - 1)
            self.both(f"read({stream!r}, {kept}) after a trim", lambda s: s.read(stream, kept))

        @rule(stream=st.sampled_from(STREAMS), dice=st.integers(0, 5), twin=st.booleans())
        def delete(self, stream: str, dice: int, twin: bool) -> None:
            if dice == 0:  # rarely: a deleted name never comes back, which ends that stream's story
                self.both(f"delete({stream!r})", lambda s: s.delete(stream), twin)
                self.after_write(stream)

        @rule(bad=st.sampled_from(BAD_IDS), batch=_records)
        def invalid_id(self, bad: Any, batch: list[NewRecord]) -> None:
            self.both(f"append({bad!r})", lambda s: s.append(bad, 0, batch))
            self.both(f"read({bad!r})", lambda s: s.read(bad))

        @precondition(lambda self: harness.reopen is not None)
        @rule()
        def reopen(self) -> None:
            assert harness.reopen is not None
            self.store = harness.reopen(self.store)

        @invariant()
        def same_listing(self) -> None:
            self.both("streams()", lambda s: s.streams())

        def teardown(self) -> None:
            if self.twin is not None:
                self.twin.close()
            self.store.close()

    StoreMachine.__name__ = f"StoreMachine[{harness.name}]"
    return StoreMachine


def run_store_machine(harness: StoreHarness, settings: Settings | None = None) -> None:
    """Run the state machine against a store; raises AssertionError on the first difference."""
    run_state_machine_as_test(store_machine(harness), settings=settings or DEFAULT_SETTINGS)
