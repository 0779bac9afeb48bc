"""The `loom` command line."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Final

from loom_kernel._core import LoomError, NewRecord
from loom_kernel._hosting._operate import add_operate_commands, since
from loom_kernel._hosting._store_option import add_store_option
from loom_kernel._spi import JournalStore, installed_stores, open_store, store_factory

if TYPE_CHECKING:
    from loom_kernel._engine import RunSummary

__all__ = ["COMMAND_GROUP", "check_store", "main"]

#: Commands other distributions add to `loom` (loom-orchestration's `loom schedule`):
#: each entry point names a function that takes the command's subparsers, adds its
#: own, and returns a handler for each, by name.
COMMAND_GROUP: Final = "loom.commands"
_Handler = Callable[[argparse.Namespace], int]


def _self_check_url(scheme: str, scratch: str) -> str | None:
    """A URL a store can be checked at with no configuration, if its factory offers one
    (`StoreFactory.self_check_url`): under the scratch directory, removed after the checks.
    """
    try:
        factory = store_factory(scheme)
    except LoomError:
        return None
    return None if factory.self_check_url is None else factory.self_check_url(scratch)


def check_store(store: JournalStore) -> str:
    """Append two records to a scratch stream, read them back, then delete the stream.

    Returns:
        A one-line summary of the round trip.

    Raises:
        LoomError: the store failed the round trip.
    """
    stream = f"loom-check/{uuid.uuid4().hex}"
    sent = [
        NewRecord("loom.check", b'{"n":1}', time.time()),
        NewRecord("loom.check", b'{"n":2}', time.time()),
    ]
    started = time.perf_counter()
    head = store.append(stream, 0, sent)
    got = store.read(stream)
    elapsed = time.perf_counter() - started
    store.delete(stream)
    if head != 2 or [(r.position, r.kind, r.payload) for r in got] != [
        (1, "loom.check", b'{"n":1}'),
        (2, "loom.check", b'{"n":2}'),
    ]:
        raise LoomError(f"round trip returned head {head} and records {got!r}")
    return f"append+read round trip ok in {elapsed * 1000:.2f} ms"


def _stores_command(urls: Sequence[str]) -> int:
    failures = 0
    installed = installed_stores()
    print("installed stores:")
    width = max((len(scheme) + 3 for scheme in installed), default=0)
    for scheme, origin in installed.items():
        print(f"  {scheme + '://':<{width}} from {origin}")
    with tempfile.TemporaryDirectory(prefix="loom-check-") as scratch:
        checkable = {scheme: _self_check_url(scheme, scratch) for scheme in installed}
        targets = list(urls) or [url for url in checkable.values() if url is not None]
        print("checks:")
        for url in targets:
            try:
                with open_store(url) as store:
                    summary = check_store(store)
            except LoomError as exc:
                failures += 1
                print(f"  {url}: FAILED: {type(exc).__name__}: {exc}")
            else:
                print(f"  {url}: {summary}")
    unchecked = sorted(scheme for scheme, url in checkable.items() if url is None)
    if unchecked and not urls:
        print(f"  not checked (need a URL): {', '.join(unchecked)}; run `loom stores URL ...`")
    return 1 if failures else 0


def _inspect_command(args: argparse.Namespace) -> int:
    from loom_kernel._engine import Engine, parts_of  # noqa: PLC0415 - for this command only
    from loom_kernel._tools import format_timeline  # noqa: PLC0415

    unreadable: list[str] = []

    def report(execution_id: str, exc: LoomError) -> None:
        unreadable.append(execution_id)
        print(f"loom: {execution_id}: {type(exc).__name__}: {exc}", file=sys.stderr)

    try:
        with open_store(args.store, create=False) as store:
            engine = Engine(store, listeners=[])
            if args.command == "ls":
                listed = parts_of(engine).reading.runs(
                    "",
                    status=args.status,
                    flow=args.flow,
                    since=args.since,
                    limit=args.limit,
                    unreadable=report,
                )
                if args.json:
                    print(json.dumps([_listed(run) for run in listed], indent=2))
                    return 1 if unreadable else 0
                _print_listing(listed)
            else:
                execution = engine.get(args.execution_id)
                print(f"{execution.id}: {execution.flow}, {execution.status}")
                history = engine.history(args.execution_id)
                print(format_timeline(history, engine.get_events(args.execution_id)))
    except LoomError as exc:
        print(f"loom: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 1 if unreadable else 0


def _listed(run: RunSummary) -> dict[str, Any]:
    """A run as `loom ls --json` prints it."""
    return {
        "id": run.id,
        "flow": run.flow,
        "status": run.status.value,
        "started_at": _when(run.started_at),
        "ended_at": _when(run.ended_at),
        "waiting_on": run.waiting_on,
        "parent": run.parent,
    }


def _print_listing(listed: list[RunSummary]) -> None:
    """`loom ls`'s table, written at once (a print per row was half of listing 100,000
    runs), with each second's time made once."""
    times: dict[int, str] = {}

    def when(seconds: float | None) -> str:
        if seconds is None:
            return "-"
        whole = math.floor(seconds)
        text = times.get(whole)
        if text is None:
            text = times[whole] = datetime.fromtimestamp(whole, UTC).isoformat()
        return text

    lines = [f"{'ID':<40} {'FLOW':<20} {'STATUS':<10} {'STARTED':<24} {'ENDED':<24} WAITING ON"]
    lines.extend(
        f"{run.id:<40} {run.flow:<20} {run.status.value:<10} {when(run.started_at):<24} "
        f"{when(run.ended_at):<24} {repr(run.waiting_on) if run.waiting_on else '-'}"
        for run in listed
    )
    lines.append("")
    sys.stdout.write("\n".join(lines))


