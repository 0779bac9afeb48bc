"""`loom ui`: a read-only web view of a store, served by the standard library's HTTP
server from 127.0.0.1: the runs (filtered by status and flow, a page at a time) and
one run as `loom describe` and `loom show` see it. No script, no form that changes
anything: every page only reads.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
import urllib.parse
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import islice
from typing import Any, Final

from loom_kernel._core import (
    EXECUTION_PREFIX,
    ExecutionNotFoundError,
    InvalidArgumentError,
    LoomError,
    Status,
)
from loom_kernel._engine import Engine, Execution, parts_of
from loom_kernel._hosting._operate import described
from loom_kernel._hosting._store_option import add_store_option
from loom_kernel._spi import JournalStore, open_store
from loom_kernel._tools import format_timeline

__all__ = ["add_ui_command", "serve"]

PAGE: Final = 50
#: No script, no outside resource: the page's own style only.
_POLICY: Final = "default-src 'none'; style-src 'unsafe-inline'"
_STATUSES: Final = tuple(status.value for status in Status)
_STYLE: Final = (
    "body{font-family:system-ui,sans-serif;margin:2em;color:#222}"
    "table{border-collapse:collapse}td,th{padding:.2em .8em;text-align:left;"
    "border-bottom:1px solid #ddd}pre{background:#f6f6f6;padding:1em;overflow-x:auto}"
    ".failed{color:#b00}.completed{color:#070}.cancelled{color:#777}"
    ".suspended{color:#a60}.running{color:#06c}nav a{margin-right:1em}"
)


def add_ui_command(commands: Any) -> dict[str, Any]:
    """Add `loom ui` to the `loom` command's subparsers."""
    ui = commands.add_parser("ui", help="a read-only web view of the runs in a store")
    add_store_option(ui)
    ui.add_argument("--host", default="127.0.0.1", help="address to serve on (default: local only)")
    ui.add_argument("--port", type=int, default=8765, help="port (0: any free one)")
    return {"ui": _run}


