"""Until its issue lands, loom_store_s3 exports nothing and says so."""

from __future__ import annotations

import loom_store_s3


def test_exports_nothing_and_says_it_is_not_built() -> None:
    assert loom_store_s3.__all__ == []
    assert "Not built yet" in (loom_store_s3.__doc__ or "")
