"""What the benchmarks share for timing: the median of a call's wall times."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(func: Callable[[], object], repeat: int) -> float:
    """The median wall time of `repeat` calls of `func`, in seconds."""
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        func()
        times.append(time.perf_counter() - began)
    return statistics.median(times)
