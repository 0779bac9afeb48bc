"""Counts a store's SPI calls, by method: what the benchmarks print beside their
ratios (on S3 they count requests with `loom_store_s3.testing.RequestCounter`)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from loom_kernel.spi import JournalStore


class CallCounter:
    """Counts a store's SPI calls, by method."""

    def __init__(self, store: JournalStore) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        for name in ("append", "read", "head", "streams", "trim", "delete"):
            setattr(store, name, self._counted(name, getattr(store, name)))

    def _counted(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)

        return counted

    def take(self) -> dict[str, int]:
        """The counts since the last take, by method; then start again."""
        calls = dict(self.calls)
        self.calls.clear()
        return calls
