"""Until its issue lands, loom_store_sqlite exports nothing and says so."""

from __future__ import annotations

import loom_store_sqlite


def test_exports_nothing_and_says_it_is_not_built() -> None:
    assert loom_store_sqlite.__all__ == []
    assert "Not built yet" in (loom_store_sqlite.__doc__ or "")
