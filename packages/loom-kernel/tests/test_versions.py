"""K11: a run is driven only on the code it is pinned to; several versions can be hosted;
resume_as migrates after a replay-check; ctx.patched changes code in place; and the
deploy commands check and migrate a whole store."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from counter_flow import counter
from loom_kernel import (
    CodeVersionError,
    Context,
    Engine,
    InvalidArgumentError,
    MemoryStore,
    NonDeterminismError,
    UnknownFlowError,
    flow,
    open_store,
)
from loom_kernel._hosting._cli import main
from loom_kernel.testing import FakeClock, sandbox

ran: list[str] = []


def _note(what: str, value: Any) -> Any:
    """A step's side effect: note which code ran it."""
    ran.append(what)
    return value


@flow(name="order", version="1")
def order_v1(ctx: Context, _input: Any) -> Any:
    quote = ctx.step("quote", lambda: _note("v1 quote", 10))
    manager = ctx.suspend("manager")
    return {"v": 1, "quote": quote, "manager": manager}


@flow(name="order", version="2")
def order_v2(ctx: Context, _input: Any) -> Any:
    quote = ctx.step("quote", lambda: _note("v2 quote", 10))
    manager = ctx.suspend("manager")
    ctx.step("notify", lambda: _note("v2 notify", "sent"))
    return {"v": 2, "quote": quote, "manager": manager}


@flow(name="order", version="3")
def order_v3(ctx: Context, _input: Any) -> Any:
    ctx.step("fraud_check", lambda: "ok")  # a new step before recorded history
    quote = ctx.step("quote", lambda: 10)
    return {"v": 3, "quote": quote, "manager": ctx.suspend("manager")}


def _engine(store: MemoryStore, *flows: Any) -> Engine:
    return Engine(store, flows, clock=FakeClock(), listeners=[])


def test_a_run_is_refused_by_an_engine_without_its_code_and_nothing_is_journaled() -> None:
    store = MemoryStore()
    _engine(store, order_v1).start("order", key="o")
    journal = store.read("ex/o")
    deployed = _engine(store, order_v2)
    with pytest.raises(CodeVersionError, match="pinned to code 'version:1'") as caught:
        deployed.resume("o", "yes")
    error = caught.value
    assert (error.execution_id, error.flow, error.pinned, error.registered) == (
        "o",
        "order",
        "version:1",
        ["version:2"],
    )
    assert "resume_as" in str(error)
    assert store.read("ex/o") == journal
    assert deployed.get("o").waiting_on == "manager"


def test_one_engine_hosts_two_versions_and_drives_each_run_on_its_own() -> None:
    ran.clear()
    store = MemoryStore()
    old = _engine(store, order_v1).start("order", key="old")
    both = _engine(store, order_v1, order_v2)
    new = both.start("order", key="new")
    assert new.code_hash == "version:2", "new runs start on the version registered last"
    assert both.resume(old.id, "yes").result["v"] == 1
    assert both.resume(new.id, "yes").result["v"] == 2
    assert ran == ["v1 quote", "v2 quote", "v2 notify"]


def test_resume_as_migrates_a_run_whose_history_replays() -> None:
    ran.clear()
    store = MemoryStore()
    _engine(store, order_v1).start("order", key="o")
    engine = _engine(store, order_v1, order_v2)
    moved = engine.resume_as("o", "2", reason="notify customers")
    assert moved.code_hash == "version:2"
    assert store.read("ex/o")[-1].kind == "EXECUTION_MIGRATED"
    assert engine.state("o").variables["_migrations"] == [
        {"from": "version:1", "to": "version:2", "reason": "notify customers"}
    ]
    assert ran == ["v1 quote"], "the replay-check ran no step"
    again = engine.resume_as("o", "2")
    assert again.position == moved.position, "migrating to the pinned code changes nothing"
    done = _engine(store, order_v2).resume("o", "yes")  # the old code is no longer needed
    assert done.result["v"] == 2


