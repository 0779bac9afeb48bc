"""The README's first command: `loom demo` on the embedded SQLite default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_runs_on_sqlite_by_default_and_twice(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "loom_kernel", "demo"]
    for _ in range(2):  # a second run on the same file starts a new order
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=True)
        assert "Loom demo on sqlite://loom-demo.db" in done.stdout
        assert "timer fired" in done.stdout
        assert "completed  →" in done.stdout
    assert (tmp_path / "loom-demo.db").exists()
