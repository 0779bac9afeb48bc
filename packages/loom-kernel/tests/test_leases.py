"""Runs have owners: a live owner's run is not taken over, an expired or abandoned one
is, by an append at the exact head that fences the old owner."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from loom_kernel import (
    ConflictError,
    Context,
    Engine,
    InvalidArgumentError,
    MemoryStore,
    Status,
    flow,
)
from loom_kernel._engine import parts_of
from loom_kernel.events import ExecutionResumed, ExecutionStarted
from loom_kernel.testing import FakeClock

REMOTE = "other-host.1:4242:abcdef"  # a worker of another machine: only its lease tells


def _kinds(store: MemoryStore, execution_id: str) -> list[str]:
    return [record.kind for record in store.read("ex/" + execution_id)]


def _left_running_by(store: MemoryStore, owner: str, clock: FakeClock) -> None:
    """Run "r" started by `owner`, which journaled one step and stopped being heard of."""
    from loom_kernel._core import encode_event, encode_step_completed

    started = ExecutionStarted("two_steps", "version:1", None, "r", None, owner)
    store.append(
        "ex/r",
        0,
        [
            encode_event(started, clock()),
            encode_step_completed(0, "first", "1", 1, clock()),
        ],
    )


calls: list[str] = []


def _second() -> int:
    calls.append("second")
    return 2


@flow(name="two_steps", version="1")
def two_steps(ctx: Context, _input: Any) -> Any:
    first = ctx.step("first", lambda: 1)
    second = ctx.step("second", _second)
    return [first, second]


def test_a_run_of_a_live_owner_is_not_taken_over_until_its_lease_runs_out() -> None:
    store, clock = MemoryStore(), FakeClock(1_000.0)
    _left_running_by(store, REMOTE, clock)
    engine = Engine(store, [two_steps], clock=clock, lease=30.0, listeners=[])
    calls.clear()

    clock.advance(29.0)
    assert engine.recover() == []
    view = engine.get("r")
    assert (view.status, view.owner, view.owner_seen_at) == (Status.RUNNING, REMOTE, 1_000.0)
    assert calls == []

    clock.advance(2.0)  # 31 s since it was last seen: the lease ran out
    assert engine.recover() == ["r"]
    assert calls == ["second"]
    assert _kinds(store, "r")[2] == "EXECUTION_CLAIMED"
    done = engine.get("r")
    assert (done.status, done.result, done.owner) == (Status.COMPLETED, [1, 2], None)


def test_a_lease_renewal_keeps_the_run() -> None:
    from loom_kernel.spi import NewRecord

    store, clock = MemoryStore(), FakeClock(1_000.0)
    _left_running_by(store, REMOTE, clock)
    clock.advance(100.0)
    store.append("workers/" + REMOTE, 0, [NewRecord("loom.beat", b"{}", clock())])
    clock.advance(10.0)
    engine = Engine(store, [two_steps], clock=clock, lease=30.0, listeners=[])
    assert engine.recover() == [], "renewed 10 s ago: still its owner's"
    assert engine.get("r").owner_seen_at == 1_100.0


def test_the_old_owner_is_fenced_by_the_claim() -> None:
    store, clock = MemoryStore(), FakeClock(1_000.0)
    old = Engine(store, [two_steps], clock=clock, worker_id=REMOTE, listeners=[])
    _left_running_by(store, REMOTE, clock)
    stale = old.state("r")  # what the old owner folded before it was paused
    clock.advance(60.0)
    taker = Engine(store, [two_steps], clock=clock, listeners=[])
    assert taker.recover() == ["r"]
    from loom_kernel._core import encode_step_completed

    with pytest.raises(ConflictError):  # the old owner wakes up and tries to go on
        store.append("ex/r", stale.position, [encode_step_completed(1, "second", "9", 1, 0.0)])
    assert taker.get("r").result == [1, 2]


def test_a_run_left_by_an_engine_of_this_process_is_taken_over_at_once() -> None:
    store, clock = MemoryStore(), FakeClock(1_000.0)
    first = Engine(store, [two_steps], clock=clock, listeners=[])
    _left_running_by(store, first.worker_id, clock)  # its drive ended, say by a fault
    second = Engine(store, [two_steps], clock=clock, listeners=[])
    calls.clear()
    assert second.recover() == ["r"], "nobody here drives it: no lease to wait out"
    assert calls == ["second"]


def test_a_run_driven_in_this_process_is_not_driven_twice() -> None:
    store = MemoryStore()
    entered, release = threading.Event(), threading.Event()
    effects: list[str] = []

    def slow() -> str:
        effects.append("slow")
        entered.set()
        release.wait(10)
        return "done"

    @flow(name="slow_flow", version="1")
    def slow_flow(ctx: Context, _input: Any) -> Any:
        return ctx.step("slow", slow)

    driver = Engine(store, [slow_flow], listeners=[])
    other = Engine(store, [slow_flow], listeners=[])
    thread = threading.Thread(target=lambda: driver.start("slow_flow", key="s"))
    thread.start()
    assert entered.wait(10)
    try:
        assert other.recover() == [], "a live drive here keeps its run"
        view = other.get("s")
        assert (view.status, view.owner) == (Status.RUNNING, driver.worker_id)
    finally:
        release.set()
        thread.join(10)
    assert effects == ["slow"]
    assert other.get("s").status is Status.COMPLETED


def test_starts_and_resumes_name_their_driver() -> None:
    from loom_kernel._core import decode_events

    @flow(name="gated", version="1")
    def gated(ctx: Context, _input: Any) -> Any:
        return ctx.suspend("go")

    store = MemoryStore()
    starter = Engine(store, [gated], worker_id="starter", listeners=[])
    resumer = Engine(store, [gated], worker_id="resumer", listeners=[])
    starter.start("gated", key="g")
    assert starter.get("g").owner is None, "parked: nobody owns it"
    resumer.resume("g", "ok")
    events = decode_events(store.read("ex/g"))
    assert isinstance(events[0], ExecutionStarted)
    assert events[0].by == "starter"
    resumed = next(event for event in events if isinstance(event, ExecutionResumed))
    assert resumed.by == "resumer"


def test_heartbeats_renew_the_lease_while_a_step_runs() -> None:
    store = MemoryStore()

    def slow() -> str:
        threading.Event().wait(0.5)
        return "done"

    @flow(name="long_step", version="1")
    def long_step(ctx: Context, _input: Any) -> Any:
        return ctx.step("slow", slow)

    engine = Engine(store, [long_step], lease=0.3, listeners=[])
    engine.start("long_step", key="l")
    assert store.head("workers/" + engine.worker_id) >= 2, "a beat every tenth of a second"


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), 86_401.0, "30"])
def test_a_lease_is_a_positive_number_of_seconds(bad: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="a lease is"):
        Engine(MemoryStore(), lease=bad)


def test_a_worker_id_must_be_a_valid_id() -> None:
    from loom_kernel import InvalidIdError

    with pytest.raises(InvalidIdError):
        Engine(MemoryStore(), worker_id="has space")


def test_a_worker_restarted_under_its_configured_id_takes_its_runs_back_at_once() -> None:
    store, clock = MemoryStore(), FakeClock(1_000.0)
    _left_running_by(store, "web-1", clock)
    calls.clear()
    restarted = Engine(store, [two_steps], clock=clock, worker_id="web-1", listeners=[])
    assert restarted.recover() == ["r"]
    assert calls == ["second"]
    assert _kinds(store, "r")[2] == "EXECUTION_CLAIMED", "a fresh sighting for other workers"


def test_a_step_that_calls_recover_does_not_drive_its_own_run_again() -> None:
    store = MemoryStore()
    seen: list[list[str]] = []

    @flow(name="nested", version="1")
    def nested(ctx: Context, _input: Any) -> Any:
        def look() -> str:
            seen.append(ctx.engine.recover())
            return "looked"

        return ctx.step("look", look)

    engine = Engine(store, [nested], listeners=[])
    assert engine.start("nested", key="n").status is Status.COMPLETED
    assert seen == [[]]


def test_a_run_just_started_in_this_process_is_not_claimed_before_its_first_step() -> None:
    appended, go = threading.Event(), threading.Event()

    class PausingAfterTheStart(MemoryStore):
        """Stops the starting thread right after its start is journaled."""

        def _append(self, stream: str, expected: int, records: Any) -> int:
            head = super()._append(stream, expected, records)
            if expected == 0 and stream == "ex/r":
                appended.set()
                go.wait(10)
            return head

    store = PausingAfterTheStart()
    calls.clear()
    starter = Engine(store, [two_steps], listeners=[])
    thread = threading.Thread(target=lambda: starter.start("two_steps", key="r"))
    thread.start()
    assert appended.wait(10)
    try:
        recovered = Engine(store, [two_steps], listeners=[]).recover()
    finally:
        go.set()
        thread.join(10)
    assert recovered == [], "right after its start, the run is its starter's"
    assert calls == ["second"]
    assert "EXECUTION_CLAIMED" not in _kinds(store, "r")


# -- found by an adversarial review -------------------------------------------------


def _blocking_flow(
    name: str, entered: threading.Event, release: threading.Event, effects: list[str]
) -> Any:
    def slow() -> str:
        effects.append(threading.current_thread().name)
        entered.set()
        release.wait(10)
        return "done"

    @flow(name=name, version="1")
    def blocking(ctx: Context, _input: Any) -> Any:
        return ctx.step("slow", slow)

    return blocking


def test_an_ownerless_run_is_claimed_so_a_second_engine_leaves_it() -> None:
    from loom_kernel._core import encode_event

    entered, release = threading.Event(), threading.Event()
    effects: list[str] = []
    legacy = _blocking_flow("legacy", entered, release, effects)
    store = MemoryStore()
    started = ExecutionStarted("legacy", "version:1", None, "r", None)  # 1.16: no `by`
    store.append("ex/r", 0, [encode_event(started, 1.0)])
    first, second = (Engine(store, [legacy], listeners=[]) for _ in range(2))
    thread = threading.Thread(target=first.recover, name="first")
    thread.start()
    assert entered.wait(10)
    try:
        assert first.get("r").owner == first.worker_id
        assert second.recover() == []
    finally:
        release.set()
        thread.join(10)
    assert effects == ["first"]


def test_a_forked_process_has_its_own_worker_id() -> None:
    import os

    engine = Engine(MemoryStore(), listeners=[])
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child reports through the pipe)
        os.write(write, engine.worker_id.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    with os.fdopen(read, "rb") as pipe:
        in_child = pipe.read().decode()
    assert in_child != engine.worker_id
    assert in_child.split(":")[1] == str(child)


def test_the_worker_id_follows_the_pid_in_this_process_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the fork test, without a fork (so coverage, and the mutation sampler, see
    the line that makes the new id)."""
    import os

    engine = Engine(MemoryStore(), listeners=[])
    before = engine.worker_id
    monkeypatch.setattr(os, "getpid", lambda: 3_999_998)
    after = engine.worker_id
    assert after != before
    assert after.split(":")[1] == "3999998"
    assert engine.worker_id == after, "made once per pid"