def test_resume_as_refuses_a_run_whose_history_diverges_and_journals_nothing() -> None:
    store = MemoryStore()
    _engine(store, order_v1).start("order", key="o")
    journal = store.read("ex/o")
    engine = _engine(store, order_v1, order_v3)
    with pytest.raises(NonDeterminismError) as caught:
        engine.resume_as("o", order_v3)
    assert (caught.value.index, caught.value.recorded, caught.value.found) == (
        0,
        "quote",
        "fraud_check",
    )
    assert store.read("ex/o") == journal
    assert engine.get("o").code_hash == "version:1"
    with pytest.raises(UnknownFlowError, match="no registered version 'version:9'") as unknown:
        engine.resume_as("o", "9")
    assert "version:1" in str(unknown.value)
    assert "version:3" in str(unknown.value)


def test_a_finished_run_is_not_migrated() -> None:
    store = MemoryStore()
    engine = _engine(store, order_v1, order_v2)
    run = _engine(store, order_v1).start("order", key="done")
    _engine(store, order_v1).resume(run.id, "yes")
    with pytest.raises(InvalidArgumentError, match="finished run never runs again"):
        engine.resume_as("done", "2")


def test_a_replay_check_that_stops_short_of_the_history_is_refused() -> None:
    @flow(name="order", version="4")
    def order_v4(ctx: Context, _input: Any) -> Any:
        return "returns before its quote"

    store = MemoryStore()
    _engine(store, order_v1).start("order", key="o")
    with pytest.raises(NonDeterminismError, match="the code returned first"):
        _engine(store, order_v1, order_v4).replay_check("o")


class _Crash(BaseException):
    """Stands in for the process dying mid-run: nothing in the engine catches it."""


@pytest.mark.parametrize("gate", ["suspend", "sleep"])
def test_a_replay_check_that_reaches_a_new_gate_writes_nothing(gate: str) -> None:
    @flow(name="gated", version="1")
    def crashes(ctx: Context, _input: Any) -> Any:
        ctx.step("quote", lambda: 10)
        raise _Crash  # the run stays running, its history ending after the quote

    @flow(name="gated", version="2")
    def waits(ctx: Context, _input: Any) -> Any:
        ctx.step("quote", lambda: 10)
        if gate == "sleep":
            ctx.sleep(60)
        return ctx.suspend("manager")

    store = MemoryStore()
    with pytest.raises(_Crash):
        _engine(store, crashes).start("gated", key="g")
    streams = store.streams("")
    heads = {stream: store.head(stream) for stream in streams}
    _engine(store, crashes, waits).replay_check("g", "2")  # the history replays
    assert store.streams("") == streams, "a replay-check wrote a stream (a timer hint?)"
    assert {stream: store.head(stream) for stream in streams} == heads


# -- ctx.patched ----------------------------------------------------------------------


def _patchable(patched: bool) -> Any:
    @flow(name="ship", version="1")
    def ship(ctx: Context, _input: Any) -> Any:
        ctx.step("pack", lambda: "packed")
        if patched and ctx.patched("insure"):
            ctx.step("insure", lambda: _note("insured", "insured"))
        label = ctx.suspend("label")
        ctx.step("send", lambda: "sent")
        return [label, ctx.suspend("delivered")]

    return ship


def test_patched_is_false_for_history_recorded_before_and_true_for_new_runs() -> None:
    ran.clear()
    store = MemoryStore()
    old = _engine(store, _patchable(False)).start("ship", key="old")
    _engine(store, _patchable(False)).resume(old.id, "L1")  # recorded past the patch point
    engine = _engine(store, _patchable(True))
    assert engine.resume(old.id, "ok").result == ["L1", "ok"]
    assert ran == [], "the old run replays its history without the new step"
    parked = _engine(store, _patchable(False)).start("ship", key="parked")  # at "label"
    assert engine.resume(parked.id, "L0").waiting_on == "delivered"
    assert ran == [], "a gate recorded after the patch point is history from before it"
    new = engine.start("ship", key="new")
    assert ran == ["insured"]
    assert [f.name for f in engine.frames(new.id).values()][:3] == [
        "pack",
        "loom.patched:insure",
        "insure",
    ]
    fresh = _engine(store, _patchable(True))
    fresh.resume(new.id, "L2")
    assert fresh.resume(new.id, "ok").result == ["L2", "ok"]
    assert ran == ["insured"], "a replay of the new run takes the patched branch again"


