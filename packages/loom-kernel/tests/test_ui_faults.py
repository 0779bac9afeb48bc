"""The web view's own faults, served in this process: a page that fails is a 500 that
says so and is logged (never a dropped answer), and `loom ui` on a port another
process holds is one line and status 1."""

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
