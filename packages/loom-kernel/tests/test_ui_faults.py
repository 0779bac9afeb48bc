"""The web view in this process: a page that fails is a 500 that says so and is logged
(never a dropped answer), `loom ui` on a port another process holds is one line and
status 1, the run list's start filter, and a tree of runs cut at the page's depth."""

from __future__ import annotations

import argparse
import socket
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
from loom_kernel import MemoryStore
from loom_kernel._hosting import _ui


def test_a_page_that_fails_is_a_500_that_says_so_and_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_args: Any) -> str:
        raise RuntimeError("a bug in a page")

    monkeypatch.setattr(_ui, "runs_page", broken)
    server = _ui.serve(MemoryStore(), "127.0.0.1", 0)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        port = server.server_address[1]
        with caplog.at_level("ERROR", logger="loom"), pytest.raises(urllib.error.HTTPError) as got:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
        assert got.value.code == 500
        assert "This page failed" in got.value.read().decode()
        assert "loom ui: GET / failed" in caplog.text
    finally:
        server.shutdown()
        server.server_close()
        serving.join(10)


def test_loom_ui_on_a_port_already_taken_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = argparse.Namespace(
            store="memory://ui-faults",
            host="127.0.0.1",
            port=taken.getsockname()[1],
            queues=[],
            allow_actions=False,
        )
        assert _ui._run(args) == 1
    assert f"loom: cannot serve on 127.0.0.1:{args.port}:" in capsys.readouterr().err


def _site_of(engine: Any) -> Any:
    from loom_kernel._hosting._ui_pages import Site

    return Site(engine, None)


def test_the_run_list_since_a_moment_shows_the_runs_started_since() -> None:
    from loom_kernel import Engine, flow
    from loom_kernel._hosting._ui_pages import runs_page

    @flow(name="ui.quick")
    def quick(_ctx: Any, _input: Any) -> int:
        return 1

    engine = Engine(MemoryStore(), [quick], listeners=[])
    engine.start("ui.quick", key="recent-run")
    shown = runs_page(_site_of(engine), {"since": ["1d"]})
    assert "recent-run" in shown, "a run started within the day is listed"


def test_a_tree_deeper_than_the_page_shows_is_cut_not_failed() -> None:
    from loom_kernel import Engine, flow
    from loom_kernel._hosting._ui_pages import TREE_DEPTH, run_page

    @flow(name="ui.leaf")
    def leaf(_ctx: Any, _input: Any) -> int:
        return 1

    engine = Engine(MemoryStore(), [leaf], listeners=[])
    run = "root"
    engine.start("ui.leaf", key=run)
    for _ in range(TREE_DEPTH + 2):
        child = f"{run}/c"
        engine.start("ui.leaf", key=child, parent=run)
        run = child
    shown = run_page(_site_of(engine), "root")
    assert "root/c/c" in shown
    assert "root" + "/c" * (TREE_DEPTH + 2) not in shown, "cut at the page's depth"
    assert "</span></li>" in shown, "the deepest run shown has nothing under it"
    assert "None" not in shown


def test_a_form_up_to_the_largest_is_read_and_one_byte_more_refused_unread() -> None:
    """An action's form of exactly 1 MiB (docs/operating.md) is read (and then judged:
    here it has no token, a 403); one byte more is a 413 before any of it is read."""
    import http.client

    server = _ui.serve(MemoryStore(), "127.0.0.1", 0, allow_actions=True)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        port = int(server.server_address[1])
        for size, expected in ((1024 * 1024, 403), (1024 * 1024 + 1, 413)):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                connection.putrequest("POST", "/runs/x/cancel")
                connection.putheader("Content-Type", "application/x-www-form-urlencoded")
                connection.putheader("Content-Length", str(size))
                connection.endheaders()
                if expected == 403:
                    connection.send(b"a" * size)
                assert connection.getresponse().status == expected, size
            finally:
                connection.close()
    finally:
        server.shutdown()
        server.server_close()
        serving.join(10)