# -- the deploy commands ----------------------------------------------------------------


MODULE = """
from loom_kernel import flow

@flow(name="order", version="{version}")
def order(ctx, _input):
    {extra}quote = ctx.step("quote", lambda: 10)
    manager = ctx.suspend("manager")
    return ctx.step("after", lambda: "x")

FLOWS = [order]
"""


def _module(tmp_path: Path, name: str, version: str, extra: str = "") -> str:
    (tmp_path / f"{name}.py").write_text(MODULE.format(version=version, extra=extra))
    return f"{name}:FLOWS"


def test_replay_check_and_migrate_over_a_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    url = f"sqlite:///{tmp_path}/loom.db"
    store = open_store(url)
    for key in ("a", "b"):
        _engine_on(store, order_v1).start("order", key=key)
    done = _engine_on(store, order_v1).start("order", key="finished")
    _engine_on(store, order_v1).resume(done.id, "yes")
    store.close()
    good = _module(tmp_path, "deploy_good", "2")
    bad = _module(tmp_path, "deploy_bad", "3", extra='ctx.step("fraud_check", lambda: 1)\n    ')

    # Version 2 replays the runs pinned to version 1, but drives no run of version 1
    # until it is migrated: a deploy gate that said ok here would strand them.
    assert main(["replay-check", "--store", url, "--flows", good]) == 1
    captured = capsys.readouterr()
    out = captured.out
    assert "MIGRATE    a (order): pinned version:1, which these flows lack; it replays on " in out
    assert "0 ok, 2 need a migrate, 0 would diverge, 0 could not be checked" in out
    assert "finished" not in out, "finished runs never run again: not checked"
    assert f"loom migrate --store {url} --flows {good}" in captured.err, "the command that fixes it"

    assert main(["replay-check", "--store", url, "--flows", bad, "--limit", "1"]) == 1
    out = capsys.readouterr().out
    assert "DIVERGES   a (order, pinned version:1): step #0 recorded 'quote'" in out
    assert "'fraud_check'" in out
    assert "0 ok, 0 need a migrate, 1 would diverge" in out

    assert main(["migrate", "--store", url, "--flows", bad]) == 1
    assert "0 ok, 0 need a migrate, 2 would diverge" in capsys.readouterr().out
    assert main(["migrate", "--store", url, "--flows", good, "--reason", "deploy 2"]) == 0
    assert "migrated   a (order): version:1 -> version:2" in capsys.readouterr().out
    with open_store(url) as reopened:
        assert {_engine_on(reopened).get(k).code_hash for k in ("a", "b")} == {"version:2"}
    assert main(["replay-check", "--store", url, "--flows", good]) == 0
    assert "2 ok, 0 need a migrate" in capsys.readouterr().out, "migrated: the deploy is safe"
    assert main(["replay-check", "--store", url, "--flows", "no_such_module:X"]) == 2
    assert main(["replay-check", "--store", url, "--flows", "nocolon"]) == 2
    assert main(["replay-check", "--store", url, "--flows", good, "--flow", "ordr"]) == 2
    assert "is --flow right?" in capsys.readouterr().err


UNVERSIONED = """
from loom_kernel import flow

@flow(name="notify")
def notify(ctx, _input):{comment}
    ctx.step("send", lambda: 1)
    return ctx.suspend("ack")

FLOWS = [notify]
"""


