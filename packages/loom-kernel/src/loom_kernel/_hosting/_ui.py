"""`loom ui`: a web view of a store, served by the standard library's HTTP server from
127.0.0.1: the runs (filtered by status, flow and start time, a page at a time), one
run as `loom describe` and `loom show` see it with the runs under it, and the queues.

Read-only unless started with `--allow-actions`: then a run's page has forms to cancel
it, send it a message or start it again. An action is a POST that must carry the
token this server made at its start (in every form it draws) and, when the browser
says where the request comes from (Origin), come from this server's own pages: a page
elsewhere cannot make a browser act here.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import secrets
import sys
import urllib.parse
from collections.abc import Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from loom_kernel._coordination import Queue
from loom_kernel._core import ExecutionNotFoundError, InvalidArgumentError, LoomError
from loom_kernel._engine import Engine
from loom_kernel._hosting._deploy import load_queues
from loom_kernel._hosting._store_option import add_store_option
from loom_kernel._hosting._ui_pages import (
    PAGE,
    Site,
    not_found,
    page,
    queues_page,
    run_page,
    runs_page,
)
from loom_kernel._spi import JournalStore, open_store

__all__ = ["PAGE", "add_ui_command", "serve"]

logger = logging.getLogger("loom")

#: No script, no outside resource: the page's own style only (and its own forms).
_POLICY: Final = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'"
#: The largest form an action takes (a message, its topic and key).
_LARGEST_FORM: Final = 1024 * 1024


def add_ui_command(commands: Any) -> dict[str, Any]:
    """Add `loom ui` to the `loom` command's subparsers."""
    ui = commands.add_parser("ui", help="a web view of the runs in a store (read-only by default)")
    add_store_option(ui)
    ui.add_argument("--host", default="127.0.0.1", help="address to serve on (default: local only)")
    ui.add_argument("--port", type=int, default=8765, help="port (0: any free one)")
    ui.add_argument(
        "--queues",
        action="append",
        default=[],
        help="module:attribute naming a Queue or a list of queues (repeatable), for the "
        "queues page: their limits live in code",
    )
    ui.add_argument(
        "--allow-actions",
        action="store_true",
        help="draw forms that cancel a run, send it a message or start it again (served on "
        "this machine's loopback only: the view has no login)",
    )
    return {"ui": _run}


def _run(args: argparse.Namespace) -> int:
    try:
        queues = [item for spec in args.queues for item in load_queues(spec)]
        with open_store(args.store, create=False) as store:
            server = serve(
                store, args.host, args.port, queues=queues, allow_actions=args.allow_actions
            )
            host, port = str(server.server_address[0]), int(server.server_address[1])
            mode = "actions allowed" if args.allow_actions else "read-only"
            print(
                f"loom ui: serving http://{host}:{port}/ ({mode}; Ctrl-C stops it)",
                file=sys.stderr,
            )
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


