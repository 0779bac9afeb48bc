"""The operator's verbs: `loom describe`, `loom steps`, `loom cancel`, `loom send`,
`loom resume`, `loom retry`, `loom queues`, `loom gc`.

They need no flow code: each opens the store (never creating one), reads or journals
what it is asked, and leaves driving to the workers. Data is printed for people, or
as JSON with `--json`; a bad id, a run in the wrong state or a store that cannot be
opened is one `loom: ...` line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final

from loom_kernel._core import InvalidArgumentError, LoomError, TrimmedError
from loom_kernel._engine import Engine, Execution, Retention
from loom_kernel._hosting._deploy import load_queues
from loom_kernel._hosting._store_option import add_store_option
from loom_kernel._spi import collect_blobs, open_store

__all__ = ["add_operate_commands", "run_started", "since"]

_Handler = Callable[[argparse.Namespace], int]


def add_operate_commands(commands: Any) -> dict[str, _Handler]:
    """Add the operator's verbs to the `loom` command's subparsers."""
    describe = commands.add_parser(
        "describe", help="a run: status, flow and code, owner, what it waits for, children"
    )
    steps = commands.add_parser("steps", help="a run's steps: name, outcome, attempts, result")
    for parser in (describe, steps):
        parser.add_argument("execution_id")
        parser.add_argument("--json", action="store_true", help="print JSON")
    cancel = commands.add_parser("cancel", help="end a run: it starts no other step")
    cancel.add_argument("execution_id")
    cancel.add_argument("--reason", default=None, help="why (kept in its journal)")
    send = commands.add_parser("send", help="send a message to a run (a worker delivers it)")
    send.add_argument("execution_id")
    send.add_argument("message", help="the message, as JSON (a string is quoted: '\"hi\"')")
    send.add_argument("--topic", default=None, help="its topic (default: the default topic)")
    send.add_argument("--key", default=None, help="dedupe key: the same key is delivered once")
    resume = commands.add_parser(
        "resume", help="deliver a payload to the gate a run is parked at (a worker drives it)"
    )
    resume.add_argument("execution_id")
    resume.add_argument("payload", help="what the gate returns, as JSON")
    resume.add_argument("--on", default=None, help="the gate meant (refused at another)")
    resume.add_argument("--key", default=None, help="dedupe key: the same key is delivered once")
    retry = commands.add_parser(
        "retry", help="start a run that ended again as a new run (--from-step: DBOS's fork)"
    )
    retry.add_argument("execution_id")
    retry.add_argument(
        "--from-step",
        type=int,
        default=0,
        help="reuse the outcomes of the old run's first N steps instead of running them",
    )
    retry.add_argument("--key", default=None, help="the new run's id (a K9 start)")
    queues = commands.add_parser(
        "queues", help="each queue's limits, and the runs waiting on it and being driven"
    )
    queues.add_argument(
        "--queues",
        required=True,
        action="append",
        help="module:attribute naming a Queue or a list of queues (repeatable): their limits "
        "live in code",
    )
    queues.add_argument("--json", action="store_true", help="print JSON")
    gc = commands.add_parser(
        "gc", help="delete the ended runs past a retention (see docs/retention.md)"
    )
    gc.add_argument(
        "--keep-for", type=_span, default=None, help="keep runs this long after their end (7d)"
    )
    gc.add_argument("--keep-last", type=int, default=None, help="keep the newest N ended runs")
    gc.add_argument(
        "--blobs",
        action="store_true",
        help="then move the blobs no record names to the trash, and delete those that "
        "have been there a grace (see --grace)",
    )
    gc.add_argument(
        "--grace",
        type=_span,
        default=3600.0,
        help="keep an unnamed blob this long after it was written (default 1h)",
    )
    gc.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    gc.add_argument("--json", action="store_true", help="print JSON")
    for parser in (describe, steps, cancel, send, resume, retry, queues, gc):
        add_store_option(parser)
    return dict.fromkeys(_VERBS, _run)


def _run(args: argparse.Namespace) -> int:
    try:
        queues = [item for spec in getattr(args, "queues", []) for item in load_queues(spec)]
        args.loaded_queues = queues
        with open_store(args.store, create=False) as store:
            engine = Engine(store, listeners=[], queues=queues)
            return _VERBS[args.command](engine, args)
    except LoomError as exc:
        print(f"loom: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _when(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")


def described(engine: Engine, execution: Execution) -> dict[str, Any]:
    """What `loom describe` shows of a run, as JSON-ready data."""
    children = [
        {"id": child.id, "flow": child.flow, "status": child.status.value}
        for child in engine.executions(f"{execution.id}/")
        if child.parent == execution.id
    ]
    inbox = engine.inbox(execution.id)
    queue = engine.state(execution.id).queue
    return {
        "id": execution.id,
        "flow": execution.flow,
        "code": execution.code_hash,
        "status": execution.status.value,
        "owner": execution.owner,
        "owner_seen_at": _when(execution.owner_seen_at),
        "waiting_on": execution.waiting_on,
        "gates": list(execution.gates),
        "topics": list(execution.topics),
        "wake_at": _when(execution.wake_at),
        "queue": None
        if queue is None
        else {"name": queue.name, "priority": queue.priority, "key": queue.key},
        "parent": execution.parent,
        "retry_of": execution.retry_of,
        "children": children,
        "input": execution.input,
        "result": execution.result,
        "error": None
        if execution.error is None
        else {"type": execution.error.type, "message": execution.error.message},
        "cancel_reason": execution.cancel_reason,
        "published": engine.get_events(execution.id),
        "inbox": {"messages": len(inbox), "unread": sum(not m.received for m in inbox)},
        "records": execution.position,
    }


def run_started(engine: Engine, execution: Execution) -> float | None:
    """When a run started, from its first record (unknown, None, once compaction
    trimmed that record)."""
    try:
        first = engine.store.read(engine.stream_of(execution.id), 0, 1)
    except TrimmedError:
        return None
    return first[0].timestamp if first else None


_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def since(text: str) -> float:
    """`--since`: an ISO 8601 time with a zone, or a span back from now (30m, 6h, 7d),
    as Unix seconds.

    Raises:
        argparse.ArgumentTypeError: it is neither.
    """
    unit = _UNITS.get(text[-1:])
    if unit is not None and re.fullmatch(r"[0-9]{1,9}", text[:-1]):
        return time.time() - int(text[:-1]) * unit
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise argparse.ArgumentTypeError(
            f"--since is an ISO 8601 time with a zone (2026-12-01T00:00Z) or a span back "
            f"from now (30m, 6h, 7d), not {text!r}"
        )
    return moment.timestamp()


def _span(text: str) -> float:
    """`--keep-for`: a span (90s, 30m, 6h, 7d) or a number of seconds."""
    unit = _UNITS.get(text[-1:])
    number = text[:-1] if unit is not None else text
    try:
        seconds = float(number) * (unit or 1)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(
            f"--keep-for is a span (90s, 30m, 6h, 7d) or seconds, not {text!r}"
        )
    return seconds


def _text(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 100 else text[:97] + "..."


def _describe(engine: Engine, args: argparse.Namespace) -> int:
    data = described(engine, engine.get(args.execution_id))
    if args.json:
        print(json.dumps(data, indent=2, ensure_ascii=False))
        return 0
    lines = [
        f"{data['id']}: {data['flow']} (code {data['code'] or '-'}), {data['status']}",
    ]
    if data["owner"]:
        lines.append(f"  driven by {data['owner']}, last seen {data['owner_seen_at']}")
    if data["waiting_on"]:
        waits = ", ".join(
            [*(f"gate {gate!r}" for gate in data["gates"])]
            + [f"topic {topic!r}" for topic in data["topics"]]
        )
        lines.append(f"  waiting on {waits or 'its timer'}")
    if data["wake_at"]:
        lines.append(f"  wakes at {data['wake_at']}")
    if data["queue"]:
        lines.append(f"  on queue {data['queue']['name']!r} (key {data['queue']['key']!r})")
    if data["parent"]:
        lines.append(f"  child of {data['parent']}")
    if data["retry_of"]:
        lines.append(f"  started again from {data['retry_of']}")
    for child in data["children"]:
        lines.append(f"  child {child['id']} ({child['flow']}): {child['status']}")
    lines.append(f"  input: {_text(data['input'])}")
    if data["status"] == "completed":
        lines.append(f"  result: {_text(data['result'])}")
    if data["error"]:
        lines.append(f"  error: {data['error']['type']}: {data['error']['message']}")
    if data["cancel_reason"]:
        lines.append(f"  cancelled: {data['cancel_reason']}")
    for key, value in data["published"].items():
        lines.append(f"  published {key!r}: {_text(value)}")
    inbox = data["inbox"]
    lines.append(f"  inbox: {inbox['messages']} message(s), {inbox['unread']} unread")
    lines.append(f"  journal: {data['records']} record(s)")
    print("\n".join(lines))
    return 0


def _steps(engine: Engine, args: argparse.Namespace) -> int:
    frames = engine.frames(args.execution_id)
    rows = [
        {
            "index": index,
            "name": frame.name,
            "outcome": "failed" if frame.error is not None else "ok",
            "attempts": frame.attempts,
            "result": frame.result,
            "error": None
            if frame.error is None
            else {"type": frame.error.type, "message": frame.error.message},
        }
        for index, frame in sorted(frames.items())
    ]
    if args.json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return 0
    print(f"{'#':>4}  {'STEP':<32} {'OUTCOME':<7} {'TRIES':>5}  RESULT")
    for row in rows:
        shown = (
            _text(row["result"])
            if row["error"] is None
            else f"{row['error']['type']}: {row['error']['message']}"
        )
        index, name, outcome, tries = row["index"], row["name"], row["outcome"], row["attempts"]
        print(f"{index:>4}  {name:<32} {outcome:<7} {tries:>5}  {shown}")
    return 0


def _cancel(engine: Engine, args: argparse.Namespace) -> int:
    execution = engine.get(args.execution_id)
    if execution.status.finished:
        print(
            f"loom: {execution.id} is {execution.status.value}: there is nothing to cancel",
            file=sys.stderr,
        )
        return 1
    cancelled = engine.cancel(args.execution_id, args.reason)
    print(f"{cancelled.id}: {cancelled.status.value}")
    return 0


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidArgumentError(
            f"{what} is JSON (quote a string: '\"hi\"'), not {text!r}: {exc}"
        ) from None


def _send(engine: Engine, args: argparse.Namespace) -> int:
    message = _json(args.message, "MESSAGE")
    position = engine.send(args.execution_id, message, topic=args.topic, key=args.key, drive=False)
    print(f"{args.execution_id}: message {position} in its inbox (a worker delivers it)")
    return 0


def _resume(engine: Engine, args: argparse.Namespace) -> int:
    payload = _json(args.payload, "PAYLOAD")
    before = engine.get(args.execution_id)
    resumed = engine.resume(args.execution_id, payload, key=args.key, on=args.on)
    if resumed.position == before.position:
        print(f"{resumed.id}: {resumed.status.value} (this key was delivered already)")
    else:
        print(f"{resumed.id}: resumed at {before.waiting_on!r}; a worker drives it on")
    return 0


def _retry(engine: Engine, args: argparse.Namespace) -> int:
    forked = engine.fork(args.execution_id, from_step=args.from_step, key=args.key)
    print(f"{forked.id}: started again from {args.execution_id}; a worker drives it")
    return 0


def _queues(engine: Engine, args: argparse.Namespace) -> int:
    rows = []
    for spec in args.loaded_queues:
        view = engine.queue(spec.name)
        rate = None if spec.rate is None else {"limit": spec.rate.limit, "per": spec.rate.per}
        rows.append(
            {
                "name": spec.name,
                "concurrency": spec.concurrency,
                "per_key": spec.per_key,
                "rate": rate,
                "waiting": view.waiting,
                "active": view.active,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'QUEUE':<24} {'WAITING':>7} {'ACTIVE':>6}  LIMITS")
    for row in rows:
        limits = [
            *([f"concurrency {row['concurrency']}"] if row["concurrency"] is not None else []),
            *([f"per key {row['per_key']}"] if row["per_key"] is not None else []),
            *(
                [f"rate {row['rate']['limit']} per {row['rate']['per']:g} s"]
                if row["rate"] is not None
                else []
            ),
        ]
        print(
            f"{row['name']:<24} {len(row['waiting']):>7} {len(row['active']):>6}  "
            f"{', '.join(limits) or 'none'}"
        )
    return 0


def _gc(engine: Engine, args: argparse.Namespace) -> int:
    runs = args.keep_for is not None or args.keep_last is not None
    if not runs and not args.blobs:
        raise InvalidArgumentError("loom gc needs --keep-for, --keep-last, --blobs or some")
    deleted: list[str] = []
    finished: list[str] = []
    kept = 0
    if runs:
        batch = 2**31 if args.dry_run else 1000  # a dry run deletes nothing: one pass says all
        retention = Retention(keep_for=args.keep_for, keep_last=args.keep_last, batch=batch)
        while True:
            swept = engine.gc(retention, dry_run=args.dry_run)
            deleted.extend(swept.deleted)
            finished.extend(swept.finished)
            kept = swept.kept
            if not swept.more:
                break
    blobs = (
        collect_blobs(engine.store, grace=args.grace, dry_run=args.dry_run) if args.blobs else None
    )
    if args.json:
        data: dict[str, Any] = {"dry_run": args.dry_run, "deleted": deleted, "kept": kept}
        data["finished"] = finished
        if blobs is not None:
            data["blobs_discarded"] = list(blobs.discarded)
            data["blobs_deleted"] = list(blobs.deleted)
            data["blobs_restored"] = list(blobs.restored)
        print(json.dumps(data, indent=2))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for execution_id in deleted:
        print(f"{verb} {execution_id}")
    if runs:
        print(
            f"loom gc: {verb} {len(deleted)} ended runs, kept {kept}"
            + (f", finished {len(finished)} half-done deletions" if finished else "")
        )
    if blobs is not None:
        moved = "would move" if args.dry_run else "moved"
        print(
            f"loom gc: {moved} {len(blobs.discarded)} blobs no record names to the trash, "
            f"{verb} {len(blobs.deleted)} from it, brought {len(blobs.restored)} back; "
            f"{blobs.referenced} named, {blobs.young} within the grace"
        )
    return 0


_VERBS: dict[str, Callable[[Engine, argparse.Namespace], int]] = {
    "describe": _describe,
    "steps": _steps,
    "cancel": _cancel,
    "send": _send,
    "resume": _resume,
    "queues": _queues,
    "retry": _retry,
    "gc": _gc,
}