def _when(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def _count(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"--limit is a whole number of 0 or more, not {text}")
    return number


def _worker_command(args: argparse.Namespace) -> int:
    import logging  # noqa: PLC0415 - only this command needs these

    from loom_kernel._engine import Engine  # noqa: PLC0415
    from loom_kernel._hosting._deploy import load_flows, load_queues  # noqa: PLC0415
    from loom_kernel._hosting._worker import Worker, terminal_status  # noqa: PLC0415

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        flows = [item for spec in args.flows for item in load_flows(spec)]
        queues = [item for spec in args.queues for item in load_queues(spec)]
        with open_store(args.store) as store:
            engine = Engine(store, flows, worker_id=args.worker_id, lease=args.lease, queues=queues)
            worker = Worker(
                engine, concurrency=args.concurrency, grace=args.grace, idle_poll=args.idle_poll
            )
            print(
                f"loom worker {engine.worker_id}: {len(flows)} flow(s), {len(queues)} queue(s), "
                f"concurrency {args.concurrency}; SIGTERM or Ctrl-C stops it",
                file=sys.stderr,
                flush=True,
            )
            worker.run(status=terminal_status())
    except LoomError as exc:
        print(f"loom: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if worker._threads_left:  # the interpreter would wait for them at its exit
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _add_worker_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    worker = commands.add_parser(
        "worker", help="fire due timers and drive enqueued and abandoned runs until stopped"
    )
    add_store_option(worker)
    worker.add_argument(
        "--flows",
        required=True,
        action="append",
        help="module:attribute naming a flow or a list of flows (repeatable)",
    )
    worker.add_argument(
        "--queues",
        action="append",
        default=[],
        help="module:attribute naming a Queue or a list of queues it admits runs from (repeatable)",
    )
    worker.add_argument("--concurrency", type=int, default=8, help="runs driven at once")
    worker.add_argument("--lease", type=float, default=30.0, help="lease in seconds")
    worker.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds runs in flight get to park or end on SIGTERM before they are released "
        "(then as long again, at most, for threads async flows left running)",
    )
    worker.add_argument(
        "--idle-poll",
        type=_seconds_above_zero,
        default=None,
        help="longest wait between polls when idle, in seconds above 0 (default: 1 s; 60 s on S3)",
    )
    worker.add_argument(
        "--worker-id",
        default=None,
        help="this worker's id in the journal: the owner named by the runs it drives and the "
        "queue places it holds (default: made up for each process). Give a worker restarted "
        "in place (a pod, a systemd unit) the same id each time: at its restart it takes back "
        "at once what its earlier process held, instead of a lease later. At most one running "
        "worker may have a given id",
    )


def _seconds_above_zero(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"--idle-poll is a number of seconds above 0, not {text}")
    return seconds


def _lint_command(paths: Sequence[str]) -> int:
    from loom_kernel._tools import lint_paths  # noqa: PLC0415 - only this command needs it

    missing = [path for path in paths if not os.path.exists(path)]
    findings, unreadable = lint_paths(path for path in paths if path not in missing)
    for finding in findings:
        print(finding)
    for problem in [*(f"{path}: no such file or directory" for path in missing), *unreadable]:
        print(f"loom lint: cannot read {problem}", file=sys.stderr)
    print(f"{len(findings)} problem(s)" if findings else "no problems found")
    return 1 if findings or unreadable or missing else 0


def _installed_commands(commands: Any) -> dict[str, _Handler]:
    """Add the commands published in the `loom.commands` entry-point group; one that
    fails to load is named on stderr and left out (the others still run)."""
    handlers: dict[str, _Handler] = {}
    for point in entry_points(group=COMMAND_GROUP):
        try:
            handlers.update(point.load()(commands))
        except Exception as exc:  # a broken plugin never takes the command line down
            print(f"loom: command {point.name!r} not loaded: {exc}", file=sys.stderr)
    return handlers


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `loom` command line; returns the exit status."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`loom ls | head`): say nothing more, and let the
        # interpreter's last flush of stdout go nowhere instead of failing again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="loom", description="Loom, durable execution for Python.")
    commands = parser.add_subparsers(dest="command", required=True)
    stores = commands.add_parser(
        "stores", help="list the installed stores and check each with an append/read round trip"
    )
    stores.add_argument(
        "urls", nargs="*", help="store URLs to check (default: the self-checking ones)"
    )
    demo = commands.add_parser(
        "demo", help="run an order-approval flow (a step, two gates, a timer) and print its journal"
    )
    demo.add_argument(
        "--store",
        default=None,
        help="store URL (default: sqlite://loom-demo.db when loom-store-sqlite is installed, "
        "else memory://)",
    )
    listing = commands.add_parser(
        "ls", help="list the executions in a store, newest first, with their status and times"
    )
    add_store_option(listing)
    listing.add_argument("--limit", type=_count, default=None, help="list at most this many")
    listing.add_argument(
        "--since", type=since, default=None, help="started since: 2026-12-01T00:00Z, or 30m, 6h, 7d"
    )
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.add_argument(
        "--status",
        action="append",
        choices=["running", "suspended", "completed", "failed", "cancelled"],
        help="only runs with this status (repeatable); answered from the run index",
    )
    listing.add_argument("--flow", default=None, help="only runs of this flow")
    show = commands.add_parser("show", help="print an execution's journal as a timeline")
    show.add_argument("execution_id")
    add_store_option(show)
    lint = commands.add_parser(
        "lint", help="find what makes flows non-deterministic, by reading their source"
    )
    lint.add_argument("paths", nargs="+", help="files or directories (links are not followed)")
    _add_worker_command(commands)
    from loom_kernel._hosting._deploy import add_deploy_commands  # noqa: PLC0415 - imports the engine

    handlers = add_deploy_commands(commands)
    handlers.update(add_operate_commands(commands))
    from loom_kernel._hosting._ui import add_ui_command  # noqa: PLC0415 - imports the engine

    handlers.update(add_ui_command(commands))
    handlers.update(_installed_commands(commands))
    args = parser.parse_args(argv)
    if args.command in handlers:
        return handlers[args.command](args)
    if args.command == "worker":
        return _worker_command(args)
    if args.command == "lint":
        return _lint_command(args.paths)
    if args.command == "stores":
        return _stores_command(args.urls)
    if args.command in ("ls", "show"):
        return _inspect_command(args)
    if args.command == "demo":
        from loom_kernel._hosting._demo import run_demo  # noqa: PLC0415 - only this command needs it

        default = "sqlite://loom-demo.db" if "sqlite" in installed_stores() else "memory://"
        try:
            return run_demo(args.store or default)
        except LoomError as exc:
            print(f"loom: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse exits first
    return 2  # pragma: no cover
