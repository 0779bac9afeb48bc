"""`loom ui` as a user starts it (a subprocess serving 127.0.0.1 on a free port): the
run list with its filters and pages, one run's facts, children and journal, a page
for what does not exist, and nothing from a run's data ever taken as markup."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loom_kernel import Context, Engine, flow, open_store


@flow(name="ui.parks", version="1")
def parks(ctx: Context, _input: Any) -> Any:
    ctx.step("prepare", lambda: {"ready": True})
    ctx.set_event("progress", "<b>half</b>")
    return ctx.suspend("approve")


@flow(name="ui.fails", version="1")
def fails(ctx: Context, _input: Any) -> Any:
    raise ValueError("<script>alert(1)</script>")


@pytest.fixture
def site(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path}/ui.db"
    with open_store(url) as store:
        engine = Engine(store, [parks, fails], listeners=[])
        engine.start("ui.parks", {"note": "<i>x</i>"}, key="order-7")
        engine.start("ui.parks", None, key="order-7/c0", parent="order-7")
        for number in range(55):
            engine.start("ui.fails", key=f"bad-{number:02d}")
    server = subprocess.Popen(
        [sys.executable, "-m", "loom_kernel", "ui", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LOOM_STORE": url},
    )
    try:
        assert server.stderr is not None
        line = server.stderr.readline()
        assert line.startswith("loom ui: serving http://127.0.0.1:"), line
        yield line.split()[3]
    finally:
        server.terminate()
        server.wait(30)


def _get(address: str) -> tuple[int, str, dict[str, str]]:
    try:
        with urllib.request.urlopen(address, timeout=30) as answer:
            return answer.status, answer.read().decode(), dict(answer.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(), dict(error.headers)


def test_the_run_list_pages_and_filters(site: str) -> None:
    status, page, headers = _get(site)
    assert status == 200
    assert headers["Content-Security-Policy"].startswith("default-src 'none'")
    assert page.count("<tr><td>") == 50, "a page of 50"
    assert "/runs/bad-00" in page
    assert "Next page" in page
    _, second, _ = _get(site + "?after=bad-49")
    assert "/runs/bad-50" in second
    assert "/runs/order-7/c0" not in second, "ids are quoted in links"
    assert "/runs/order-7%2Fc0" in second
    _, suspended, _ = _get(site + "?status=suspended")
    assert suspended.count("<tr><td>") == 2
    assert "bad-00" not in suspended
    _, by_flow, _ = _get(site + "?flow=ui.parks&status=")
    assert by_flow.count("<tr><td>") == 2
    code, refused, _ = _get(site + "?status=done")
    assert code == 400
    assert "status is one of" in refused


def test_one_run_shows_its_facts_children_and_journal_with_nothing_as_markup(site: str) -> None:
    status, page, _ = _get(site + "runs/order-7")
    assert status == 200
    assert "suspended" in page
    assert "/runs/order-7%2Fc0" in page, "its child, linked"
    assert "&lt;b&gt;half&lt;/b&gt;" in page, "published, escaped"
    assert "&lt;i&gt;x&lt;/i&gt;" in page, "the input, escaped"
    assert "<i>" not in page
    assert "<b>" not in page
    assert "started" in page, "the journal's timeline"
    _, failed, _ = _get(site + "runs/bad-03")
    assert "&lt;script&gt;" in failed
    assert "<script>" not in failed
    code, missing, _ = _get(site + "runs/nobody")
    assert code == 404
    assert "nobody" in missing
    code, _, _ = _get(site + "elsewhere")
    assert code == 404


def test_a_store_that_cannot_be_opened_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loom_kernel", "ui", "--store", f"sqlite:///{tmp_path}/no.db"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "no SQLite database at" in done.stderr
