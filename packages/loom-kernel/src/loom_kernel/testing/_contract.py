"""The kit as pytest tests (StoreContract) and as a plain function (verify_store)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import settings as Settings  # noqa: N812 - it is a class

from loom_kernel._journal import JournalStore
from loom_kernel.testing._checks import CHECKS
from loom_kernel.testing._harness import StoreHarness
from loom_kernel.testing._machine import DEFAULT_SETTINGS, run_store_machine

__all__ = ["StoreContract", "verify_store"]


def verify_store(harness: StoreHarness, settings: Settings | None = None) -> dict[str, str]:
    """Run the whole kit on a store.

    Returns:
        The name of each failed check mapped to its failure message; empty when the
        store keeps the contract.
    """
    failures: dict[str, str] = {}
    for name, check in CHECKS.items():
        try:
            check(harness)
        except Exception as exc:  # any failure of the store counts, whatever its type
            failures[name] = f"{type(exc).__name__}: {exc}"
    try:
        run_store_machine(harness, settings)
    except Exception as exc:
        failures["state_machine"] = f"{type(exc).__name__}: {exc}"
    return failures


class StoreContract:
    """Subclass as ``Test<YourStore>(StoreContract)`` and define `make_store`.

    Override `reopen_store` where the store can be closed and opened again over the
    same data, and `hypothesis_settings` to run the state machine longer. A store
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

    def harness(self) -> StoreHarness:
        """Describe this store to the kit."""
        can_reopen = type(self).reopen_store is not StoreContract.reopen_store
        return StoreHarness(
            open=self.make_store,
            reopen=self.reopen_store if can_reopen else None,
            name=type(self).__name__,
        )

    @pytest.mark.parametrize("check", sorted(CHECKS))
    def test_contract(self, check: str) -> None:
        CHECKS[check](self.harness())

    def test_state_machine(self) -> None:
        run_store_machine(self.harness(), self.hypothesis_settings)
