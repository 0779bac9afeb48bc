"""The pages of `loom ui`: the run list, one run, the queues. Every value from a store
is escaped; a page has no script and loads nothing from elsewhere. Forms that change
anything (cancel, retry, send) are drawn only when the server allows actions, each
carrying the server's token."""

from __future__ import annotations

import argparse
import html
import json
import urllib.parse
from collections.abc import Iterator
from datetime import UTC, datetime
from itertools import islice
from typing import Any, Final

import attrs

from loom_kernel._core import EXECUTION_PREFIX, ExecutionNotFoundError, InvalidArgumentError, Status
from loom_kernel._engine import Engine, Execution, parts_of
from loom_kernel._hosting._operate import described, run_started, since
from loom_kernel._tools import format_timeline

__all__ = ["Site", "not_found", "page", "queues_page", "run_page", "runs_page"]

PAGE: Final = 50
#: The most runs a supervision tree shows, and how deep it goes.
TREE_LIMIT: Final = 200
TREE_DEPTH: Final = 6
_STATUSES: Final = tuple(status.value for status in Status)
_STYLE: Final = (
    "body{font-family:system-ui,sans-serif;margin:2em;color:#222}"
    "table{border-collapse:collapse}td,th{padding:.2em .8em;text-align:left;"
    "border-bottom:1px solid #ddd}pre{background:#f6f6f6;padding:1em;overflow-x:auto}"
    ".failed{color:#b00}.completed{color:#070}.cancelled{color:#777}"
    ".suspended{color:#a60}.running{color:#06c}nav a{margin-right:1em}"
    "form.action{display:inline-block;margin:.3em 1em .3em 0;padding:.4em;"
    "border:1px solid #ddd}"
)


@attrs.frozen
class Site:
    """What the pages are drawn for: the engine, and the token of the forms that act
    (None: a read-only site, no form that changes anything)."""

    engine: Engine
    token: str | None = None


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _p(text: str) -> str:
    return f"<p>{_e(text)}</p>"


def _when(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def page(title: str, body: str) -> str:
    """A whole page."""
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{_e(title)} · Loom</title><style>{_STYLE}</style></head><body>"
        "<nav><a href='/'>Runs</a><a href='/queues'>Queues</a></nav>"
        f"<h1>{_e(title)}</h1>{body}</body></html>"
    )


def not_found(text: str) -> str:
    """The page of what is not there."""
    return page("Not found", _p(text))


def _link(run: str) -> str:
    return f"<a href='/runs/{urllib.parse.quote(run, safe='')}'>{_e(run)}</a>"


