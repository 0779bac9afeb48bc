"""stable_stringify against the rfc8785 library and json.dumps, as ratios from one run.

Run: python3 -m uv run python bench/bench_canonical.py
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import rfc8785
from loom_kernel.events import stable_stringify

PAYLOADS: dict[str, Any] = {
    "small step result": {"total": 12.5, "currency": "EUR", "lines": [1, 2, 3], "ok": True},
    "order document": {
        "id": "order-7",
        "customer": {"name": "Ada", "tags": ["vip", "eu"], "score": 0.875},
        "lines": [{"sku": f"sku-{i}", "qty": i, "price": i * 1.25} for i in range(50)],
    },
    "deep nesting (200)": [[[[[[[[[[{"x": 1}]]]]]]]]]] * 20,
}


def _rate(func: Callable[[Any], object], value: Any, seconds: float = 0.4) -> float:
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(50):
            func(value)
        count += 50
    return count / elapsed


def main() -> None:
    print(f"{'payload':<22} {'vs rfc8785':>12} {'vs json.dumps(sort_keys)':>26}")
    for name, value in PAYLOADS.items():
        ours = _rate(stable_stringify, value)
        reference = _rate(rfc8785.dumps, value)
        stdlib = _rate(
            lambda v: json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False),
            value,
        )
        print(f"{name:<22} {ours / reference:>11.2f}x {ours / stdlib:>25.2f}x")
    print("(ratios are stable_stringify's throughput over the other's; >1 means faster)")


if __name__ == "__main__":
    main()
