"""Start-up: what `import loom_kernel` and `import loom_store_sqlite` cost against a
bare interpreter (`python -c pass`), and against importing only the kernel's own
dependencies, as ratios from one run.

Run:

    python3 -m uv run python bench/bench_startup.py
    python3 -m uv run python bench/bench_startup.py --rounds 21

Each command runs in a fresh interpreter; the commands alternate, round after round,
and each is timed best of the rounds (a start-up's noise is all upward).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

_FLOOR = "import attrs, cattrs, msgspec, asyncio, hashlib, json, concurrent.futures, logging"


def _commands(database: str) -> dict[str, str]:
    return {
        "python -c pass": "pass",
        "the kernel's dependencies": _FLOOR,
        "import loom_kernel": "import loom_kernel",
        "import loom_store_sqlite": "import loom_store_sqlite",
        "open an existing SQLite store": (
            f"from loom_kernel import open_store; open_store('sqlite:///{database}').close()"
        ),
    }


def _time(code: str) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    database = os.path.join(tempfile.mkdtemp(), "startup.db").lstrip("/")
    _time(f"from loom_kernel import open_store; open_store('sqlite:///{database}').close()")
    commands = _commands(database)
    best = dict.fromkeys(commands, float("inf"))
    for _ in range(args.rounds):
        for name, code in commands.items():
            best[name] = min(best[name], _time(code))
    bare = best["python -c pass"]
    for name, seconds in best.items():
        print(f"{name:32s} {seconds * 1e3:6.0f} ms  {seconds / bare:5.1f}x python -c pass")


if __name__ == "__main__":
    main()
