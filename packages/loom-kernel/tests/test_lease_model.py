"""A model of leases: workers whose clocks disagree (by more than a lease, too) take
runs over in the middle of each other's steps, while appends lose their replies or
fail. Whatever happens, every run ends, no step is journaled twice, and a step's side
effect repeats only as often as its run was claimed (each claim can repeat at most the
one step in flight)."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from loom_kernel import Context, Engine, LoomError, MemoryStore, Status, flow
from loom_kernel.events import ExecutionClaimed, StepCompleted
from loom_kernel.testing import FakeClock, Fault

LEASE = 30.0
WORKERS = 3
RUNS = 3
STEPS = 4

_action = st.one_of(
    st.tuples(st.just("recover"), st.integers(0, WORKERS - 1)),
    st.tuples(st.just("advance"), st.integers(0, WORKERS - 1), st.floats(0, 3 * LEASE)),
    st.tuples(st.just("fault"), st.sampled_from([Fault.LOST_REPLY, Fault.UNAVAILABLE])),
    st.tuples(st.just("fire"), st.integers(0, WORKERS - 1)),
)


class _World:
    """The shared store, the workers with their own clocks, and what the steps did."""

    def __init__(self, skews: list[float], actions: list[Any]) -> None:
        self.store = MemoryStore()
        self.actions = list(actions)
        self.effects: Counter[tuple[str, int]] = Counter()
        self.clocks = [FakeClock(1_000_000.0 + skew) for skew in skews]

        @flow(name="modeled", version="1")
        def modeled(ctx: Context, _input: Any) -> Any:
            results = [
                ctx.step(f"s{index}", self._step(ctx.execution_id, index)) for index in (0, 1)
            ]
            ctx.sleep(5)
            results += [
                ctx.step(f"s{index}", self._step(ctx.execution_id, index))
                for index in range(2, STEPS)
            ]
            return results

        self.engines = [
            Engine(
                self.store,
                [modeled],
                clock=clock,
                lease=LEASE,
                listeners=[],
                worker_id=f"w{number}",
                sleep=lambda _seconds: None,
            )
            for number, clock in enumerate(self.clocks)
        ]

    def _step(self, run: str, index: int) -> Any:
        def call() -> int:
            self.effects[run, index] += 1
            if self.actions:
                self.interfere(self.actions.pop(0))
            return index

        return call

    def interfere(self, action: Any) -> None:
        kind = action[0]
        try:
            if kind == "recover":
                self.engines[action[1]].recover()
            elif kind == "advance":
                self.clocks[action[1]].advance(action[2])
            elif kind == "fault":
                self.store.inject_fault(action[1])
            else:
                self.engines[action[1]].fire_due_timers()
        except LoomError:
            pass  # a fault met by the interfering worker: it stops, as a crash would


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(
    skews=st.lists(st.floats(-3 * LEASE, 3 * LEASE), min_size=WORKERS, max_size=WORKERS),
    actions=st.lists(_action, max_size=40),
    starters=st.lists(st.integers(0, WORKERS - 1), min_size=RUNS, max_size=RUNS),
)
def test_takeovers_under_skew_and_faults_journal_every_step_once(
    skews: list[float], actions: list[Any], starters: list[int]
) -> None:
    world = _World(skews, actions)
    for number, starter in enumerate(starters):
        with contextlib.suppress(LoomError):  # a fault stopped the drive: left for a takeover
            world.engines[starter].start("modeled", key=f"r{number}")
    world.actions.clear()
    for _round in range(6):
        for clock in world.clocks:
            clock.advance(10 * LEASE)  # every lease has run out and every timer is due
        for engine in world.engines:
            try:
                engine.fire_due_timers()
                engine.recover()
            except LoomError:
                pass
    checker = world.engines[0]
    for number in range(RUNS):
        run = f"r{number}"
        try:
            view = checker.get(run)
        except LoomError:
            continue  # its start met a fault before it landed: there is no run
        assert view.status is Status.COMPLETED, view
        assert view.result == list(range(STEPS))
        events = [entry.event for entry in checker.history(run)]
        indices = [event.index for event in events if isinstance(event, StepCompleted)]
        assert sorted(indices) == list(range(STEPS)), f"{run}: each step journaled once"
        claims = sum(isinstance(event, ExecutionClaimed) for event in events)
        repeats = sum(world.effects[run, index] - 1 for index in range(STEPS))
        assert repeats <= claims, f"{run}: {repeats} repeated effects, {claims} claims"
        event(f"a run claimed {min(claims, 2)}+ times, with {min(repeats, 2)}+ repeated effects")