def test_a_compacted_running_run_still_shows_its_owner_alive() -> None:
    entered, release = threading.Event(), threading.Event()
    effects: list[str] = []
    blocking = _blocking_flow("blocking", entered, release, effects)
    store = MemoryStore()
    driver = Engine(store, [blocking], worker_id="worker-a", listeners=[])
    other = Engine(store, [blocking], worker_id="worker-b", listeners=[])
    thread = threading.Thread(target=lambda: driver.start("blocking", key="r"), name="a")
    thread.start()
    assert entered.wait(10)
    try:
        other.compact("r")
        assert other.get("r").owner_seen_at is not None
        assert other.recover() == []
    finally:
        release.set()
        thread.join(10)
    assert effects == ["a"]


def test_a_run_whose_drive_stopped_is_taken_from_an_owner_busy_with_others() -> None:
    import time

    from loom_kernel import StoreUnavailableError

    class FailsOnce(MemoryStore):
        failed = False

        def _append(self, stream: str, expected: int, records: Any) -> int:
            if stream == "ex/r1" and expected == 1 and not FailsOnce.failed:
                FailsOnce.failed = True
                raise StoreUnavailableError("transient")
            return super()._append(stream, expected, records)

    entered, release = threading.Event(), threading.Event()
    blocking = _blocking_flow("blocking", entered, release, [])

    @flow(name="quick", version="1")
    def quick(ctx: Context, _input: Any) -> Any:
        return ctx.step("work", lambda: "ok")

    store = FailsOnce()
    busy = Engine(store, [quick, blocking], worker_id="busy", lease=0.3, listeners=[])
    other = Engine(store, [quick, blocking], worker_id="other", lease=0.3, listeners=[])
    with pytest.raises(StoreUnavailableError):
        busy.start("quick", key="r1")  # its drive stopped: r1 is left running
    thread = threading.Thread(target=lambda: busy.start("blocking", key="r2"))
    thread.start()
    assert entered.wait(10)
    try:
        time.sleep(0.25)  # a beat or two, listing r2 only
        assert other.recover() == ["r1"], "its owner renews, but no longer drives r1"
    finally:
        release.set()
        thread.join(10)
    assert other.get("r1").status is Status.COMPLETED


