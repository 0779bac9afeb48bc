"""Stores are found by URL scheme; the loom command lists and checks them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from loom_kernel import MemoryStore, NotFoundError, open_store
from loom_kernel._hosting._cli import main
from loom_kernel._spi import _registry
from loom_kernel.spi import InvalidArgumentError, JournalStore, installed_stores, register_store
from loom_kernel.testing import records


def test_memory_is_built_in() -> None:
    assert isinstance(open_store("memory://"), MemoryStore)
    assert installed_stores()["memory"] == "built-in"


def test_memory_opens_with_no_entry_points_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel on a path with no installed metadata (vendored, PYTHONPATH): its own
    reference store still opens."""
    monkeypatch.setattr(_registry, "_entry_points", dict)
    assert isinstance(open_store("memory://"), MemoryStore)
    listed = installed_stores()
    assert listed["memory"] == "built-in"
    assert "sqlite" not in listed, "no entry point is read"


def test_private_memory_stores_are_separate_and_named_ones_shared() -> None:
    first, second = open_store("memory://"), open_store("memory://")
    first.append("s", 0, records(1))
    assert second.head("s") == 0
    named = open_store("memory://registry-test")
    named.append("s", 0, records(2))
    assert open_store("memory://registry-test").head("s") == 2


def test_unknown_scheme_names_installed_ones_and_the_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(NotFoundError, match=r"no store for scheme 'nosuch' \(installed: .*memory"):
        open_store("nosuch://x")
    monkeypatch.setitem(_registry._KNOWN_DISTRIBUTIONS, "zz", "loom-store-zz")
    with pytest.raises(NotFoundError, match="install the loom-store-zz distribution"):
        open_store("zz://bucket/prefix")


@pytest.mark.parametrize("url", ["", "memory", 3, "memory://x/y", "memory://?a=1"])
def test_malformed_urls_are_refused(url: object) -> None:
    with pytest.raises(InvalidArgumentError):
        open_store(url)  # type: ignore[arg-type]


def test_register_store_adds_a_scheme_at_run_time() -> None:
    opened: list[str] = []

    def factory(url: str) -> JournalStore:
        opened.append(url)
        return MemoryStore()

    register_store("custom", factory)
    assert isinstance(open_store("custom://anything"), MemoryStore)
    assert opened == ["custom://anything"]
    assert installed_stores()["custom"] == "registered"
    with pytest.raises(InvalidArgumentError):
        register_store("Bad Scheme", factory)


