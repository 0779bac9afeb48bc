"""What the benchmarks share: counting a store's SPI calls, by method (on S3 they
count requests with `loom_store_s3.testing.RequestCounter`), and measuring on each
local S3 server asked for."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from loom_kernel.spi import JournalStore
from loom_store_s3.testing import MotoServer, RadosGateway, S3Server


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


def on_servers(chosen: str, measure: Callable[[S3Server], None]) -> None:
    """`measure` on Ceph RGW ("rgw", "both"; said when it is not installed) and on
    moto ("moto", "both")."""
    if chosen in ("rgw", "both"):
        missing = RadosGateway.missing()
        if missing:
            print(f"\nCeph RGW is not installed (missing {missing}): run scripts/install-rgw")
        else:
            with RadosGateway() as rgw:
                measure(rgw)
    if chosen in ("moto", "both"):
        with MotoServer() as moto:
            measure(moto)
