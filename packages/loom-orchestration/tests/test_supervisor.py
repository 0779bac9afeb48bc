"""supervise_children: strategies, restart types, intensity on a virtual clock, the projection;
every test runs with the supervisor as a sync flow and as an async one."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from loom_kernel import AsyncContext, Context, Engine, MemoryStore, Status, flow
from loom_kernel._engine._listeners import installed_listeners
from loom_kernel.testing import FakeClock
from loom_orchestration import (
    ChildFailedError,
    ChildSpec,
    await_child,
    format_supervision,
    supervise_children,
    supervision,
)


@flow
def worker(ctx: Context, _input: Any) -> Any:
    order = ctx.suspend("work")
    if order == "fail":
        raise RuntimeError("worker crashed")
    return order


_kind = {"async": False}


@pytest.fixture(autouse=True, params=["sync", "async"])
def _supervisor_kind(request: pytest.FixtureRequest) -> None:
    _kind["async"] = request.param == "async"


def _supervisor(specs: list[ChildSpec], **options: Any) -> Any:
    if _kind["async"]:

        @flow(name="supervisor", version="1")
        async def async_supervisor(ctx: AsyncContext, _input: Any) -> Any:
            return await supervise_children(ctx, specs, **options)

        return async_supervisor

    @flow(name="supervisor", version="1")
    def supervisor(ctx: Context, _input: Any) -> Any:
        return supervise_children(ctx, specs, **options)

    return supervisor


def _engine(specs: list[ChildSpec], clock: FakeClock | None = None, **options: Any) -> Engine:
    return Engine(
        MemoryStore(), [worker, _supervisor(specs, **options)], clock=clock or FakeClock()
    )


def _status(engine: Engine, execution_id: str) -> Status:
    return engine.get(execution_id).status


def _children(engine: Engine) -> list[str]:
    return [e.id for e in engine.executions() if e.id.startswith("sup/")]


def test_one_for_one_restarts_only_the_failed_child() -> None:
    engine = _engine([ChildSpec("a", worker), ChildSpec("b", worker)])
    engine.start("supervisor", key="sup")
    engine.resume("sup/a@0", "fail")
    assert _status(engine, "sup/a@0") is Status.FAILED
    assert _status(engine, "sup/a@1") is Status.SUSPENDED
    assert _status(engine, "sup/b@0") is Status.SUSPENDED
    assert _children(engine) == ["sup/a@0", "sup/a@1", "sup/b@0"]


def test_one_for_all_restarts_everyone() -> None:
    engine = _engine([ChildSpec("a", worker), ChildSpec("b", worker)], strategy="one_for_all")
    engine.start("supervisor", key="sup")
    engine.resume("sup/a@0", "fail")
    assert _status(engine, "sup/b@0") is Status.CANCELLED
    assert _children(engine) == ["sup/a@0", "sup/a@1", "sup/b@0", "sup/b@1"]
    assert _status(engine, "sup/b@1") is Status.SUSPENDED


def test_rest_for_one_restarts_it_and_those_after_it() -> None:
    specs = [ChildSpec("a", worker), ChildSpec("b", worker), ChildSpec("c", worker)]
    engine = _engine(specs, strategy="rest_for_one")
    engine.start("supervisor", key="sup")
    engine.resume("sup/b@0", "fail")
    assert _status(engine, "sup/a@0") is Status.SUSPENDED
    assert _status(engine, "sup/c@0") is Status.CANCELLED
    assert _children(engine) == ["sup/a@0", "sup/b@0", "sup/b@1", "sup/c@0", "sup/c@1"]


def test_restart_types() -> None:
    specs = [
        ChildSpec("perm", worker, restart="permanent"),
        ChildSpec("trans", worker, restart="transient"),
        ChildSpec("temp", worker, restart="temporary"),
    ]
    engine = _engine(specs)
    engine.start("supervisor", key="sup")
    engine.resume("sup/perm@0", "done")  # permanent: restarted even after a normal end
    engine.resume("sup/trans@0", "fail")  # transient: restarted after a failure...
    engine.resume("sup/trans@1", "done")  # ...but not after a normal end
    engine.resume("sup/temp@0", "fail")  # temporary: never restarted
    assert _children(engine) == [
        "sup/perm@0",
        "sup/perm@1",
        "sup/temp@0",
        "sup/trans@0",
        "sup/trans@1",
    ]
    assert _status(engine, "sup") is Status.SUSPENDED  # perm@1 still runs
    engine.cancel("sup")
    assert _status(engine, "sup/perm@1") is Status.CANCELLED, (
        "the supervisor's end ends its children"
    )


def test_supervisor_completes_when_nothing_is_left_to_run() -> None:
    engine = _engine(
        [ChildSpec("t1", worker, restart="temporary"), ChildSpec("t2", worker, restart="transient")]
    )
    engine.start("supervisor", key="sup")
    engine.resume("sup/t1@0", "x")
    engine.resume("sup/t2@0", "y")
    assert _status(engine, "sup") is Status.COMPLETED
    result = engine.get("sup").result
    assert result["t1"]["status"] == "completed"
    assert result["t2"]["attempts"] == 1


def test_intensity_exceeded_escalates_within_the_period() -> None:
    clock = FakeClock()
    engine = _engine(
        [ChildSpec("a", worker), ChildSpec("b", worker)], clock, intensity=2, period=10
    )
    engine.start("supervisor", key="sup")
    for attempt in range(3):
        clock.advance(1)
        engine.resume(f"sup/a@{attempt}", "fail")
    failed = engine.get("sup")
    assert failed.status is Status.FAILED
    assert failed.error is not None
    assert failed.error.type.endswith("SupervisorEscalationError")
    assert "3 restarts within 10" in failed.error.message
    assert "RuntimeError: worker crashed" in failed.error.message
    assert _status(engine, "sup/b@0") is Status.CANCELLED


def test_restarts_spread_over_time_stay_within_intensity() -> None:
    clock = FakeClock()
    engine = _engine([ChildSpec("a", worker)], clock, intensity=2, period=10)
    engine.start("supervisor", key="sup")
    for attempt in range(6):
        clock.advance(6)  # at most two restarts fall inside any 10-second window
        engine.resume(f"sup/a@{attempt}", "fail")
    assert _status(engine, "sup") is Status.SUSPENDED
    assert _status(engine, "sup/a@6") is Status.SUSPENDED


def test_escalation_reaches_the_supervisors_parent() -> None:
    clock = FakeClock()
    specs = [ChildSpec("a", worker)]

    @flow
    def boss(ctx: Context, _input: Any) -> Any:
        try:
            return await_child(ctx, "supervisor")
        except ChildFailedError as exc:
            return {"escalated": exc.error_type.rsplit(".", 1)[-1]}

    engine = Engine(MemoryStore(), [worker, _supervisor(specs, intensity=0), boss], clock=clock)
    engine.start("boss", key="boss")
    engine.resume("boss/c0/a@0", "fail")
    assert engine.get("boss").result == {"escalated": "SupervisorEscalationError"}


def test_replay_and_recovery_never_create_extra_children() -> None:
    store = MemoryStore()
    specs = [ChildSpec("a", worker), ChildSpec("b", worker)]
    engine = Engine(store, [worker, _supervisor(specs, strategy="one_for_all")], clock=FakeClock())
    engine.start("supervisor", key="sup")
    engine.resume("sup/a@0", "fail")
    before = _children(engine)
    for _ in range(3):
        Engine(
            store, [worker, _supervisor(specs, strategy="one_for_all")], clock=FakeClock()
        ).recover()
    assert _children(engine) == before


def test_the_projection_reads_the_childrens_journals() -> None:
    engine = _engine([ChildSpec("a", worker), ChildSpec("b", worker)])
    engine.start("supervisor", key="sup")
    engine.resume("sup/a@0", "fail")
    engine.resume("sup/a@1", "fail")
    views = {view.name: view for view in supervision(engine, "sup")}
    assert views["a"].id == "sup/a@2"
    assert views["a"].restarts == 2
    assert views["a"].status is Status.SUSPENDED
    assert views["a"].last_error == "RuntimeError: worker crashed"
    assert views["b"].restarts == 0
    assert views["b"].last_error is None
    table = format_supervision(list(views.values()))
    assert "RuntimeError: worker crashed" in table
    assert table.splitlines()[0].startswith("child")


def test_bad_specs_fail_the_supervisor_clearly() -> None:
    engine = _engine([ChildSpec("a", worker), ChildSpec("a", worker)])
    failed = engine.start("supervisor", key="sup")
    assert failed.status is Status.FAILED
    assert failed.error is not None
    assert "child names must be unique" in failed.error.message


@flow
def first_fails(ctx: Context, _input: Any) -> Any:
    if ctx.execution_id.endswith("@0"):
        raise RuntimeError("the first attempt fails")
    return ctx.suspend("work")


_quick_runs: list[str] = []


def _effect(execution_id: str) -> str:
    _quick_runs.append(execution_id)
    return "done"


@flow
def quick(ctx: Context, _input: Any) -> Any:
    return ctx.step("effect", _effect, ctx.execution_id)


@pytest.mark.parametrize("strategy", ["one_for_all", "rest_for_one"])
def test_a_group_restart_leaves_children_that_ended_for_good_ended(strategy: str) -> None:
    """A temporary child, and a transient one that completed, ended before the
    supervisor handled another's failure: the group restart does not start them
    again (their side effects would run twice); a permanent one that ended starts
    again, as its restart type says."""
    specs = [
        ChildSpec("a", first_fails, restart="transient"),
        ChildSpec("t", quick, restart="temporary"),
        ChildSpec("tr", quick, restart="transient"),
        ChildSpec("p", quick, restart="permanent"),
    ]
    _quick_runs.clear()
    engine = Engine(
        MemoryStore(),
        [first_fails, quick, _supervisor(specs, strategy=strategy, intensity=10)],
        clock=FakeClock(),
    )
    engine.start("supervisor", key="sup")
    started = _children(engine)
    assert "sup/t@1" not in started
    assert "sup/tr@1" not in started
    assert "sup/a@1" in started
    assert "sup/p@1" in started
    assert _quick_runs.count("sup/t@0") == 1
    assert _quick_runs.count("sup/tr@0") == 1
    result = engine.get("sup").result if _status(engine, "sup").finished else None
    assert result is None or result["t"]["status"] == "completed"


def test_a_temporary_child_a_group_restart_stops_is_not_started_again() -> None:
    specs = [ChildSpec("a", worker), ChildSpec("t", worker, restart="temporary")]
    engine = _engine(specs, strategy="one_for_all")
    engine.start("supervisor", key="sup")
    engine.resume("sup/a@0", "fail")
    assert _status(engine, "sup/t@0") is Status.CANCELLED
    assert _children(engine) == ["sup/a@0", "sup/a@1", "sup/t@0"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"period": float("nan")}, "period is a finite number"),
        ({"intensity": float("nan")}, "intensity is an int"),
        ({"intensity": "3"}, "intensity is an int"),
        ({"period": None}, "period is a finite number"),
    ],
)
def test_bad_limits_fail_the_supervisor_clearly(options: dict[str, Any], match: str) -> None:
    engine = _engine([ChildSpec("a", worker)], **options)
    failed = engine.start("supervisor", key="sup")
    assert failed.status is Status.FAILED
    assert failed.error is not None
    assert match in failed.error.message
    assert _children(engine) == [], "no child started"


def test_a_second_supervision_with_the_same_child_names_fails_clearly() -> None:
    """Its children's ids would be the first's: it would wait for them for ever."""

    @flow(name="twice", version="1")
    def twice(ctx: Context, _input: Any) -> Any:
        supervise_children(ctx, [ChildSpec("q", quick, restart="temporary")])
        return supervise_children(ctx, [ChildSpec("q", quick, restart="temporary")])

    engine = Engine(MemoryStore(), [quick, twice], clock=FakeClock())
    run = engine.start("twice", key="sup")
    assert run.status is Status.FAILED
    assert run.error is not None
    assert "already started by this run" in run.error.message


def _assert_b_restarted_with_a(restart: Literal["transient", "temporary"]) -> None:
    """one_for_all over a and b (of `restart`): a fails, and b, stopped by the group's
    restart, starts again."""
    specs = [ChildSpec("a", worker), ChildSpec("b", worker, restart=restart)]
    engine = _engine(specs, strategy="one_for_all")
    engine.start("supervisor", key="sup")
    engine.resume("sup/a@0", "fail")
    assert _status(engine, "sup/b@0") is Status.CANCELLED
    assert _status(engine, "sup/b@1") is Status.SUSPENDED


def test_a_group_restart_starts_a_running_transient_child_again() -> None:
    """Stopped by the restart (its cancel), not ended by itself: a transient child
    starts again with the group, as a permanent one does."""
    _assert_b_restarted_with_a("transient")


def test_a_child_cancelled_by_hand_as_a_group_restart_nears_ends_as_it_did() -> None:
    """An operator cancelled the transient child between its sibling's failure and the
    supervisor's restart: the restart's cancel finds it ended by itself (another
    reason), and it is not started again (a transient child restarts on a failure)."""

    def cancel_b_first(engine: Engine, execution: Any) -> None:
        if execution.id == "sup/a@0" and execution.status is Status.FAILED:
            engine.cancel("sup/b@0", "by hand")

    specs = [ChildSpec("a", worker), ChildSpec("b", worker, restart="transient")]
    engine = Engine(
        MemoryStore(),
        [worker, _supervisor(specs, strategy="one_for_all")],
        clock=FakeClock(),
        listeners=[cancel_b_first, *installed_listeners()],  # before the parent hears
    )
    engine.start("supervisor", key="sup")
    engine.resume("sup/a@0", "fail")
    assert engine.get("sup/b@0").cancel_reason == "by hand"
    assert "sup/b@1" not in _children(engine)
    assert _status(engine, "sup/a@1") is Status.SUSPENDED


def test_a_cancel_a_journal_recorded_as_the_childs_id_starts_the_child_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A journal from before cancels said how the child had ended recorded the cancel
    step's result as the child's id: the child stopped by the restart starts again."""
    if _kind["async"]:
        pytest.skip("the old record is the sync supervisor's")
    from loom_orchestration import _supervisor as supervisor_module

    perform = supervisor_module._perform

    def as_before(ctx: Any, op: Any) -> Any:
        result = perform(ctx, op)
        return result["id"] if isinstance(op, supervisor_module._Cancel) else result

    monkeypatch.setattr(supervisor_module, "_perform", as_before)
    _assert_b_restarted_with_a("temporary")
