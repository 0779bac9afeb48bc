"""`loom schedule create|ls|describe|pause|unpause|trigger|backfill|delete`: the
schedule API on the command line (the `loom.commands` entry point).

The commands need no flow code: runs a trigger or a backfill starts wait for a
worker that has it. Those that only read open the store without creating it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import attrs
from loom_kernel import Engine, LoomError, open_store

from loom_orchestration._schedules._api import (
    ScheduleInfo,
    backfill_schedule,
    create_schedule,
    delete_schedule,
    get_schedule,
    pause_schedule,
    scan_schedules,
    trigger_schedule,
    unpause_schedule,
)
from loom_orchestration._schedules._spec import OVERLAP_POLICIES

__all__ = ["add_schedule_commands", "as_json", "describe"]

_Handler = Callable[[argparse.Namespace], int]


def add_schedule_commands(commands: Any) -> dict[str, _Handler]:
    """Add `loom schedule ...` to the `loom` command's subparsers."""
    schedule = commands.add_parser(
        "schedule", help="create, list, pause, trigger and backfill schedules"
    )
    verbs = schedule.add_subparsers(dest="verb", required=True)

    create = verbs.add_parser(
        "create", help="create a schedule: each cron tick starts a run of a flow"
    )
    create.add_argument("name")
    create.add_argument("--flow", required=True, help="the flow each tick starts (by name)")
    create.add_argument("--cron", required=True, help='cron expression, e.g. "*/5 * * * *"')
    create.add_argument("--input", default="null", help="JSON each run receives as input['input']")
    create.add_argument("--overlap", default="skip", choices=OVERLAP_POLICIES)
    create.add_argument(
        "--catchup-window", type=float, default=None, help="seconds (default: a year)"
    )
    create.add_argument("--jitter", type=float, default=0.0, help="seconds")
    create.add_argument("--timezone", default="UTC", help="IANA time zone of the cron expression")
    create.add_argument("--paused", action="store_true")
    create.add_argument("--note", default=None)

    listing = verbs.add_parser("ls", help="list the schedules")
    describe_verb = verbs.add_parser("describe", help="a schedule's next ticks, last run, counts")
    describe_verb.add_argument("name")
    for parser in (listing, describe_verb):
        parser.add_argument("--json", action="store_true", help="print JSON")
    for verb in ("pause", "unpause"):
        parser = verbs.add_parser(verb, help=f"{verb} a schedule")
        parser.add_argument("name")
        parser.add_argument("--note", default=None)
    trigger = verbs.add_parser("trigger", help="start one run of a schedule now")
    trigger.add_argument("name")
    trigger.add_argument("--overlap", default=None, choices=OVERLAP_POLICIES)
    backfill = verbs.add_parser("backfill", help="run a schedule's ticks of a past range")
    backfill.add_argument("name")
    backfill.add_argument(
        "--start", required=True, help="ISO 8601 with a zone, e.g. 2026-12-01T00:00Z"
    )
    backfill.add_argument("--end", required=True, help="ISO 8601 with a zone (not included)")
    backfill.add_argument("--overlap", default="buffer_all", choices=OVERLAP_POLICIES)
    delete = verbs.add_parser("delete", help="delete a schedule (its runs are left as they are)")
    delete.add_argument("name")
    for parser in verbs.choices.values():
        store = os.environ.get("LOOM_STORE") or None
        parser.add_argument(
            "--store",
            default=store,
            required=store is None,
            help="store URL (default: $LOOM_STORE)",
        )
    return {"schedule": _run}


