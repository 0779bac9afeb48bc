"""Until its issue lands, loom_orchestration exports nothing and says so."""

from __future__ import annotations

import loom_orchestration


def test_exports_nothing_and_says_it_is_not_built() -> None:
    assert loom_orchestration.__all__ == []
    assert "Not built yet" in (loom_orchestration.__doc__ or "")
