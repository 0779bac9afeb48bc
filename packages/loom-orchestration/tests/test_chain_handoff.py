"""ADR 0052 D2's frozen criterion, at every store call of a handoff: "kill the worker
between terminal-commit and successor-start with a signal in flight; recover; assert
exactly one live successor and exactly one delivery".

The worker is an engine whose store dies at its k-th call (before the call, or after
it landed), for every k from the message that makes run 1 rotate until a handoff
with no death; as it dies, another process sends the chain a keyed signal. A dead
engine makes no call again (kill -9). Then a rescuer, once the victim's lease has
lapsed, recovers, and the sender and the client retry their sends (same keys): the
chain has exactly two runs, run 1 rotated and ended, run 2 live, and the signal and
the message were each received exactly once, the signal by run 2. On memory and on
SQLite."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from chain_helpers import FLOWS, receipts
from dying_store import Crash, DyingStore
from loom_kernel import Engine, MemoryStore, Status, open_store
from loom_kernel.spi import JournalStore
from loom_kernel.testing import FakeClock
from loom_orchestration import ROTATED, chain_runs, send_to_chain, start_chain
from loom_orchestration._chains._inbox import items


def _in_another_process(call: Callable[[], object]) -> None:
    """Run `call` on a thread of its own (its own context: another process's flow of
    control), and wait for it."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the sender hung"
    assert not failures, failures


def _handoff_with_a_death(base: JournalStore, at: int, *, after: bool) -> bool:
    """Run 1 parked; the victim's message makes it rotate, and its store dies at call
    `at` while the signal is sent from elsewhere; then the rescue. Whether it died."""
    clock = FakeClock(1000.0)
    start_chain(Engine(base, FLOWS, clock=clock, worker_id="starter"), "c", "chain.relay")
    sender = Engine(base, FLOWS, clock=clock, worker_id="sender")
    sent: list[int] = []

    def signal() -> None:
        sent.append(send_to_chain(sender, "c", "sig", topic="sig", key="sig-1"))

    dying = DyingStore(base, at, after=after, as_it_dies=lambda: _in_another_process(signal))
    victim = Engine(dying, FLOWS, clock=clock, worker_id="victim")
    with contextlib.suppress(Crash):
        send_to_chain(victim, "c", "go", topic="go", key="go-1")
    died = dying.dead
    clock.advance(3600)  # the victim's lease lapses
    rescuer = Engine(base, FLOWS, clock=clock, worker_id="rescuer")
    rescuer.recover()
    send_to_chain(rescuer, "c", "go", topic="go", key="go-1")  # the client retries
    send_to_chain(rescuer, "c", "sig", topic="sig", key="sig-1")  # so does the sender
    rescuer.recover()

    runs = chain_runs(rescuer, "c")
    assert [run.id for run in runs] == ["c@1", "c@2"], at
    assert runs[0].status is Status.COMPLETED, at
    assert runs[0].result == {ROTATED: "c@2"}, at
    assert [run.id for run in runs if not run.status.finished] == ["c@2"], "one live successor"
    got = receipts(rescuer, "c")
    assert sorted(position for _run, position in got) == [1, 2], f"each once, at call {at}"
    [signal_at] = [item.position for item in items(base, "c") if item.key == "sig-1"]
    assert ("c@2", signal_at) in got, f"the signal reached the successor, at call {at}"
    assert rescuer.get_event("c@2", "sig") == "sig", at
    return died


def _every_call(make: Callable[[int], JournalStore], *, after: bool) -> int:
    at = 1
    while _handoff_with_a_death(make(at), at, after=after):
        at += 1
        assert at < 1000, "the handoff never ended"
    return at


@pytest.mark.parametrize("after", [False, True], ids=["before the call", "after it landed"])
def test_d2_on_memory_at_every_store_call(after: bool) -> None:
    assert _every_call(lambda _at: MemoryStore(), after=after) > 10


@pytest.mark.parametrize("after", [False, True], ids=["before the call", "after it landed"])
def test_d2_on_sqlite_at_every_store_call(after: bool, tmp_path: Path) -> None:
    stores: list[JournalStore] = []

    def make(at: int) -> JournalStore:
        store = open_store(f"sqlite:///{tmp_path}/{at}.db")
        stores.append(store)
        return store

    try:
        assert _every_call(make, after=after) > 10
    finally:
        for store in stores:
            store.close()