def test_a_worker_without_the_pinned_code_never_claims() -> None:
    from loom_kernel import CodeVersionError
    from loom_kernel._core import encode_event

    @flow(name="f", version="2")
    def newer(ctx: Context, _input: Any) -> Any:
        return ctx.step("s", lambda: 2)

    store = MemoryStore()
    started = ExecutionStarted("f", "version:1", None, "r", None, REMOTE)
    store.append("ex/r", 0, [encode_event(started, 1.0)])
    engine = Engine(store, [newer], clock=FakeClock(10_000.0), listeners=[])
    with pytest.raises(CodeVersionError):
        engine.recover()
    assert _kinds(store, "r") == ["EXECUTION_STARTED"]


def test_a_process_of_another_boot_or_host_of_the_same_name_is_not_judged_here() -> None:
    from loom_kernel._coordination._leases import _THIS_MACHINE, abandoned_here

    host, boot, namespace = _THIS_MACHINE.split(".")
    for machine in (f"{host}.0other0boot0.{namespace}", f"{host}.{boot}.1"):
        assert not abandoned_here(f"{machine}:3999999:abcdef", "r")
    assert abandoned_here(f"{_THIS_MACHINE}:3999999:abcdef", "r"), "no such pid here"


def test_a_process_that_may_not_be_signalled_is_not_judged_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from loom_kernel._coordination import _leases

    owner = f"{_leases._THIS_MACHINE}:3999999:abcdef"
    assert _leases.abandoned_here(owner, "r"), "no such pid here"

    def refused(pid: int, signal: int) -> None:
        raise PermissionError(1, "Operation not permitted")  # alive, another user's

    monkeypatch.setattr(os, "kill", refused)
    assert not _leases.abandoned_here(owner, "r"), "it exists: its lease decides"


