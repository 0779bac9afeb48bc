"""The conformance kit fails every deliberately broken store, and passes the reference one.

Each broken store below is the memory store with one bug a real backend could have.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from loom_kernel import ConflictError, MemoryStore, NewRecord, Record
from loom_kernel._memory_store import _LostReplyError
from loom_kernel.testing import DEFAULT_SETTINGS, StoreHarness, run_store_machine, verify_store


class LostUpdateStore(MemoryStore):
    """Appends wherever the head is, ignoring `expected`: two writers both win."""

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        return super()._append(stream, self._head(stream), records)


class NonAtomicBatchStore(MemoryStore):
    """Writes the first half of a batch before it checks the head."""

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        half = len(records) // 2
        if half and self._head(stream) != expected:
            super()._append(stream, self._head(stream), records[:half])
        return super()._append(stream, expected, records)


class SkippingReadStore(MemoryStore):
    """Loses the second record of any read that returns three or more."""

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        found = super()._read(stream, after, limit)
        return found[:1] + found[2:] if len(found) >= 3 else found


class ReorderingReadStore(MemoryStore):
    """Returns the first two records of a read swapped."""

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        found = super()._read(stream, after, limit)
        return [found[1], found[0], *found[2:]] if len(found) >= 2 else found


class PrefixIgnoringListingStore(MemoryStore):
    """Lists every stream, whatever the prefix."""

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        return super()._streams("", after, limit)


class CursorIgnoringListingStore(MemoryStore):
    """Starts every listing page at the beginning, ignoring `after`."""

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        return super()._streams(prefix, None, limit)


class RenumberingTrimStore(MemoryStore):
    """Trims by renumbering what is left from 1, so the next appends reuse positions."""

    def _trim(self, stream: str, before: int) -> None:
        super()._trim(stream, before)
        with self._state.lock:
            entry = self._state.streams.get(stream)
            if entry is None or entry.floor == 0:
                return
            entry.records = [
                Record(index, r.kind, r.payload, r.timestamp)
                for index, r in enumerate(entry.records, start=1)
            ]
            entry.floor = 0


class ForgetfulDeleteStore(MemoryStore):
    """Deletes a stream by forgetting it, so its name and positions can be used again."""

    def _delete(self, stream: str) -> None:
        super()._delete(stream)
        with self._state.lock:
            self._state.streams.pop(stream, None)


class BlindRetryStore(MemoryStore):
    """On a lost reply it writes again instead of checking whether the write landed."""

    def _confirm(self, stream: str, expected: int, count: int, commit: str) -> int:
        try:
            return self._write(
                stream, self._head(stream), self._last_batch, commit, lose_reply=False
            )
        except ConflictError:
            raise

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        self._last_batch = records
        return super()._append(stream, expected, records)


class OptimisticLostReplyStore(MemoryStore):
    """On a lost reply it assumes success, even when the write was refused."""

    def _write(
        self,
        stream: str,
        expected: int,
        records: tuple[NewRecord, ...],
        commit: str,
        *,
        lose_reply: bool,
    ) -> int:
        try:
            return super()._write(stream, expected, records, commit, lose_reply=False)
        except ConflictError:
            if lose_reply:
                raise _LostReplyError from None
            raise

    def _confirm(self, stream: str, expected: int, count: int, commit: str) -> int:
        return expected + count


class LimitIgnoringReadStore(MemoryStore):
    """Returns everything after `after`, whatever the limit."""

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        return super()._read(stream, after, None)


BROKEN_STORES: tuple[type[MemoryStore], ...] = (
    LostUpdateStore,
    NonAtomicBatchStore,
    SkippingReadStore,
    ReorderingReadStore,
    PrefixIgnoringListingStore,
    CursorIgnoringListingStore,
    RenumberingTrimStore,
    ForgetfulDeleteStore,
    BlindRetryStore,
    OptimisticLostReplyStore,
    LimitIgnoringReadStore,
)


# Derandomized so a broken store is caught the same way on every run; no shrinking,
# since these tests only need to know that the kit fails, not the smallest example.
KIT_SETTINGS = settings(
    DEFAULT_SETTINGS,
    derandomize=True,
    database=None,
    print_blob=False,
    report_multiple_bugs=False,
    phases=[Phase.explicit, Phase.generate],
)


def test_kit_passes_the_reference_store() -> None:
    assert verify_store(StoreHarness(open=MemoryStore, name="memory"), KIT_SETTINGS) == {}


# The check of the kit that names each bug (others may fail too).
CAUGHT_BY = {
    LostUpdateStore: "stale_append_conflicts_and_writes_nothing",
    NonAtomicBatchStore: "stale_append_conflicts_and_writes_nothing",
    SkippingReadStore: "read_windows_and_pages",
    ReorderingReadStore: "read_windows_and_pages",
    PrefixIgnoringListingStore: "streams_prefix_order_and_paging",
    CursorIgnoringListingStore: "streams_prefix_order_and_paging",
    RenumberingTrimStore: "trim_keeps_head_and_positions",
    ForgetfulDeleteStore: "delete_retires_the_name",
    BlindRetryStore: "ambiguous_failures_resolve_exactly_once",
    OptimisticLostReplyStore: "ambiguous_failures_resolve_exactly_once",
    LimitIgnoringReadStore: "read_windows_and_pages",
}


def test_every_broken_store_is_listed() -> None:
    assert set(CAUGHT_BY) == set(BROKEN_STORES)


@pytest.mark.parametrize("broken", BROKEN_STORES, ids=lambda cls: cls.__name__)
def test_kit_fails_a_broken_store(broken: type[MemoryStore]) -> None:
    failures = verify_store(StoreHarness(open=broken, name=broken.__name__), KIT_SETTINGS)
    assert CAUGHT_BY[broken] in failures, (
        f"the conformance kit's {CAUGHT_BY[broken]} check passed {broken.__name__} "
        f"(failed: {sorted(failures)})"
    )


@pytest.mark.parametrize(
    "broken",
    [
        cls
        for cls in BROKEN_STORES
        if cls.__name__ not in {"BlindRetryStore", "OptimisticLostReplyStore"}
    ],
    ids=lambda cls: cls.__name__,
)
def test_state_machine_alone_fails_a_broken_store(broken: type[MemoryStore]) -> None:
    """The stateful comparison finds each bug by itself, not only the example checks."""
    with pytest.raises(AssertionError):
        run_store_machine(StoreHarness(open=broken, name=broken.__name__), KIT_SETTINGS)