def serve(
    store: JournalStore,
    host: str,
    port: int,
    *,
    queues: Iterable[Queue] = (),
    allow_actions: bool = False,
) -> ThreadingHTTPServer:
    """A server of the web view of `store` (not started: call `serve_forever`).

    Raises:
        InvalidArgumentError: actions asked of a server on another address than this
            machine's own (anyone who reaches the port could act: the token in its
            forms guards against other pages, it is no password).
    """
    if allow_actions and host not in _LOOPBACK:
        raise InvalidArgumentError(
            f"actions are served on this machine only ({', '.join(sorted(_LOOPBACK))}), "
            f"not on {host!r}: the view has no login, so anyone who reached it could act"
        )
    site = Site(
        Engine(store, listeners=[], queues=queues),
        secrets.token_urlsafe(24) if allow_actions else None,
    )
    names: set[str] = set()  # the Host headers this server answers, once it is bound

    class Pages(BaseHTTPRequestHandler):
        timeout = 30  # a client that stalls mid-request lets go of its thread

        def do_GET(self) -> None:
            if not self._ours():
                return
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            self._answer(lambda: _get(site, url.path, query))

        def _ours(self) -> bool:
            """Whether the request names this server (on this machine's loopback, a
            page of another name that reached it through a rebound DNS name is refused)."""
            if not names or self.headers.get("Host", "") in names:
                return True
            self._send(HTTPStatus.MISDIRECTED_REQUEST, page("Refused", _OTHER_HOST))
            return False

        def do_POST(self) -> None:
            if not self._ours():
                return
            if site.token is None:
                self._send(HTTPStatus.METHOD_NOT_ALLOWED, page("Read-only", _READ_ONLY))
                return
            origin = self.headers.get("Origin")
            if origin is not None and origin not in {f"http://{name}" for name in names}:
                self._send(HTTPStatus.FORBIDDEN, page("Refused", _OTHER_ORIGIN))
                return
            length_text = self.headers.get("Content-Length") or "0"
            if not re.fullmatch(r"[0-9]{1,9}", length_text):
                self._send(HTTPStatus.BAD_REQUEST, page("Refused", _BAD_LENGTH))
                return
            length = int(length_text)
            if length > _LARGEST_FORM:
                self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, page("Refused", _TOO_LARGE))
                return
            form = urllib.parse.parse_qs(self.rfile.read(length).decode("utf-8", "replace"))
            if not secrets.compare_digest(_field(form, "token") or "", site.token):
                self._send(HTTPStatus.FORBIDDEN, page("Refused", _WITHOUT_TOKEN))
                return
            path = urllib.parse.urlsplit(self.path).path
            self._answer(lambda: _act(site, path, form), redirect=True)

        def _answer(self, make: Any, *, redirect: bool = False) -> None:
            try:
                status, body = make()
            except ExecutionNotFoundError as exc:
                status, body = HTTPStatus.NOT_FOUND, not_found(str(exc))
            except LoomError as exc:  # a bad id, a damaged journal, a store fault
                status = HTTPStatus.BAD_REQUEST
                body = page("Cannot do this", f"<p>{_escape(type(exc).__name__, exc)}</p>")
            except Exception:  # a page's own fault: said, logged, never a dropped answer
                logger.exception("loom ui: %s %s failed", self.command, self.path)
                status = HTTPStatus.INTERNAL_SERVER_ERROR
                body = page("Failed", "<p>This page failed; the server's log says why.</p>")
            if redirect and status == HTTPStatus.SEE_OTHER:
                self.send_response(status)
                self.send_header("Location", body)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self._send(status, body)

        def _send(self, status: HTTPStatus, body: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Content-Security-Policy", _POLICY)
            self.send_header("X-Frame-Options", "DENY")
            # same-origin, not no-referrer: with no-referrer a browser sends its form posts
            # with "Origin: null", which the origin check must refuse.
            self.send_header("Referrer-Policy", "same-origin")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return  # quiet: an operator's page, not an access log

    server = ThreadingHTTPServer((host, port), Pages)
    if host in _LOOPBACK:
        bound = int(server.server_address[1])
        names.update(f"{name}:{bound}" for name in ("127.0.0.1", "localhost", "[::1]"))
    return server


_LOOPBACK: Final = frozenset({"127.0.0.1", "localhost", "::1"})
_OTHER_HOST: Final = "<p>This view answers to its own address only.</p>"
_BAD_LENGTH: Final = "<p>That request's length is not a number of bytes.</p>"
_READ_ONLY: Final = "<p>This view is read-only: start loom ui with --allow-actions to act.</p>"
_OTHER_ORIGIN: Final = "<p>An action comes from this view's own pages only.</p>"
_WITHOUT_TOKEN: Final = "<p>An action needs the token of this view's forms: reload the page.</p>"  # noqa: S105
_TOO_LARGE: Final = "<p>That form is too large.</p>"


def _escape(kind: str, exc: Exception) -> str:
    import html  # noqa: PLC0415 - only on the error path

    return html.escape(f"{kind}: {exc}")


def _field(form: dict[str, list[str]], name: str) -> str | None:
    values = form.get(name)
    return values[0] if values and values[0] else None


def _done(query: dict[str, list[str]]) -> str | None:
    """The sentence of an action's code (an unknown code says nothing)."""
    code, number = _field(query, "done"), _field(query, "n")
    if code == "sent" and number is not None and re.fullmatch(r"[0-9]{1,9}", number):
        return f"Message {number} is in its inbox (a worker delivers it)."
    return {"cancelled": "Cancelled.", "retried": "Started again, as this new run."}.get(code or "")


def _get(site: Site, path: str, query: dict[str, list[str]]) -> tuple[HTTPStatus, str]:
    if path == "/":
        return HTTPStatus.OK, runs_page(site, query)
    if path == "/queues":
        return HTTPStatus.OK, queues_page(site)
    if path.startswith("/runs/"):
        run = urllib.parse.unquote(path.removeprefix("/runs/"))
        return HTTPStatus.OK, run_page(site, run, _done(query))
    return HTTPStatus.NOT_FOUND, not_found("No such page.")


def _act(site: Site, path: str, form: dict[str, list[str]]) -> tuple[HTTPStatus, str]:
    """Do one action; (303, where to go) once done."""
    if not path.startswith("/runs/") or path.count("/") < 3:
        return HTTPStatus.NOT_FOUND, not_found("No such action.")
    quoted, _, verb = path.removeprefix("/runs/").rpartition("/")
    run = urllib.parse.unquote(quoted)
    engine = site.engine
    if verb == "cancel":
        engine.cancel(run, _field(form, "reason"))
        return HTTPStatus.SEE_OTHER, _to(run, "cancelled")
    if verb == "send":
        text = _field(form, "message") or "null"
        try:
            message = json.loads(text)
        except (ValueError, RecursionError):
            raise InvalidArgumentError(
                f"the message is JSON ('\"hi\"' for a string), not {text!r}"
            ) from None
        position = engine.send(
            run, message, topic=_field(form, "topic"), key=_field(form, "key"), drive=False
        )
        return HTTPStatus.SEE_OTHER, _to(run, "sent", n=str(position))
    if verb == "retry":
        text = _field(form, "from_step") or "0"
        if not re.fullmatch(r"[0-9]{1,9}", text):
            raise InvalidArgumentError(f"from_step is a whole number, not {text!r}")
        forked = engine.fork(run, from_step=int(text))
        return HTTPStatus.SEE_OTHER, _to(forked.id, "retried")
    return HTTPStatus.NOT_FOUND, not_found(f"No action {verb!r}.")


def _to(run: str, done: str, **more: str) -> str:
    """Where an action sends the browser: the run's page, saying what was done (a code
    the page turns into its own sentence: a link cannot put words on it)."""
    where = urllib.parse.quote(run, safe="")
    return f"/runs/{where}?{urllib.parse.urlencode({'done': done, **more})}"
