"""The conformance kit fails every deliberately broken store, and passes the reference one.

Each broken store below is the memory store with one bug a real backend could have.
"""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, Phase, settings
from loom_kernel import MemoryStore
from loom_kernel._spi import AmbiguousWriteError
from loom_kernel.spi import ConflictError, JournalStore, NewRecord, Record
from loom_kernel.testing import (
    DEFAULT_SETTINGS,
    StoreHarness,
    run_store_machine,
    verify_store,
)


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
        return self._write(stream, self._head(stream), self._last_batch, commit, lose_reply=False)

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
                raise AmbiguousWriteError from None
            raise

    def _confirm(self, stream: str, expected: int, count: int, commit: str) -> int:
        return expected + count


class FloorBlindLostReplyStore(MemoryStore):
    """Resolves a lost reply by the record `expected` counts from the stream's first
    record ever, not from its floor: once trimmed, it judges another record."""

    def _confirm(self, stream: str, expected: int, count: int, commit: str) -> int:
        with self._state.lock:
            entry = self._state.streams.get(stream)
            commits = [] if entry is None else entry.commits
            if 0 <= expected < len(commits) and commits[expected] == commit:
                return expected + count
        raise ConflictError(stream, expected, self.head(stream))


class LimitIgnoringReadStore(MemoryStore):
    """Returns everything after `after`, whatever the limit."""

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        return super()._read(stream, after, None)


class PerInstanceHeadStore(MemoryStore):
    """Checks `expected` against the heads this instance wrote, not the shared data, so two
    instances (two processes) both win an append at one expected head."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._written: dict[str, int] = {}

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        mine = self._written.get(stream, 0)
        if mine != expected:
            raise ConflictError(stream, expected, mine)
        head = super()._append(stream, self._head(stream), records)
        self._written[stream] = head
        return head


class TrimDropsHeadStore(MemoryStore):
    """trim(stream, head) drops the head record too."""

    def _trim(self, stream: str, before: int) -> None:
        head = self._head(stream)
        super()._trim(stream, before + 1 if before == head else before)


class KindCuttingStore(MemoryStore):
    """Keeps only the first 24 characters of a kind (the SPI allows 64)."""

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        cut = tuple(NewRecord(r.kind[:24], r.payload, r.timestamp) for r in records)
        return super()._append(stream, expected, cut)


class RoundingTimestampStore(MemoryStore):
    """Keeps timestamps to the microsecond, as a DATETIME column would."""

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        rounded = tuple(NewRecord(r.kind, r.payload, round(r.timestamp, 6)) for r in records)
        return super()._append(stream, expected, rounded)


class DeletedOnLaterPagesStore(MemoryStore):
    """Lists deleted names again on every page after the first."""

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        if after is None:
            return super()._streams(prefix, after, limit)
        with self._state.lock:
            names = sorted(
                name for name in self._state.streams if name.startswith(prefix) and name > after
            )
        return names[:limit]


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
    FloorBlindLostReplyStore,
    LimitIgnoringReadStore,
    PerInstanceHeadStore,
    TrimDropsHeadStore,
    KindCuttingStore,
    RoundingTimestampStore,
    DeletedOnLaterPagesStore,
)


# Derandomized so a broken store is caught the same way on every run; no shrinking,
# since these tests only need to know that the kit fails, not the smallest example;
# no health check timing the generation (on a loaded machine it failed a run that
# would have found the bug: the same examples, only slower).
KIT_SETTINGS = settings(
    DEFAULT_SETTINGS,
    derandomize=True,
    database=None,
    print_blob=False,
    report_multiple_bugs=False,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)


def _harness(cls: type[MemoryStore]) -> StoreHarness:
    """Each store over its own shared state, so the kit can reopen it and open a twin."""

    def reopen(store: JournalStore) -> JournalStore:
        store.close()
        return twin(store)

    def twin(store: JournalStore) -> JournalStore:
        assert isinstance(store, MemoryStore)
        return cls(store.name)

    return StoreHarness(
        open=lambda: cls(f"kit-{uuid.uuid4().hex}"), reopen=reopen, twin=twin, name=cls.__name__
    )


def test_kit_passes_the_reference_store() -> None:
    report = verify_store(_harness(MemoryStore), KIT_SETTINGS)
    assert report == {}
    assert report.not_applicable == {}, "every check applies to the reference store"


class PlainStore(JournalStore):
    """A correct store with no fault-injection seam (the memory store behind a wrapper)."""

    def __init__(self) -> None:
        self.inner = MemoryStore()

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        return self.inner.append(stream, expected, records)

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        return self.inner.read(stream, after, limit)

    def _head(self, stream: str) -> int:
        return self.inner.head(stream)

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        return self.inner.streams(prefix, after, limit)

    def _trim(self, stream: str, before: int) -> None:
        self.inner.trim(stream, before)

    def _delete(self, stream: str) -> None:
        self.inner.delete(stream)


def test_checks_that_cannot_apply_are_reported_as_not_applicable_never_as_passed() -> None:
    report = verify_store(StoreHarness(open=PlainStore, name="plain"), KIT_SETTINGS)
    assert report == {}
    assert set(report.not_applicable) == {
        "ambiguous_failures_resolve_exactly_once",
        "ambiguous_failures_after_a_trim_resolve_exactly_once",
        "reopen_keeps_everything",
        "a_second_instance_sees_and_refuses_the_same",
    }
    assert "inject_fault" in report.not_applicable["ambiguous_failures_resolve_exactly_once"]


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
    FloorBlindLostReplyStore: "ambiguous_failures_after_a_trim_resolve_exactly_once",
    LimitIgnoringReadStore: "read_windows_and_pages",
    PerInstanceHeadStore: "a_second_instance_sees_and_refuses_the_same",
    TrimDropsHeadStore: "trim_at_the_head_keeps_the_head_record",
    KindCuttingStore: "limits_are_kept_exactly",
    RoundingTimestampStore: "limits_are_kept_exactly",
    DeletedOnLaterPagesStore: "deleted_streams_stay_off_every_page",
}


def test_every_broken_store_is_listed() -> None:
    assert set(CAUGHT_BY) == set(BROKEN_STORES)


@pytest.mark.parametrize("broken", BROKEN_STORES, ids=lambda cls: cls.__name__)
def test_kit_fails_a_broken_store(broken: type[MemoryStore]) -> None:
    failures = verify_store(_harness(broken), KIT_SETTINGS)
    assert CAUGHT_BY[broken] in failures, (
        f"the conformance kit's {CAUGHT_BY[broken]} check passed {broken.__name__} "
        f"(failed: {sorted(failures)})"
    )


@pytest.mark.parametrize(
    "broken",
    [
        cls
        for cls in BROKEN_STORES
        if cls.__name__
        not in {"BlindRetryStore", "OptimisticLostReplyStore", "FloorBlindLostReplyStore"}
    ],
    ids=lambda cls: cls.__name__,
)
def test_state_machine_alone_fails_a_broken_store(broken: type[MemoryStore]) -> None:
    """The stateful comparison finds each bug by itself, not only the example checks.

    With more examples than the kit's default: which derandomized examples come first
    shifts with unrelated changes, and one bug (deleted streams on a listing's later
    pages) needs a long enough run to show. (It shifts with what else the process has
    imported, too: run with the CLI's tests, 200 examples missed that bug; 1,000 find
    it, and a run stops at the first difference, so the others cost no more.)"""
    with pytest.raises(AssertionError):
        run_store_machine(_harness(broken), settings(KIT_SETTINGS, max_examples=1000))
