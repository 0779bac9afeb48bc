"""The kit as pytest tests (StoreContract) and as a plain function (verify_store)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import settings as Settings  # noqa: N812 - it is a class

from loom_kernel._spi._journal import JournalStore
from loom_kernel.testing._checks import CHECKS
from loom_kernel.testing._harness import NotApplicable, StoreHarness
from loom_kernel.testing._machine import DEFAULT_SETTINGS, run_store_machine

__all__ = ["KitReport", "StoreContract", "verify_store"]


class KitReport(dict[str, str]):
    """What `verify_store` found: the failed checks, mapped to their failure messages.

    Empty when the store keeps the contract. `not_applicable` maps the checks that
    could not apply to this store (no fault-injection seam, no way to reopen it or
    to open a second instance) to the reason; they did not pass, they did not run.
    """

    def __init__(self) -> None:
        super().__init__()
        self.not_applicable: dict[str, str] = {}


def verify_store(harness: StoreHarness, settings: Settings | None = None) -> KitReport:
    """Run the whole kit on a store.

    Returns:
        The name of each failed check mapped to its failure message (empty when the
        store keeps the contract), with the checks that did not apply in
        `.not_applicable`.
    """
    report = KitReport()
    for name, check in CHECKS.items():
        try:
            check(harness)
        except NotApplicable as reason:
            report.not_applicable[name] = str(reason)
        except Exception as exc:  # any failure of the store counts, whatever its type
            report[name] = f"{type(exc).__name__}: {exc}"
    try:
        run_store_machine(harness, settings)
    except Exception as exc:
        report["state_machine"] = f"{type(exc).__name__}: {exc}"
    return report


class StoreContract:
    """Subclass as ``Test<YourStore>(StoreContract)`` and define `make_store`.

    Override `reopen_store` where the store can be closed and opened again over the
    same data, `twin_store` where a second instance can be opened over the same data
    (as another process would), and `hypothesis_settings` to run the state machine
    longer. Checks that need what a store does not offer skip, saying why. A store
    that keeps files puts them under `self.scratch`, a directory pytest gives each
    test and removes with its other temporary directories (the state machine makes
    a store per example: hundreds of them).
    """

    hypothesis_settings: ClassVar[Settings] = DEFAULT_SETTINGS
    scratch: Path

    @pytest.fixture(autouse=True)
    def _scratch_directory(self, tmp_path: Path) -> None:
        self.scratch = tmp_path

    def make_store(self) -> JournalStore:
        """Return a new, empty store."""
        raise NotImplementedError("a StoreContract subclass must define make_store()")

    def reopen_store(self, store: JournalStore) -> JournalStore:
        """Close `store` and return a new instance over the same data."""
        raise NotImplementedError

    def twin_store(self, store: JournalStore) -> JournalStore:
        """Return a second, open instance over the same data as `store`."""
        raise NotImplementedError

    def harness(self) -> StoreHarness:
        """Describe this store to the kit."""
        cls = type(self)
        can_reopen = cls.reopen_store is not StoreContract.reopen_store
        has_twin = cls.twin_store is not StoreContract.twin_store
        return StoreHarness(
            open=self.make_store,
            reopen=self.reopen_store if can_reopen else None,
            twin=self.twin_store if has_twin else None,
            name=cls.__name__,
        )

    @pytest.mark.parametrize("check", sorted(CHECKS))
    def test_contract(self, check: str) -> None:
        try:
            CHECKS[check](self.harness())
        except NotApplicable as reason:
            pytest.skip(f"not applicable to {type(self).__name__}: {reason}")

    def test_state_machine(self) -> None:
        run_store_machine(self.harness(), self.hypothesis_settings)