def test_replay_check_says_a_run_pinned_to_edited_unversioned_code_needs_a_migrate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A comment added to an unversioned flow changes its code hash: the new code
    replays the parked run but refuses to drive it (CodeVersionError) until it is
    migrated. The deploy gate says so and fails, naming the command that fixes it."""
    import importlib

    monkeypatch.syspath_prepend(str(tmp_path))
    url = f"sqlite:///{tmp_path}/loom.db"
    (tmp_path / "notify_v1.py").write_text(UNVERSIONED.format(comment=""))
    (tmp_path / "notify_v2.py").write_text(UNVERSIONED.format(comment="  # now commented"))
    old = importlib.import_module("notify_v1").FLOWS
    new = importlib.import_module("notify_v2").FLOWS
    with open_store(url) as store:
        _engine_on(store, *old).start("notify", key="notify-1")
        with pytest.raises(CodeVersionError):
            _engine_on(store, *new).resume("notify-1", "ok")
    assert main(["replay-check", "--store", url, "--flows", "notify_v2:FLOWS"]) == 1
    captured = capsys.readouterr()
    assert "MIGRATE    notify-1 (notify): pinned sha256:" in captured.out
    assert "0 ok, 1 need a migrate, 0 would diverge, 0 could not be checked" in captured.out
    assert "loom migrate --store" in captured.err
    assert main(["migrate", "--store", url, "--flows", "notify_v2:FLOWS"]) == 0
    capsys.readouterr()
    assert main(["replay-check", "--store", url, "--flows", "notify_v2:FLOWS"]) == 0
    with open_store(url) as store:
        assert _engine_on(store, *new).resume("notify-1", "ok").result == "ok"
    for name in ("notify_v1", "notify_v2"):
        sys.modules.pop(name, None)


def test_replay_check_passes_runs_pinned_to_a_version_the_new_flows_keep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first way to change a flow (keep the old version registered beside the new
    one): its runs are driven on their own version, so they pass."""
    monkeypatch.syspath_prepend(str(tmp_path))
    url = f"sqlite:///{tmp_path}/loom.db"
    with open_store(url) as store:
        _engine_on(store, order_v1).start("order", key="a")
    _module(tmp_path, "kept_v1", "1")
    _module(tmp_path, "new_v3", "3", extra='ctx.step("fraud_check", lambda: 1)\n    ')
    (tmp_path / "both.py").write_text(
        "from kept_v1 import order as v1\nfrom new_v3 import order as v3\nFLOWS = [v1, v3]\n"
    )
    assert main(["replay-check", "--store", url, "--flows", "both:FLOWS"]) == 0
    out = capsys.readouterr().out
    assert "ok         a (order): pinned version:1, which these flows keep" in out


def test_replay_check_fails_on_runs_the_new_code_would_strand_and_on_an_empty_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    url = f"sqlite:///{tmp_path}/loom.db"
    with open_store(url) as store:
        _engine_on(store, order_v1).start("order", key="a")
    (tmp_path / "renamed.py").write_text(
        MODULE.format(version="2", extra="").replace('name="order"', 'name="purchase"')
    )
    assert main(["replay-check", "--store", url, "--flows", "renamed:FLOWS"]) == 1
    out = capsys.readouterr().out
    assert "UNHOSTED   a: suspended run of flow 'order', which the new code" in out
    assert "0 ok, 0 need a migrate, 0 would diverge, 1 could not be checked" in out

    typo = f"sqlite:///{tmp_path}/typo.db"
    good = _module(tmp_path, "deploy_same", "2")
    for command in ("replay-check", "migrate"):
        assert main([command, "--store", typo, "--flows", good]) == 2
        assert "no SQLite database at" in capsys.readouterr().err
        assert not (tmp_path / "typo.db").exists(), f"{command} created the mistyped store"
    for command in ("ls", "show"):
        assert main([command, *(["x"] if command == "show" else []), "--store", typo]) == 1
        assert "no SQLite database at" in capsys.readouterr().err
        assert not (tmp_path / "typo.db").exists(), f"{command} created the mistyped store"
    app_db = tmp_path / "app.db"
    with sqlite3.connect(app_db) as app:
        app.execute("CREATE TABLE users (id INTEGER PRIMARY KEY)")
    app.close()
    (tmp_path / "notes.db").write_text("not a database at all")
    for name in ("app.db", "notes.db"):
        before = (tmp_path / name).read_bytes()
        assert main(["ls", "--store", f"sqlite:///{tmp_path}/{name}"]) == 1
        assert "is not a Loom store" in capsys.readouterr().err
        assert (tmp_path / name).read_bytes() == before, f"{name} was changed"
        assert not (tmp_path / f"{name}-wal").exists()
    empty = f"sqlite:///{tmp_path}/empty.db"
    open_store(empty).close()
    assert main(["replay-check", "--store", empty, "--flows", good]) == 2
    assert "holds no runs at all" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay-check", "--store", url, "--flows", good, "--limit", "0"])