def test_loom_stores_checks_each_store(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stores"]) == 0
    out = capsys.readouterr().out
    assert "memory://" in out
    assert "append+read round trip ok" in out
    scratch = [line.split()[0] for line in out.splitlines() if "sqlite://" in line and ":" in line]
    checked = [url for url in scratch if url.endswith("check.db:")]
    assert checked, out  # the SQLite store was checked in a scratch file...
    path = Path("/" + checked[0].removeprefix("sqlite:///").removesuffix(":"))
    assert not path.parent.exists()  # ...which is gone afterwards


def test_loom_stores_reports_a_failing_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stores", "nosuch://x"]) == 1
    assert "FAILED: NotFoundError" in capsys.readouterr().out


def test_loom_demo_runs_the_approval_flow_and_prints_its_timeline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--store", "memory://"]) == 0
    out = capsys.readouterr().out
    assert "waiting on 'manager'" in out
    assert "timer fired" in out
    assert "completed  →" in out
    assert "Starting it again with the same key returns the same run: completed." in out


def test_loom_ls_and_show_read_any_store(capsys: pytest.CaptureFixture[str]) -> None:
    from loom_kernel import Engine, flow

    url = "memory://cli-inspect"
    engine = Engine(open_store(url), [flow(lambda ctx, _i: ctx.suspend("sign"), name="contract")])
    engine.start("contract", {"id": 1}, key="c-1")
    assert main(["ls", "--store", url]) == 0
    assert "c-1" in capsys.readouterr().out
    assert main(["show", "c-1", "--store", url]) == 0
    out = capsys.readouterr().out
    assert "c-1: contract, suspended" in out
    assert "waiting on 'sign'" in out
    assert main(["show", "missing", "--store", url]) == 1
    assert "ExecutionNotFoundError" in capsys.readouterr().err


def test_loom_show_names_what_a_run_published_and_its_deletion(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from loom_kernel import Engine, Retention, flow

    def publishes(ctx: Any, _input: object) -> int:
        ctx.set_event("status", {"stage": "half"})
        return 1

    url = "memory://cli-published"
    engine = Engine(open_store(url), [flow(publishes, name="publishes")], listeners=[])
    engine.start("publishes", key="p-1")
    assert main(["show", "p-1", "--store", url]) == 0
    out = capsys.readouterr().out
    assert 'published status (now {"stage": "half"})' in out
    assert "-> null" not in out
    assert "→ null" not in out
    engine.gc(Retention(keep_last=0))
    engine.start("publishes", key="p-1")
    assert main(["show", "p-1", "--store", url]) == 0
    assert "deleted    by retention; a start with its id is run 2" in capsys.readouterr().out


def test_loom_ls_filters_by_status_and_flow(capsys: pytest.CaptureFixture[str]) -> None:
    from loom_kernel import Engine, flow

    def broken(_ctx: object, _input: object) -> None:
        raise ValueError("no")

    url = "memory://cli-filter"
    engine = Engine(
        open_store(url),
        [
            flow(lambda ctx, _i: ctx.suspend("sign"), name="contract"),
            flow(broken, name="broken"),
        ],
        listeners=[],
    )
    engine.start("contract", key="parked-1")
    engine.start("broken", key="failed-1")
    assert main(["ls", "--store", url, "--status", "failed"]) == 0
    out = capsys.readouterr().out
    assert "failed-1" in out
    assert "parked-1" not in out
    assert main(["ls", "--store", url, "--flow", "contract"]) == 0
    out = capsys.readouterr().out
    assert "parked-1" in out
    assert "failed-1" not in out
    with pytest.raises(SystemExit):
        main(["ls", "--store", url, "--status", "done"])


def test_loom_worker_refuses_flows_it_cannot_load(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--store", "memory://w", "--flows", "no_such_module:FLOWS"]) == 1
    err = capsys.readouterr().err
    assert "cannot load flows" in err
    assert "no module named 'no_such_module' in the current directory" in err
    assert "name the module by its package path" in err, "and how to fix the path"


def test_flows_are_looked_for_in_the_current_directory_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`loom worker --flows flows:FLOWS` run where flows.py is, as uvicorn and celery
    are: the module is found there, with no PYTHONPATH."""
    import sys

    from loom_kernel._hosting._deploy import load_flows

    (tmp_path / "cwd_flows.py").write_text(
        "from loom_kernel import flow\n"
        "@flow(name='here')\n"
        "def here(ctx, _input):\n"
        "    return 1\n"
        "FLOWS = [here]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert [f.name for f in load_flows("cwd_flows:FLOWS")] == ["here"]
    finally:
        sys.modules.pop("cwd_flows", None)


def test_something_that_is_not_a_flow_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from loom_kernel._hosting._deploy import load_flows

    with pytest.raises(InvalidArgumentError, match=r"names posixpath\.join, which is not a flow"):
        load_flows("os.path:join")
    (tmp_path / "no_flows_here.py").write_text("FLOWS: list[object] = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(InvalidArgumentError, match="empty list: it names no flow"):
            load_flows("no_flows_here:FLOWS")
    finally:
        sys.modules.pop("no_flows_here", None)


def test_loom_ls_goes_on_past_a_damaged_run_and_says_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from loom_kernel import Engine, flow
    from loom_kernel.spi import NewRecord

    url = "memory://cli-damaged"
    store = open_store(url)
    engine = Engine(store, [flow(lambda ctx, _i: ctx.suspend("sign"), name="contract")])
    for key in ("a-1", "b-1", "c-1"):
        engine.start("contract", key=key)
    store.append("ex/b-1", store.head("ex/b-1"), [NewRecord("STEP_COMPLETED", b"{bad", 1.0)])
    assert main(["ls", "--store", url]) == 1
    captured = capsys.readouterr()
    assert "a-1" in captured.out
    assert "c-1" in captured.out, "listed past the damaged run"
    assert "loom: b-1: SchemaError" in captured.err


def test_loom_refuses_flows_whose_module_fails_to_import_without_a_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "raises_at_import.py").write_text("raise RuntimeError('no config')\n")
    (tmp_path / "bad_syntax.py").write_text("def (:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, said in (
        ("raises_at_import:FLOWS", "RuntimeError: no config"),
        ("bad_syntax:FLOWS", "SyntaxError"),
        (".relative:FLOWS", "cannot load flows"),
        ("os:getcwd", "which is not a flow"),
        ("os.path:join", "names posixpath.join, which is not a flow"),
    ):
        assert main(["worker", "--store", "memory://w", "--flows", spec]) == 1
        assert said in capsys.readouterr().err


def test_loom_demo_on_a_store_it_cannot_open_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["demo", "--store", f"sqlite://{tmp_path}/no/such/dir/x.db"]) == 1
    assert "loom: StoreMisconfiguredError" in capsys.readouterr().err


def test_a_store_factory_that_cannot_be_called_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="must be callable"):
        register_store("notcallable", "sqlite")  # type: ignore[arg-type]


def test_loom_ls_into_a_pipe_closed_early_ends_quietly(tmp_path: Path) -> None:
    """`loom ls | head -1`: the reader goes away; no traceback on stderr."""
    import subprocess
    import sys

    from loom_kernel import Engine, flow

    url = f"sqlite://{tmp_path}/many.db"
    with open_store(url) as store:
        engine = Engine(store, [flow(lambda ctx, _i: ctx.suspend("sign"), name="contract")])
        for number in range(500):  # long ids: more than a pipe's buffer of lines
            engine.start("contract", key=f"run-{number:05d}-" + "x" * 150)
    listing = subprocess.Popen(
        [sys.executable, "-m", "loom_kernel", "ls", "--store", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert listing.stdout is not None
    header, first = listing.stdout.readline(), listing.stdout.readline()
    listing.stdout.close()
    _out, err = listing.communicate(timeout=60)
    assert header.split() == [b"ID", b"FLOW", b"STATUS", b"STARTED", b"ENDED", b"WAITING", b"ON"]
    assert first.startswith(b"run-00")
    assert b"Traceback" not in err, err.decode()


def test_loom_gc_takes_its_retention_and_blob_options(capsys: pytest.CaptureFixture[str]) -> None:
    from loom_kernel import Engine, flow

    def once(_ctx: Any, _input: object) -> int:
        return 1

    def waits(ctx: Any, _input: object) -> Any:
        return ctx.receive()

    url = "memory://cli-gc"
    engine = Engine(open_store(url), [flow(once, name="once")], listeners=[])
    for number in range(3):
        engine.start("once", key=f"g-{number}")
    parked = Engine(open_store(url), [flow(waits, name="waits")], listeners=[])
    parked.start("waits", key="w")
    assert main(["send", "w", '"hello"', "--store", url]) == 0, "a send that landed is a 0"
    assert "w: message 1 in its inbox" in capsys.readouterr().out
    assert main(["gc", "--store", url, "--keep-last", "1"]) == 0
    assert len(engine.runs(status="completed")) == 1, "the newest one kept"
    capsys.readouterr()
    # Parsed (not argparse's exit 2), and refused by the store: no blobs here.
    assert main(["gc", "--store", url, "--keep-last", "1", "--blobs", "--grace", "0s"]) == 1
    assert "the store has no blob store" in capsys.readouterr().err
