"""What the benchmarks share for timing: the median of a call's wall times, and the
wall time of threads started together."""

from __future__ import annotations

import statistics
import threading
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


def seconds_in_threads(threads: int, work: Callable[[int], object]) -> float:
    """Wall seconds for `threads` threads, released together, to each run `work(n)`
    (n = 0, 1, ...)."""
    barrier = threading.Barrier(threads + 1)

    def run(number: int) -> None:
        barrier.wait()
        work(number)

    running = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for thread in running:
        thread.start()
    barrier.wait()
    began = time.perf_counter()
    for thread in running:
        thread.join()
    return time.perf_counter() - began
