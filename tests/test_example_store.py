"""The example store in docs/examples, written from docs/spi.md alone, keeps the contract."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from loom_kernel import open_store
from loom_kernel.spi import JournalStore, register_store
from loom_kernel.testing import StoreContract

EXAMPLE = Path(__file__).parent.parent / "docs" / "examples" / "jsonl_store.py"


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("jsonl_store_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


jsonl = _load_example()
register_store("jsonl", jsonl.open_jsonl_store)


class TestJsonlExampleStore(StoreContract):
    def make_store(self) -> JournalStore:
        self.directory = tempfile.mkdtemp(dir=self.scratch)
        return open_store(f"jsonl://{self.directory}")

    def reopen_store(self, store: JournalStore) -> JournalStore:
        store.close()
        return open_store(f"jsonl://{self.directory}")

    def twin_store(self, store: JournalStore) -> JournalStore:
        return open_store(f"jsonl://{self.directory}")
