"""The async API's threads: a call never waits for another, idle threads are reused
and end, and the interpreter waits at exit for a call in flight."""

from __future__ import annotations

import queue
import random
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from loom_kernel._threads import CallThreads


def _eventually(condition: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_calls_one_after_another_reuse_one_thread() -> None:
    threads = CallThreads("reuse", linger=30)
    seen = {threads.run(threading.get_ident).result(10) for _ in range(20)}
    assert len(seen) == 1
    assert threads.threads() == 1


def test_calls_at_once_each_get_a_thread_however_many() -> None:
    count = 40
    together = threading.Barrier(count, timeout=10)  # passes only if all run at once
    threads = CallThreads("many", linger=30)
    futures = [threads.run(together.wait) for _ in range(count)]
    assert sorted(future.result(10) for future in futures) == list(range(count))
    assert threads.threads() == count


def test_a_call_that_raises_gives_its_error_and_the_thread_serves_on() -> None:
    threads = CallThreads("errors", linger=30)

    def fails() -> None:
        raise ValueError("no")

    def interrupted() -> None:
        raise KeyboardInterrupt

    assert isinstance(threads.run(fails).exception(10), ValueError)
    assert isinstance(threads.run(interrupted).exception(10), KeyboardInterrupt)
    assert threads.run(lambda: "served").result(10) == "served"
    assert threads.threads() == 1


def test_idle_threads_end_after_their_linger() -> None:
    threads = CallThreads("linger", linger=0.05)
    together = threading.Barrier(3, timeout=10)
    for future in [threads.run(together.wait) for _ in range(3)]:
        future.result(10)
    _eventually(lambda: threads.threads() == 0)
    assert threads.run(lambda: "again").result(10) == "again", "a new thread when none is left"


def test_wait_quiet_waits_for_the_calls_in_flight() -> None:
    threads = CallThreads("quiet", linger=30)
    release = threading.Event()
    future = threads.run(lambda: release.wait(10))
    assert not threads.wait_quiet(0.05)
    release.set()
    assert threads.wait_quiet(10)
    assert future.result(0) is True


def test_bursts_against_threads_giving_up_run_every_call_exactly_once() -> None:
    """Idle threads end within a millisecond, so calls are often handed to a thread
    as it gives up: each must still run, once."""
    threads = CallThreads("bursts", linger=0.001)
    rng = random.Random(7)
    ran: list[int] = []
    lock = threading.Lock()

    def call(number: int) -> int:
        with lock:
            ran.append(number)
        if rng.random() < 0.3:
            time.sleep(0.0005)
        return number

    number = 0
    futures = []
    for _ in range(300):
        for _ in range(rng.randint(1, 6)):
            futures.append(threads.run(lambda n=number: call(n)))  # type: ignore[misc]
            number += 1
        time.sleep(rng.choice([0.0, 0.0005, 0.001, 0.002]))
    assert [future.result(10) for future in futures] == list(range(number))
    assert sorted(ran) == list(range(number)), "each call ran exactly once"
    assert threads.wait_quiet(10)
    _eventually(lambda: threads.threads() == 0)


def test_a_call_handed_to_a_thread_as_its_wait_runs_out_is_still_run() -> None:
    """The race the bursts above make now and then, made every time: the call comes
    in as the idle thread's wait for one runs out, before it gives up."""
    threads = CallThreads("handed", linger=30)
    real = threads._calls
    handed: list[Future[Any]] = []

    class RunsOutAsACallComes:
        def put(self, item: Any) -> None:
            real.put(item)

        def get(self, timeout: float) -> Any:
            if not handed:
                handed.append(threads.run(lambda: "handed"))  # to this thread, idle now
                raise queue.Empty
            return real.get(timeout=timeout)

    threads._calls = RunsOutAsACallComes()  # type: ignore[assignment]
    assert threads.run(lambda: "first").result(10) == "first"
    _eventually(lambda: bool(handed))
    assert handed[0].result(10) == "handed"
    assert threads.threads() == 1, "the same thread ran it"


def test_a_call_cancelled_before_a_thread_takes_it_never_runs() -> None:
    threads = CallThreads("cancel", linger=30)
    assert threads.run(lambda: "first").result(10) == "first"  # one thread, idle now
    real = threads._calls
    held: list[Any] = []

    class Held:
        def put(self, item: Any) -> None:
            held.append(item)

        def get(self, timeout: float) -> Any:
            return real.get(timeout=timeout)

    threads._calls = Held()  # type: ignore[assignment]
    ran: list[str] = []
    future = threads.run(lambda: ran.append("ran"))
    assert future.cancel(), "not taken yet: it can be cancelled"
    real.put(held.pop())  # the idle thread takes it now
    assert threads.wait_quiet(10)
    assert ran == []
    threads._calls = real
    assert threads.run(lambda: "after").result(10) == "after"
    assert threads.threads() == 1


def test_a_new_thread_refused_by_the_system_is_a_clear_error_and_leaves_no_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads = CallThreads("refused", linger=30)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        threads.run(lambda: None)
    monkeypatch.undo()
    assert threads.threads() == 0
    assert threads.wait_quiet(0), "no call counted in flight"
    assert threads.run(lambda: "fine").result(10) == "fine"


def test_the_interpreter_waits_at_exit_for_a_drive_whose_caller_gave_up(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "second-step"
    script = textwrap.dedent(
        f"""
        import asyncio, time
        from pathlib import Path
        from loom_kernel import Context, Engine, MemoryStore, flow

        @flow(name="slow")
        def slow(ctx: Context, _input: object) -> object:
            ctx.step("nap", lambda: time.sleep(0.5))
            return ctx.step("mark", lambda: Path({str(marker)!r}).write_text("done"))

        engine = Engine(MemoryStore(), [slow], listeners=[])

        async def main() -> None:
            try:
                await asyncio.wait_for(engine.start_async("slow"), 0.05)
            except asyncio.TimeoutError:
                print("gave up")

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gave up"
    assert marker.read_text() == "done", "the drive went on to its end before the exit"