def _engine_on(store: Any, *flows: Any) -> Engine:
    return Engine(store, flows, clock=FakeClock(), listeners=[])


def test_load_flows_takes_a_flow_a_function_or_a_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loom_kernel._hosting._deploy import load_flows

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "several.py").write_text(
        textwrap.dedent(
            """
            from loom_kernel import flow
            def plain(ctx, _input):
                return 1
            single = flow(plain, name="single")
            class Box:
                flows = (single,)
            """
        )
    )
    assert [f.name for f in load_flows("several:single")] == ["single"]
    assert [f.name for f in load_flows("several:plain")] == ["plain"]
    assert [f.name for f in load_flows("several:Box.flows")] == ["single"]
    with pytest.raises(InvalidArgumentError):
        load_flows("several:nothing")
    sys.modules.pop("several", None)


def test_a_flow_version_that_is_not_registered_is_refused_not_swapped() -> None:
    @flow(name="order", version="1")
    def v1(ctx: Context, _input: Any) -> Any:
        return ctx.suspend("go")

    @flow(name="order", version="2")
    def v2(ctx: Context, _input: Any) -> Any:
        return ctx.suspend("go")

    @flow(name="refund", version="2")
    def other(ctx: Context, _input: Any) -> Any:
        return ctx.suspend("go")

    box = sandbox(v2, other)
    with pytest.raises(UnknownFlowError, match="no registered version 'version:1'"):
        box.engine.start(v1)
    assert list(box.engine.executions()) == []
    box.engine.start(v2, key="o")
    with pytest.raises(InvalidArgumentError, match="another flow than 'order'"):
        box.engine.resume_as("o", other)


def test_a_run_being_driven_by_a_live_owner_is_not_migrated_under_it() -> None:
    """Its code cannot change under a drive in flight (the drive's step would be
    refused and another version's step run instead): refused, nothing journaled; once
    it parks, the migration goes through."""
    import threading

    inside, release = threading.Event(), threading.Event()

    def a() -> str:
        inside.set()
        release.wait(20)
        return "A"

    @flow(name="slow_job", version="1")
    def v1(ctx: Context, _input: Any) -> Any:
        ctx.step("a", a)
        return ctx.suspend("g")

    @flow(name="slow_job", version="2")
    def v2(ctx: Context, _input: Any) -> Any:
        ctx.step("a", a)
        return ctx.suspend("g")

    store = MemoryStore()
    driver = Engine(store, [v1], listeners=[], worker_id="driver")
    other = Engine(store, [v1, v2], listeners=[], worker_id="other")
    running = threading.Thread(target=driver.start, args=("slow_job",), kwargs={"key": "r"})
    running.start()
    try:
        assert inside.wait(10)
        head = store.head("ex/r")
        with pytest.raises(InvalidArgumentError, match="being driven by 'driver'"):
            other.resume_as("r", "2")
        assert store.head("ex/r") == head
    finally:
        release.set()
        running.join(10)
    assert other.resume_as("r", "2").code_hash == "version:2"


def test_two_codes_under_one_version_of_a_flow_are_refused() -> None:
    @flow(name="twin", version="1")
    def first(ctx: Context, _input: Any) -> Any:
        return ctx.step("s", lambda: "first")

    @flow(name="twin", version="1")
    def second(ctx: Context, _input: Any) -> Any:
        return ctx.step("s", lambda: "second, forgot to bump the version")

    engine = Engine(MemoryStore(), [first], listeners=[])
    engine.register(first)  # the same code again: fine
    with pytest.raises(InvalidArgumentError, match="registered already with other code"):
        engine.register(second)
    assert engine.start("twin").result == "first"