def _one(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[0] if values and values[0] else None


def _since(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return since(text)
    except argparse.ArgumentTypeError as exc:
        raise InvalidArgumentError(str(exc).replace("--since", "since")) from None


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


def _started_since(
    engine: Engine, runs: Iterator[Execution], moment: float | None
) -> Iterator[tuple[Execution, float | None]]:
    for run in runs:
        started = run_started(engine, run)
        if moment is None or (started is not None and started >= moment):
            yield run, started


def runs_page(site: Site, query: dict[str, list[str]]) -> str:
    """The run list: filtered by status, flow and start time, a page at a time."""
    engine = site.engine
    status, flow, after = _one(query, "status"), _one(query, "flow"), _one(query, "after")
    since_text = _one(query, "since")
    if status is not None and status not in _STATUSES:
        raise InvalidArgumentError(f"status is one of {', '.join(_STATUSES)}, not {status!r}")
    moment = _since(since_text)
    found = _started_since(engine, _listed(engine, status, flow, after), moment)
    rows = list(islice(found, PAGE + 1))
    shown, more = rows[:PAGE], len(rows) > PAGE
    options = "".join(
        f"<option{' selected' if value == status else ''}>{_e(value)}</option>"
        for value in ("", *_STATUSES)
    )
    form = (
        "<form method='get' action='/'>status <select name='status'>"
        f"{options}</select> flow <input name='flow' value='{_e(flow or '')}'> "
        f"started since <input name='since' placeholder='6h, 7d or 2026-12-01T00:00Z' "
        f"value='{_e(since_text or '')}'> <button>Filter</button></form>"
    )
    lines = "".join(
        f"<tr><td>{_link(run.id)}</td><td>{_e(run.flow)}</td>"
        f"<td class='{_e(run.status.value)}'>{_e(run.status.value)}</td>"
        f"<td>{_e(run.waiting_on or '')}</td><td>{_e(_when(started))}</td></tr>"
        for run, started in shown
    )
    table = (
        "<table><tr><th>Run</th><th>Flow</th><th>Status</th><th>Waiting on</th>"
        f"<th>Started</th></tr>{lines}</table>"
        if shown
        else "<p>No runs.</p>"
    )
    paging = ""
    if more:
        onward = {"after": shown[-1][0].id}
        for name, value in (("status", status), ("flow", flow), ("since", since_text)):
            if value:
                onward[name] = value
        paging = f"<p><a href='/?{_e(urllib.parse.urlencode(onward))}'>Next page</a></p>"
    return page("Runs", form + table + paging)


def _tree(engine: Engine, root: str) -> str:
    """The runs under `root` (children, theirs, ...), as nested lists: at most
    TREE_LIMIT runs, TREE_DEPTH deep."""
    shown = 0

    def below(parent: str, depth: int) -> str:
        nonlocal shown
        if depth > TREE_DEPTH:
            return ""
        items = []
        for child in engine.executions(f"{parent}/"):
            if child.parent != parent:
                continue
            if shown >= TREE_LIMIT:
                items.append("<li>…</li>")
                break
            shown += 1
            items.append(
                f"<li>{_link(child.id)} ({_e(child.flow)}): "
                f"<span class='{_e(child.status.value)}'>{_e(child.status.value)}</span>"
                f"{below(child.id, depth + 1)}</li>"
            )
        return f"<ul>{''.join(items)}</ul>" if items else ""

    return below(root, 1)


def _actions(site: Site, execution: Execution) -> str:
    """The forms that act on a run, where the site allows it: cancel a run that has not
    ended, send it a message, start an ended one again."""
    if site.token is None:
        return ""
    base = f"/runs/{urllib.parse.quote(execution.id, safe='')}"
    token = f"<input type='hidden' name='token' value='{_e(site.token)}'>"
    forms = []
    if not execution.status.finished:
        forms.append(
            f"<form class='action' method='post' action='{base}/cancel'>{token}"
            "reason <input name='reason'> <button>Cancel</button></form>"
        )
        forms.append(
            f"<form class='action' method='post' action='{base}/send'>{token}"
            "message (JSON) <input name='message' value='\"\"'> topic <input name='topic'> "
            "key <input name='key'> <button>Send</button></form>"
        )
    else:
        forms.append(
            f"<form class='action' method='post' action='{base}/retry'>{token}"
            "reusing the first <input name='from_step' value='0' size='3'> steps "
            "<button>Start again</button></form>"
        )
    return "<h2>Act</h2>" + "".join(forms)


def run_page(site: Site, run: str, done: str | None = None) -> str:
    """One run: its facts, what it acted on (an action just made: `done`), the runs
    under it, what it published and received, and its journal."""
    engine = site.engine
    execution = engine.get(run)
    data = described(engine, execution)
    facts = [
        ("Flow", _e(f"{data['flow']} ({data['code'] or 'no code pinned yet'})")),
        ("Status", _e(data["status"])),
        ("Waiting on", _e(data["waiting_on"] or "")),
        ("Wakes at", _e(data["wake_at"] or "")),
        ("Driven by", _e(data["owner"] or "")),
        ("Parent", _link(data["parent"]) if data["parent"] else ""),
        ("Started again from", _link(data["retry_of"]) if data["retry_of"] else ""),
        ("Input", f"<code>{_e(_json(data['input']))}</code>"),
    ]
    if data["status"] == "completed":
        facts.append(("Result", f"<code>{_e(_json(data['result']))}</code>"))
    if data["error"]:
        facts.append(("Error", _e(f"{data['error']['type']}: {data['error']['message']}")))
    if data["cancel_reason"]:
        facts.append(("Cancelled", _e(data["cancel_reason"])))
    table = "".join(
        f"<tr><th>{_e(name)}</th><td>{value}</td></tr>" for name, value in facts if value
    )
    body = (_p(done) if done else "") + f"<table>{table}</table>" + _actions(site, execution)
    tree = _tree(engine, run)
    if tree:
        body += f"<h2>Runs under it</h2>{tree}"
    published = "".join(
        f"<tr><th>{_e(key)}</th><td><code>{_e(_json(value))}</code></td></tr>"
        for key, value in data["published"].items()
    )
    if published:
        body += f"<h2>Published</h2><table>{published}</table>"
    messages = "".join(
        f"<tr><td>{m.position}</td><td>{_e(m.topic or '')}</td><td>{_e(m.key or '')}</td>"
        f"<td><code>{_e(_json(m.message))}</code></td><td>{'read' if m.received else ''}</td>"
        f"<td>{_e(_when(m.sent_at))}</td></tr>"
        for m in engine.inbox(run)
    )
    if messages:
        body += (
            "<h2>Inbox</h2><table><tr><th>#</th><th>Topic</th><th>Key</th><th>Message</th>"
            f"<th></th><th>Sent</th></tr>{messages}</table>"
        )
    timeline = format_timeline(engine.history(run), data["published"])
    body += f"<h2>Journal</h2><pre>{_e(timeline)}</pre>"
    return page(run, body)


def queues_page(site: Site) -> str:
    """Each queue the site was given: its limits, what waits on it, what is driven."""
    engine = site.engine
    names = sorted(parts_of(engine).enqueueing.book.queues)
    if not names:
        return page(
            "Queues",
            _p(
                "No queue named: their limits live in code, so start loom ui with "
                "--queues module:attribute (as loom worker is)."
            ),
        )
    sections = []
    for name in names:
        spec = parts_of(engine).enqueueing.book.queue(name)
        view = engine.queue(name)
        limits = [
            *([f"concurrency {spec.concurrency}"] if spec.concurrency is not None else []),
            *([f"per key {spec.per_key}"] if spec.per_key is not None else []),
            *([f"rate {spec.rate.limit} per {spec.rate.per:g} s"] if spec.rate else []),
        ]
        waiting = "".join(f"<li>{_link(run)}</li>" for run in list(view.waiting)[:PAGE])
        active = "".join(f"<li>{_link(run)}</li>" for run in list(view.active)[:PAGE])
        sections.append(
            f"<h2>{_e(name)}</h2>{_p('limits: ' + (', '.join(limits) or 'none'))}"
            f"<p>{len(view.waiting)} waiting, {len(view.active)} driven</p>"
            + (f"<h3>Waiting</h3><ul>{waiting}</ul>" if waiting else "")
            + (f"<h3>Driven</h3><ul>{active}</ul>" if active else "")
        )
    return page("Queues", "".join(sections))
