"""What the engine tests share: the type of the `make_engine` fixture (conftest.py), and
a run's journal as (position, kind, payload) triples."""

from __future__ import annotations

from collections.abc import Callable

from loom_kernel import Engine
from loom_kernel.spi import JournalStore

EngineFactory = Callable[..., Engine]


def _journal(store: JournalStore, execution_id: str) -> list[tuple[int, str, bytes]]:
    return [(r.position, r.kind, r.payload) for r in store.read("ex/" + execution_id)]