def test_a_flow_without_source_hashes_the_same_in_every_process() -> None:
    """Built at run time (exec, a .pyc-only deploy): its hash is of its bytecode and
    constants, nested code objects included, never of their memory addresses."""
    source = textwrap.dedent(
        """
        def built(ctx, _input):
            return ctx.step("s", lambda: "v")
        """
    )
    hashes = set()
    for _ in range(3):
        namespace: dict[str, Any] = {}
        exec(compile(source, "<built at run time>", "exec"), namespace)
        hashes.add(flow(name="built")(namespace["built"]).code_hash)
    assert len(hashes) == 1
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from loom_kernel import flow\nnamespace = {}\n"
            f"exec(compile({source!r}, '<built at run time>', 'exec'), namespace)\n"
            "print(flow(name='built')(namespace['built']).code_hash)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == hashes.pop(), "another process hashes it alike"


def test_an_old_version_registered_for_its_runs_leaves_new_runs_on_the_newest() -> None:
    """What CodeVersionError advises (`register(old_flow, newest=False)`) hosts the old
    runs without moving new runs back to the old code."""

    @flow(name="kept", version="1")
    def v1(ctx: Context, _input: Any) -> Any:
        return ctx.suspend("go")

    @flow(name="kept", version="2")
    def v2(ctx: Context, _input: Any) -> Any:
        return ctx.suspend("go")

    store = MemoryStore()
    Engine(store, [v1], listeners=[]).start("kept", key="old")
    engine = Engine(store, [v2], listeners=[])
    with pytest.raises(CodeVersionError, match=r"register\(old_flow, newest=False\)"):
        engine.resume("old", None)
    engine.register(v1, newest=False)
    assert engine.start("kept", key="new").code_hash == "version:2"
    assert engine.resume("old", "x").result == "x"


def test_a_version_with_a_colon_is_named_by_its_version() -> None:
    @flow(name="dated", version="2024:01")
    def old(ctx: Context, _input: Any) -> Any:
        return ctx.suspend("go")

    @flow(name="dated", version="2024:02")
    def new(ctx: Context, _input: Any) -> Any:
        return ctx.suspend("go")

    store = MemoryStore()
    Engine(store, [old], listeners=[]).start("dated", key="r")
    engine = Engine(store, [old, new], listeners=[])
    engine.replay_check("r", "2024:02")
    assert engine.resume_as("r", "2024:02").code_hash == "version:2024:02"
    with pytest.raises(UnknownFlowError, match="'version:2024:03'"):
        engine.resume_as("r", "2024:03")


@pytest.mark.usefixtures("flow_loop")
@pytest.mark.parametrize("to", ["", 5, 1.5])
def test_a_version_that_is_neither_a_flow_nor_a_name_is_refused(to: Any) -> None:
    box = sandbox(counter)
    box.engine.start("counter", 0, key="versioned")
    with pytest.raises(InvalidArgumentError, match="a version is a Flow"):
        box.engine.replay_check("versioned", to=to)


def test_a_run_of_a_flow_this_engine_does_not_register_is_left_to_one_that_does() -> None:
    """A run whose flow this engine has no version of at all: a resume is journaled
    and the run left running, not driven; recover() and a drive asked for by id
    leave it too, the drive refusing it by name (UnknownFlowError, naming what this
    engine registers); an engine with its code finishes it."""
    from loom_kernel import Engine, MemoryStore, Status
    from loom_kernel._engine import parts_of

    store = MemoryStore()
    parked = Engine(store, [order_v1], listeners=[]).start("order", key="o")

    @flow(name="refund", version="1")
    def refund(ctx: Context, _input: Any) -> Any:
        return ctx.suspend("go")

    other = Engine(store, [refund], listeners=[])
    assert other.resume(parked.id, "yes", on="manager").status is Status.RUNNING
    head = store.head(f"ex/{parked.id}")
    assert other.recover() == []
    driver = parts_of(other).driver
    with pytest.raises(UnknownFlowError, match=r"'order'.*registered: refund"):
        driver.flows.pinned(driver.view(parked.id, lambda state: state))
    assert store.head(f"ex/{parked.id}") == head
    assert Engine(store, [order_v1], listeners=[]).recover() == [parked.id]
