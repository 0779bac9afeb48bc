"""The kernel installs and imports with only attrs and cattrs: no store or blob library."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
PROBE = """
import json, sys
import loom_kernel
from importlib.metadata import distributions
print(json.dumps({
    "modules": sorted(sys.modules),
    "distributions": sorted(d.metadata["Name"].lower() for d in distributions()),
}))
"""


def _uv() -> list[str]:
    found = os.environ.get("UV") or shutil.which("uv")
    return [found] if found else [sys.executable, "-m", "uv"]


def test_kernel_alone_imports_no_store_library(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([*_uv(), "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            *_uv(),
            "pip",
            "install",
            "-q",
            "--python",
            str(python),
            str(ROOT / "packages" / "loom-kernel"),
        ],
        check=True,
    )
    out = subprocess.run([str(python), "-c", PROBE], check=True, capture_output=True, text=True)
    seen = json.loads(out.stdout)
    installed = set(seen["distributions"])
    assert {"loom-kernel", "attrs", "cattrs"} <= installed
    assert not installed & {"sqlite-utils", "boto3", "botocore", "fsspec", "hypothesis", "pytest"}
    top_level = {name.split(".")[0] for name in seen["modules"]}
    assert not top_level & {"sqlite_utils", "boto3", "botocore", "fsspec", "hypothesis", "pytest"}
    # The kernel's own command works with attrs and cattrs alone.
    loom = venv / "bin" / "loom"
    demo = subprocess.run(
        [str(loom), "demo"], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert demo.returncode == 0, demo.stderr
    assert "Loom demo on memory://" in demo.stdout
    assert "the same run: completed" in demo.stdout
    stores = subprocess.run([str(loom), "stores"], capture_output=True, text=True, check=False)
    assert stores.returncode == 0, stores.stderr
    assert "memory://: append+read round trip ok" in stores.stdout
