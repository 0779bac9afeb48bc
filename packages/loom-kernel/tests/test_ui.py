"""`loom ui` as a user starts it (a subprocess serving 127.0.0.1 on a free port): the
run list with its filters and pages, one run's facts, children and journal, a page
for what does not exist, and nothing from a run's data ever taken as markup."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loom_kernel import Context, Engine, Queue, flow, open_store

_HERE = Path(__file__).parent


@flow(name="ui.parks", version="1")
def parks(ctx: Context, _input: Any) -> Any:
    ctx.step("prepare", lambda: {"ready": True})
    ctx.set_event("progress", "<b>half</b>")
    return ctx.suspend("approve")


@flow(name="ui.fails", version="1")
def fails(ctx: Context, _input: Any) -> Any:
    raise ValueError("<script>alert(1)</script>")


def _populated(url: str) -> None:
    with open_store(url) as store:
        engine = Engine(store, [parks, fails], listeners=[], queues=[Queue("capped")])
        engine.start("ui.parks", {"note": "<i>x</i>"}, key="order-7")
        engine.start("ui.parks", None, key="order-7/c0", parent="order-7")
        engine.start("ui.parks", None, key="order-7/c0/c0", parent="order-7/c0")
        for number in range(55):
            engine.start("ui.fails", key=f"bad-{number:02d}")
        engine.enqueue("ui.parks", None, key="waits", queue="capped")


@contextlib.contextmanager
def _serving(url: str, *options: str) -> Iterator[str]:
    server = subprocess.Popen(
        [sys.executable, "-m", "loom_kernel", "ui", "--port", "0", *options],
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "LOOM_STORE": url,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(_HERE), os.environ.get("PYTHONPATH")])),
        },
    )
    try:
        assert server.stderr is not None
        line = server.stderr.readline()
        assert line.startswith("loom ui: serving http://127.0.0.1:"), line
        yield line.split()[3]
    finally:
        server.terminate()
        server.wait(30)


@pytest.fixture
def site(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path}/ui.db"
    _populated(url)
    with _serving(url) as address:
        yield address


@pytest.fixture
def acting(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path}/ui.db"
    _populated(url)
    with _serving(url, "--allow-actions", "--queues", "ui_queues:QUEUES") as address:
        yield address


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
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["Referrer-Policy"] == "same-origin"
    assert page.count("<tr><td>") == 50, "a page of 50"
    assert "/runs/bad-00" in page
    assert "Next page" in page
    _, second, _ = _get(site + "?after=bad-49")
    assert "/runs/bad-50" in second
    assert "/runs/order-7/c0" not in second, "ids are quoted in links"
    assert "/runs/order-7%2Fc0" in second
    _, suspended, _ = _get(site + "?status=suspended")
    assert suspended.count("<tr><td>") == 3
    assert "bad-00" not in suspended
    _, by_flow, _ = _get(site + "?flow=ui.parks&status=")
    assert by_flow.count("<tr><td>") == 4
    _, recent, _ = _get(site + "?since=1h")
    assert "bad-00" in recent, "started within the hour"
    _, future, _ = _get(site + "?since=2999-01-01T00:00Z")
    assert "No runs." in future
    code, bad_since, _ = _get(site + "?since=soon")
    assert code == 400
    assert "since is" in bad_since
    code, refused, _ = _get(site + "?status=done")
    assert code == 400
    assert "status is one of" in refused


def test_one_run_shows_its_facts_children_and_journal_with_nothing_as_markup(site: str) -> None:
    status, page, _ = _get(site + "runs/order-7")
    assert status == 200
    assert "suspended" in page
    assert "/runs/order-7%2Fc0" in page, "its child, linked"
    assert "/runs/order-7%2Fc0%2Fc0" in page, "and its child's child: the tree"
    assert "<form method='post'" not in page, "read-only: no form that acts"
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


def _post(address: str, fields: dict[str, str], origin: str | None = None) -> tuple[int, str, str]:
    data = urllib.parse.urlencode(fields).encode()
    request = urllib.request.Request(address, data=data, method="POST")
    if origin is not None:
        request.add_header("Origin", origin)
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(request, timeout=30) as answer:
            return answer.status, answer.read().decode(), answer.headers.get("Location", "")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(), error.headers.get("Location", "")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any) -> None:
        return None


def test_a_read_only_view_refuses_every_action(site: str) -> None:
    code, page, _ = _post(site + "runs/order-7/cancel", {"token": "x"})
    assert code == 405
    assert "read-only" in page


def test_actions_need_the_views_token_and_its_own_origin(acting: str) -> None:
    _, page, _ = _get(acting + "runs/order-7")
    token = re.search(r"name='token' value='([^']+)'", page)
    assert token is not None, "a form carries the token"
    cancel = acting + "runs/order-7/cancel"
    assert _post(cancel, {"token": "forged"})[0] == 403
    assert _post(cancel, {"token": token[1]}, origin="http://evil.example")[0] == 403
    code, _, where = _post(cancel, {"token": token[1], "reason": "<b>by hand</b>"})
    assert code == 303
    assert where.startswith("/runs/order-7?done=")
    _, cancelled, _ = _get(acting + "runs/order-7")
    assert "cancelled" in cancelled
    assert "&lt;b&gt;by hand&lt;/b&gt;" in cancelled
    code, _, where = _post(acting + "runs/order-7/retry", {"token": token[1], "from_step": "1"})
    assert code == 303, where
    _, again, _ = _get(acting + where.lstrip("/"))
    assert "Started again from" in again
    code, _, _ = _post(
        acting + "runs/order-7%2Fc0/send", {"token": token[1], "message": '"hi"', "topic": "t"}
    )
    assert code == 303
    _, child, _ = _get(acting + "runs/order-7%2Fc0")
    assert "&quot;hi&quot;" in child, "the message, in its inbox"
    code, refused, _ = _post(
        acting + "runs/order-7%2Fc0/send", {"token": token[1], "message": "not json"}
    )
    assert code == 400
    assert "is JSON" in refused
    for step in ("x", "1.5", "-1"):
        code, refused, _ = _post(
            acting + "runs/order-7/retry", {"token": token[1], "from_step": step}
        )
        assert (code, "from_step is a whole number" in refused) == (400, True), step


def test_the_queues_page_shows_limits_and_what_waits(acting: str, site: str) -> None:
    _, page, _ = _get(acting + "queues")
    assert "capped" in page
    assert "concurrency 3" in page
    assert "/runs/waits" in page
    _, none, _ = _get(site + "queues")
    assert "--queues" in none


def _raw(address: str, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> int:
    import http.client

    parts = urllib.parse.urlsplit(address)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.endheaders(body)
        return connection.getresponse().status
    finally:
        connection.close()


def test_the_view_answers_to_its_own_address_only(acting: str) -> None:
    """A page that reached the view through a rebound DNS name names another host:
    refused, reading and acting alike (the Origin is checked against the view's own
    names, never against what the request says its host is)."""
    own = urllib.parse.urlsplit(acting).netloc
    assert _raw(acting, "GET", "/runs/order-7", {"Host": own}) == 200
    assert _raw(acting, "GET", "/runs/order-7", {"Host": "evil.example:1"}) == 421
    parts = urllib.parse.urlsplit(acting)
    with socket.create_connection((parts.hostname or "", parts.port or 0), timeout=30) as raw:
        raw.sendall(b"GET /runs/order-7 HTTP/1.0\r\nHost: evil.example:1\r\n\r\n")
        answer = b"".join(iter(lambda: raw.recv(65536), b""))
    assert answer.count(b"HTTP/1.") == 1, "one answer, the refusal, and no page after it"
    assert b"order-7" not in answer
    forged = {"Host": "evil.example:1", "Origin": "http://evil.example:1"}
    assert _raw(acting, "POST", "/runs/order-7/cancel", forged) == 421
    bad_length = {"Host": own, "Content-Length": "-1"}
    assert _raw(acting, "POST", "/runs/order-7/cancel", bad_length) == 400
    _, page, _ = _get(acting + "runs/order-7")
    assert "suspended" in page, "nothing acted"


def test_odd_queries_are_a_400_and_a_done_code_cannot_put_words_on_a_page(site: str) -> None:
    for query in ("?since=%C2%B2d", "?since=" + "9" * 400 + "d", "?since=" + "9" * 5000 + "d"):
        code, said, _ = _get(site + query)
        assert code == 400, query
        assert "<p>InvalidArgumentError: " in said, "the page says why"
    _, page, _ = _get(site + "runs/order-7?done=Session+expired:+log+in+at+evil.example")
    assert "evil.example" not in page
    _, sent, _ = _get(site + "runs/order-7?done=sent&n=3")
    assert "Message 3 is in its inbox" in sent


def test_actions_are_refused_on_an_address_other_than_loopback(tmp_path: Path) -> None:
    from loom_kernel import InvalidArgumentError
    from loom_kernel._hosting._ui import serve

    with (
        open_store(f"sqlite:///{tmp_path}/ui.db") as store,
        pytest.raises(InvalidArgumentError, match="this machine only"),
    ):
        serve(store, "0.0.0.0", 0, allow_actions=True)