def test_the_heartbeat_thread_ends_with_the_last_drive_and_a_failed_start_leaks_no_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    from loom_kernel._coordination import driving_here

    engine = Engine(MemoryStore(), [two_steps], lease=3600.0, listeners=[])
    engine.start("two_steps", key="a")
    thread = parts_of(engine).driver.heartbeat._thread
    assert thread is not None
    thread.join(5)
    assert not thread.is_alive(), "no thread waits out a third of an hour"
    # cleared under the lock as it ends, so a drive arriving while it is still
    # finishing starts a new one instead of counting on one about to be gone
    assert parts_of(engine).driver.heartbeat._thread is None

    def cannot_start(_self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    with pytest.raises(RuntimeError):
        engine.start("two_steps", key="b")
    assert not driving_here(engine.worker_id, "b")


def test_on_a_store_with_costly_heads_a_drive_in_doubt_of_its_lease_looks_before_a_step() -> None:
    import time

    from loom_kernel import StoreUnavailableError
    from loom_kernel._core import encode_event
    from loom_kernel.events import ExecutionClaimed

    class CostlyHeads(MemoryStore):
        """Heads cost a request here (as on S3); beats cannot be written; and a claim by
        another worker lands right after the first step is journaled."""

        head_is_cheap = False

        def _append(self, stream: str, expected: int, records: Any) -> int:
            if stream.startswith("workers/"):
                raise StoreUnavailableError("beats cannot be written")
            head = super()._append(stream, expected, records)
            if stream == "ex/r" and records[0].kind == "STEP_COMPLETED":
                claim = encode_event(ExecutionClaimed("thief", "x"), 0.0)
                head = super()._append(stream, head, (claim,))
            return head

    effects: list[str] = []

    def first() -> str:
        time.sleep(0.15)  # longer than half the lease, with no beat getting through
        return "first"

    def second() -> str:
        effects.append("second")
        return "second"

    @flow(name="pair", version="1")
    def pair(ctx: Context, _input: Any) -> Any:
        return [ctx.step("first", first), ctx.step("second", second)]

    engine = Engine(CostlyHeads(), [pair], lease=0.2, listeners=[])
    engine.start("pair", key="r")
    assert effects == [], "it saw the claim before starting the next step"
    assert engine.get("r").owner == "thief"


@pytest.mark.parametrize("payload", [b"\xff\xfe", b"[" * 100_000, b'"just a string"', b"{}"])
def test_a_damaged_beat_only_means_waiting_for_the_lease(payload: bytes) -> None:
    from loom_kernel.spi import NewRecord

    store, clock = MemoryStore(), FakeClock(1_000.0)
    _left_running_by(store, REMOTE, clock)
    clock.advance(1.0)
    store.append("workers/" + REMOTE, 0, [NewRecord("loom.beat", payload, clock())])
    engine = Engine(store, [two_steps], clock=clock, lease=30.0, listeners=[])
    assert engine.recover() == [], "seen a second ago: its owner's"
    clock.advance(31.0)
    assert engine.recover() == ["r"]


def test_a_lease_is_in_doubt_once_no_beat_succeeded_for_half_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time

    from loom_kernel._coordination import Heartbeat

    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    heartbeat = Heartbeat(MemoryStore(), lambda: "w", 30.0, FakeClock())
    now[0] += 14.0  # past a beat's interval (10 s): one beat may be late, no doubt yet
    assert not heartbeat.in_doubt()
    now[0] += 1.5
    assert heartbeat.in_doubt()
    heartbeat.beat()
    assert not heartbeat.in_doubt(), "a beat that lands renews it"


def test_a_beat_that_meets_another_writer_re_reads_the_head_for_the_next() -> None:
    from loom_kernel import ConflictError
    from loom_kernel._coordination import Heartbeat
    from loom_kernel.spi import NewRecord

    store = MemoryStore()
    heartbeat = Heartbeat(store, lambda: "w-1", 30.0, FakeClock())
    heartbeat.beat()
    store.append("workers/w-1", 1, [NewRecord("loom.beat", b'{"runs":[]}', 1.0)])  # a twin
    with pytest.raises(ConflictError):
        heartbeat.beat()
    heartbeat.beat()  # from the head as it is now, not as it was
    assert store.head("workers/w-1") == 3


def test_a_run_held_twice_is_listed_until_its_last_hold_ends() -> None:
    """An enqueue holds the run, and hands a second hold to the worker's drive: the
    first ending must not drop the run from the beats while the second drives it."""
    from loom_kernel._coordination import driving_here

    engine = Engine(MemoryStore(), [], listeners=[])
    heartbeat = parts_of(engine).driver.heartbeat
    with heartbeat.holding("r"):
        with heartbeat.holding("r"):
            assert heartbeat._runs["r"] == 2
        assert heartbeat._runs["r"] == 1, "still held: its beats list it"
        assert driving_here(engine.worker_id, "r")
    assert "r" not in heartbeat._runs
    assert not driving_here(engine.worker_id, "r")


def test_a_beat_lists_a_run_whose_drive_began_as_the_beat_was_stamped() -> None:
    """A beat is stamped before it lists the runs held: a drive that begins in between
    is listed (else the beat, newer than the run's first record, would look like it
    dropped the run, and another engine could take over a live drive)."""
    import json

    from loom_kernel._coordination import Heartbeat

    store = MemoryStore()
    clock = FakeClock()
    holds: list[Any] = []
    heartbeat = Heartbeat(store, lambda: "w", 30.0, lambda: clock.now)

    def stamp_as_a_drive_begins() -> float:
        if not holds:
            holds.append(heartbeat.holding("r"))
            holds[0].__enter__()
        return clock.now

    heartbeat._clock = stamp_as_a_drive_begins
    try:
        heartbeat.beat()
        beat = store.read("workers/w")[-1]
        assert json.loads(beat.payload)["runs"] == ["r"]
    finally:
        holds[0].__exit__(None, None, None)


def test_an_owner_whose_beats_are_trimmed_as_they_are_read_is_still_seen() -> None:
    """A trim between reading the beat stream's head and its last record means a newer
    beat: it is read again, not taken for no beat at all."""
    from loom_kernel import TrimmedError
    from loom_kernel._coordination import last_record
    from loom_kernel.spi import NewRecord

    class TrimsOnce(MemoryStore):
        trimmed = False

        def _read(self, stream: str, after: int, limit: int | None) -> Any:
            if not self.trimmed:
                self.trimmed = True
                self.append(stream, 2, [NewRecord("loom.beat", b'{"runs":["r"]}', 9.0)])
                raise TrimmedError(stream, after, 2)
            return super()._read(stream, after, limit)

    store = TrimsOnce()
    store.append(
        "workers/w", 0, [NewRecord("loom.beat", b'{"runs":["r"]}', float(n)) for n in (1, 2)]
    )
    found = last_record(store, "workers/w")
    assert found is not None
    assert found.timestamp == 9.0


def test_recover_by_another_engine_with_the_same_worker_id_leaves_a_run_driven_here() -> None:
    store = MemoryStore()
    entered, go = threading.Event(), threading.Event()
    runs: list[int] = []

    def work() -> str:
        runs.append(1)
        if len(runs) == 1:
            entered.set()
            go.wait(10)
        return "done"

    @flow(name="held", version="1")
    def held(ctx: Context, _input: Any) -> Any:
        ctx.suspend("go")
        return ctx.step("work", work)

    first = Engine(store, [held], worker_id="w", listeners=[])
    second = Engine(store, [held], worker_id="w", listeners=[])
    first.start("held", key="r")
    driving = threading.Thread(target=first.resume, args=("r", 1))  # a drive that holds once
    driving.start()
    assert entered.wait(10)
    try:
        assert second.recover() == []  # its own hold aside, a drive of this process holds it
    finally:
        go.set()
        driving.join(10)
    assert runs == [1]
    assert first.get("r").status is Status.COMPLETED


def test_drives_at_once_share_one_heartbeat_thread() -> None:
    entered, go = threading.Event(), threading.Event()

    def blocks() -> str:
        entered.set()
        go.wait(10)
        return "done"

    @flow(name="blocking", version="1")
    def blocking(ctx: Context, _input: Any) -> Any:
        return ctx.step("blocks", blocks)

    engine = Engine(MemoryStore(), [blocking, two_steps], lease=3600.0, listeners=[])
    held = threading.Thread(target=engine.start, args=("blocking",), kwargs={"key": "held"})
    held.start()
    try:
        assert entered.wait(10)
        beating = parts_of(engine).driver.heartbeat._thread
        assert beating is not None
        assert beating.is_alive()
        engine.start("two_steps", key="meanwhile")
        assert parts_of(engine).driver.heartbeat._thread is beating, (
            "a second thread renewing the same lease"
        )
    finally:
        go.set()
        held.join(10)


def test_a_take_over_whose_claim_loses_the_race_drives_nothing() -> None:
    """Two takers of an expired run: the one whose claim meets the other's first does
    not drive. On a store whose heads cost a request (no look before a step), driving
    on would run the next step's function before its append was refused."""
    from loom_kernel._core import encode_event
    from loom_kernel.events import ExecutionClaimed

    class CostlyHeads(MemoryStore):
        """Heads cost a request here (as on S3); another taker's claim lands just
        before this taker's."""

        head_is_cheap = False

        def _append(self, stream: str, expected: int, records: Any) -> int:
            if stream == "ex/r" and records[0].kind == "EXECUTION_CLAIMED":
                claim = encode_event(ExecutionClaimed("other-taker.1:1:aaaaaa", REMOTE), 0.0)
                super()._append(stream, expected, (claim,))
            return super()._append(stream, expected, records)

    store, clock = CostlyHeads(), FakeClock(1_000.0)
    _left_running_by(store, REMOTE, clock)
    clock.advance(60.0)
    engine = Engine(store, [two_steps], clock=clock, lease=30.0, listeners=[])
    calls.clear()
    assert engine.recover() == []
    assert calls == [], "the second step's function never ran"
    assert _kinds(store, "r")[2:] == ["EXECUTION_CLAIMED"]
    assert engine.get("r").owner == "other-taker.1:1:aaaaaa"


def test_the_machine_part_of_a_worker_id_names_this_boot_and_pid_namespace() -> None:
    """A pid is judged only on the boot and namespace it belongs to: the worker id's
    machine part carries this boot's id and this process's pid namespace."""
    import os
    import re
    from pathlib import Path

    from loom_kernel._coordination._leases import _machine

    boot_file = Path("/proc/sys/kernel/random/boot_id")
    if not boot_file.exists():
        pytest.skip("no boot id on this system")
    boot = re.sub(r"[^0-9a-f]", "", boot_file.read_text())[:12]
    namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    host, found_boot, found_namespace = _machine().split(".")
    assert (found_boot, found_namespace) == (boot, namespace)
    assert host


@pytest.mark.usefixtures("flow_loop")
def test_looking_whether_another_process_lives_sends_it_no_signal() -> None:
    import subprocess
    import sys

    from loom_kernel._coordination import abandoned_here, default_worker_id

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        machine = default_worker_id().partition(":")[0]
        assert abandoned_here(f"{machine}:{child.pid}:nonce", "r") is False, "it lives"
        with pytest.raises(subprocess.TimeoutExpired):  # the look did not signal it
            child.wait(timeout=0.5)
    finally:
        child.kill()
        child.wait()
    assert abandoned_here(f"{machine}:{child.pid}:nonce", "r") is True, "it exited"


@pytest.mark.usefixtures("flow_loop")
def test_a_workers_beats_are_trimmed_as_they_go() -> None:
    from loom_kernel.spi import TrimmedError

    store = MemoryStore()
    engine = Engine(store, [], worker_id="beating", listeners=[])
    for _ in range(40):
        parts_of(engine).driver.heartbeat.beat()
    assert store.head("workers/beating") == 40
    with pytest.raises(TrimmedError):
        store.read("workers/beating", 0)
    (last,) = store.read("workers/beating", 39)
    assert last.position == 40


@pytest.mark.usefixtures("flow_loop")
def test_a_beat_that_fails_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    import time

    from loom_kernel import StoreUnavailableError
    from loom_kernel._coordination import Heartbeat

    class NoBeats(MemoryStore):
        def _append(self, stream: str, expected: int, records: Any) -> int:
            if stream.startswith("workers/"):
                raise StoreUnavailableError("the beat did not land (injected)")
            return super()._append(stream, expected, records)

    heartbeat = Heartbeat(NoBeats(), lambda: "w-failing", 0.15, FakeClock())
    deadline = time.monotonic() + 10
    with caplog.at_level("WARNING", logger="loom"), heartbeat.holding("r"):
        while "was not renewed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "the lease of w-failing was not renewed: the beat did not land" in caplog.text