def _run(args: argparse.Namespace) -> int:
    try:  # only create makes a store: a mistyped URL elsewhere is refused
        with open_store(args.store, create=args.verb == "create") as store:
            engine = Engine(store, [], listeners=[])
            return _VERBS[args.verb](engine, args)
    except LoomError as exc:
        print(f"loom: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _create(engine: Engine, args: argparse.Namespace) -> int:
    try:
        value = json.loads(args.input)
    except ValueError as exc:
        print(f"loom: --input is not JSON: {exc}", file=sys.stderr)
        return 2
    options: dict[str, Any] = {}
    if args.catchup_window is not None:
        options["catchup_window"] = args.catchup_window
    info = create_schedule(
        engine,
        args.name,
        args.flow,
        cron=args.cron,
        input=value,
        overlap=args.overlap,
        jitter=args.jitter,
        timezone=args.timezone,
        paused=args.paused,
        note=args.note,
        **options,
    )
    print(describe(info))
    return 0


def _ls(engine: Engine, args: argparse.Namespace) -> int:
    schedules, damaged = [], 0
    for name, info in scan_schedules(engine):
        if isinstance(info, ScheduleInfo):
            schedules.append(info)
        else:
            damaged += 1
            print(f"loom: schedule {name} cannot be read: {info}", file=sys.stderr)
    if args.json:
        print(json.dumps([as_json(info) for info in schedules], indent=2))
        return 1 if damaged else 0
    print(f"{'NAME':<24} {'FLOW':<20} {'CRON':<18} {'NEXT':<27} COUNTS")
    for info in schedules:
        upcoming = (
            "paused" if info.paused else _when(info.next_ticks[0] if info.next_ticks else None)
        )
        print(
            f"{info.name:<24} {info.flow:<20} {info.cron!r:<18} {upcoming:<27}"
            f" started {info.counts.started}, skipped {info.counts.skipped},"
            f" missed {info.counts.missed}"
        )
    return 1 if damaged else 0


def _describe(engine: Engine, args: argparse.Namespace) -> int:
    info = get_schedule(engine, args.name)
    print(json.dumps(as_json(info), indent=2) if args.json else describe(info))
    return 0


def _pause(engine: Engine, args: argparse.Namespace) -> int:
    print(describe(pause_schedule(engine, args.name, args.note)))
    return 0


def _unpause(engine: Engine, args: argparse.Namespace) -> int:
    print(describe(unpause_schedule(engine, args.name, args.note)))
    return 0


def _trigger(engine: Engine, args: argparse.Namespace) -> int:
    started = trigger_schedule(engine, args.name, overlap=args.overlap)
    print(
        started if started is not None else "not started: its overlap policy skipped or buffered it"
    )
    return 0


def _backfill(engine: Engine, args: argparse.Namespace) -> int:
    try:
        start, end = datetime.fromisoformat(args.start), datetime.fromisoformat(args.end)
    except ValueError as exc:
        print(f"loom: --start and --end are ISO 8601 times: {exc}", file=sys.stderr)
        return 2
    started = backfill_schedule(engine, args.name, start, end, overlap=args.overlap)
    print(f"backfill of {args.name} from {start.isoformat()} to {end.isoformat()}:", end=" ")
    print(f"started {len(started)} now")
    for execution_id in started:
        print(f"  {execution_id}")
    return 0


def _delete(engine: Engine, args: argparse.Namespace) -> int:
    delete_schedule(engine, args.name)
    print(f"deleted {args.name}")
    return 0


_VERBS: dict[str, Callable[[Engine, argparse.Namespace], int]] = {
    "create": _create,
    "ls": _ls,
    "describe": _describe,
    "pause": _pause,
    "unpause": _unpause,
    "trigger": _trigger,
    "backfill": _backfill,
    "delete": _delete,
}


def _span(duration: timedelta) -> str:
    """A duration as people write it: 365 days, 6 hours, 90 s, 0 s."""
    total = duration.total_seconds()
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if total >= size and total % size == 0:
            count = int(total // size)
            return f"{count} {unit if count != 1 else unit[:-1]}"
    return f"{total:g} s"


def _when(moment: datetime | None) -> str:
    return "-" if moment is None else moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def as_json(info: ScheduleInfo) -> dict[str, Any]:
    """A schedule as `--json` prints it: times in ISO 8601 UTC, durations in seconds."""
    return {
        "name": info.name,
        "flow": info.flow,
        "cron": info.cron,
        "input": info.input,
        "overlap": info.overlap,
        "catchup_window": info.catchup_window.total_seconds(),
        "jitter": info.jitter.total_seconds(),
        "timezone": info.timezone,
        "paused": info.paused,
        "note": info.note,
        "next_ticks": [_when(tick) for tick in info.next_ticks],
        "last_run": info.last_run,
        "last_tick": None if info.last_tick is None else _when(info.last_tick),
        "counts": attrs.asdict(info.counts),
        "buffered": list(info.buffered),
        "backfills": info.backfills,
        "recent": [attrs.asdict(action) for action in info.recent],
        "created_at": info.created_at.isoformat(),
        "updated_at": info.updated_at.isoformat(),
    }


def describe(info: ScheduleInfo) -> str:
    """A schedule as `loom schedule describe` prints it."""
    counts = info.counts
    lines = [
        f"{info.name}: {info.flow} at {info.cron!r} ({info.timezone}), overlap {info.overlap},"
        f" catch-up window {_span(info.catchup_window)}, jitter {_span(info.jitter)}",
        f"  {'paused' + (f' ({info.note})' if info.note else '') if info.paused else 'active'};"
        f" next ticks: {', '.join(_when(t) for t in info.next_ticks) or '-'}",
        f"  last run: {info.last_run or '-'}",
        f"  started {counts.started}, skipped {counts.skipped}, missed {counts.missed},"
        f" buffered {counts.buffered}, cancelled {counts.cancelled},"
        f" terminated {counts.terminated}, paused {counts.paused},"
        f" already ran {counts.already_ran}",
    ]
    if info.buffered:
        lines.append(f"  waiting: {', '.join(info.buffered)}")
    if info.backfills:
        lines.append(f"  backfills going on: {info.backfills}")
    for action in info.recent[-5:]:
        what = action.run_id or (f"{action.count} tick(s)" if action.count != 1 else "")
        at = datetime.fromtimestamp(action.at, info.created_at.tzinfo)
        lines.append(f"  {_when(at)} {action.did} {what}")
    return "\n".join(lines)