def _run(args: argparse.Namespace) -> int:
    try:
        with open_store(args.store, create=False) as store:
            server = serve(store, args.host, args.port)
            host, port = str(server.server_address[0]), int(server.server_address[1])
            print(f"loom ui: serving http://{host}:{port}/ (Ctrl-C stops it)", file=sys.stderr)
            sys.stderr.flush()
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                pass
            finally:
                server.server_close()
    except LoomError as exc:
        print(f"loom: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the port is taken, the address is not this machine's
        print(f"loom: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


def serve(store: JournalStore, host: str, port: int) -> ThreadingHTTPServer:
    """A server of the web view of `store` (not started: call `serve_forever`)."""
    engine = Engine(store, listeners=[])

    class Pages(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            try:
                if url.path == "/":
                    status, body = HTTPStatus.OK, _runs_page(engine, query)
                elif url.path.startswith("/runs/"):
                    run = urllib.parse.unquote(url.path.removeprefix("/runs/"))
                    status, body = HTTPStatus.OK, _run_page(engine, run)
                else:
                    status, body = HTTPStatus.NOT_FOUND, _page("Not found", "<p>No such page.</p>")
            except ExecutionNotFoundError as exc:
                status, body = HTTPStatus.NOT_FOUND, _page("Not found", _p(str(exc)))
            except LoomError as exc:  # a bad id, a damaged journal, a store fault
                status = HTTPStatus.BAD_REQUEST
                body = _page("Cannot show this", _p(f"{type(exc).__name__}: {exc}"))
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.send_header(
                "Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'"
            )
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return  # quiet: an operator's page, not an access log

    return ThreadingHTTPServer((host, port), Pages)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _p(text: str) -> str:
    return f"<p>{_e(text)}</p>"


def _page(title: str, body: str) -> str:
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{_e(title)} · Loom</title><style>{_STYLE}</style></head><body>"
        "<nav><a href='/'>Runs</a></nav>"
        f"<h1>{_e(title)}</h1>{body}</body></html>"
    )


def _link(run: str) -> str:
    return f"<a href='/runs/{urllib.parse.quote(run, safe='')}'>{_e(run)}</a>"


def _one(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[0] if values and values[0] else None


def _listed(
    engine: Engine, status: str | None, flow: str | None, after: str | None
) -> Iterator[Execution]:
    if status is None and flow is None:
        # Straight from the store's listing, from the page's first id on.
        store, cursor = engine.store, None if after is None else EXECUTION_PREFIX + after
        while names := store.streams(EXECUTION_PREFIX, cursor, PAGE + 1):
            for name in names:
                try:
                    yield engine.get(name.removeprefix(EXECUTION_PREFIX))
                except ExecutionNotFoundError:
                    continue
            cursor = names[-1]
        return
    for execution in parts_of(engine).reading.listing("", status, flow):
        if after is None or execution.id > after:
            yield execution


def _runs_page(engine: Engine, query: dict[str, list[str]]) -> str:
    status, flow, after = _one(query, "status"), _one(query, "flow"), _one(query, "after")
    if status is not None and status not in _STATUSES:
        raise InvalidArgumentError(f"status is one of {', '.join(_STATUSES)}, not {status!r}")
    rows = list(islice(_listed(engine, status, flow, after), PAGE + 1))
    shown, more = rows[:PAGE], len(rows) > PAGE
    options = "".join(
        f"<option{' selected' if value == status else ''}>{_e(value)}</option>"
        for value in ("", *_STATUSES)
    )
    form = (
        "<form method='get' action='/'>status <select name='status'>"
        f"{options}</select> flow <input name='flow' value='{_e(flow or '')}'> "
        "<button>Filter</button></form>"
    )
    lines = "".join(
        f"<tr><td>{_link(run.id)}</td><td>{_e(run.flow)}</td>"
        f"<td class='{_e(run.status.value)}'>{_e(run.status.value)}</td>"
        f"<td>{_e(run.waiting_on or '')}</td></tr>"
        for run in shown
    )
    table = (
        "<table><tr><th>Run</th><th>Flow</th><th>Status</th><th>Waiting on</th></tr>"
        f"{lines}</table>"
        if shown
        else "<p>No runs.</p>"
    )
    paging = ""
    if more:
        onward = {"after": shown[-1].id, **({"status": status} if status else {})}
        if flow:
            onward["flow"] = flow
        paging = f"<p><a href='/?{_e(urllib.parse.urlencode(onward))}'>Next page</a></p>"
    return _page("Runs", form + table + paging)


def _run_page(engine: Engine, run: str) -> str:
    execution = engine.get(run)
    data = described(engine, execution)
    facts = [
        ("Flow", f"{data['flow']} ({data['code'] or 'no code pinned yet'})"),
        ("Status", data["status"]),
        ("Waiting on", data["waiting_on"] or ""),
        ("Wakes at", data["wake_at"] or ""),
        ("Driven by", data["owner"] or ""),
        ("Parent", _link(data["parent"]) if data["parent"] else ""),
        ("Started again from", _link(data["retry_of"]) if data["retry_of"] else ""),
        ("Input", f"<code>{_e(_json(data['input']))}</code>"),
    ]
    if data["status"] == "completed":
        facts.append(
            ("Result", f"<code>{_e(json.dumps(data['result'], ensure_ascii=False))}</code>")
        )
    if data["error"]:
        facts.append(("Error", _e(f"{data['error']['type']}: {data['error']['message']}")))
    if data["cancel_reason"]:
        facts.append(("Cancelled", _e(data["cancel_reason"])))
    inbox = data["inbox"]
    facts.append(("Inbox", f"{inbox['messages']} message(s), {inbox['unread']} unread"))
    table = "".join(
        f"<tr><th>{_e(name)}</th><td>{value if name in _HTML_FACTS else _e(value)}</td></tr>"
        for name, value in facts
        if value
    )
    children = "".join(
        f"<li>{_link(child['id'])} ({_e(child['flow'])}): "
        f"<span class='{_e(child['status'])}'>{_e(child['status'])}</span></li>"
        for child in data["children"]
    )
    published = "".join(
        f"<tr><th>{_e(key)}</th><td><code>{_e(_json(value))}</code></td></tr>"
        for key, value in data["published"].items()
    )
    body = f"<table>{table}</table>"
    if children:
        body += f"<h2>Children</h2><ul>{children}</ul>"
    if published:
        body += f"<h2>Published</h2><table>{published}</table>"
    body += f"<h2>Journal</h2><pre>{_e(format_timeline(engine.history(run)))}</pre>"
    return _page(run, body)


#: The facts whose values are HTML already (links, escaped code).
_HTML_FACTS: Final = frozenset(
    {"Parent", "Started again from", "Input", "Result", "Error", "Cancelled"}
)
