"""`loom replay-check` and `loom migrate`: check stored runs against the code you are
about to deploy, and move the runs that replay onto it (K11)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from loom_kernel._coordination import Queue, execution_ids
from loom_kernel._core import InvalidArgumentError, LoomError, NonDeterminismError
from loom_kernel._engine import Engine, Execution, parts_of
from loom_kernel._hosting._store_option import add_store_option
from loom_kernel._replay import Flow, flow
from loom_kernel._spi import open_store

__all__ = ["add_deploy_commands", "load_flows"]


def _load(spec: str, option: str, example: str) -> list[Any]:
    """The object `module:attribute` names, as a list (a list, tuple or set is spread).

    The module is imported, never evaluated from text, looked for first in the current
    directory (as uvicorn and celery do), then on `sys.path`.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise InvalidArgumentError(f"{option} takes module:attribute ({example}), not {spec!r}")
    what = option.removeprefix("--")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        value: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (
            module_name == exc.name or module_name.startswith(exc.name + ".")
        ):
            raise _cannot_load(what, spec, exc) from exc  # the module itself imports it
        raise InvalidArgumentError(
            f"cannot load {what} from {spec!r}: no module named {exc.name!r} in the current "
            f"directory ({here}) or on the module path: run loom where {module_name}.py "
            f"(or its package) is, name the module by its package path ({example}), or "
            "add its directory to PYTHONPATH"
        ) from exc
    except Exception as exc:  # anything its import raised: a SyntaxError, an error of its own
        raise _cannot_load(what, spec, exc) from exc
    try:
        for part in attribute.split("."):
            value = getattr(value, part)
    except AttributeError as exc:
        raise _cannot_load(what, spec, exc) from exc
    return list(value) if isinstance(value, list | tuple | set | frozenset) else [value]


def _cannot_load(what: str, spec: str, exc: Exception) -> InvalidArgumentError:
    return InvalidArgumentError(f"cannot load {what} from {spec!r}: {type(exc).__name__}: {exc}")


def load_flows(spec: str) -> list[Flow]:
    """The flows named by `module:attribute`: a Flow, a plain function of (ctx, input)
    defined in that module, or a list of them.

    Raises:
        InvalidArgumentError: the spec is malformed, or names something that is not a
            flow (`os.path:join`, say).
    """
    items = _load(spec, "--flows", "myapp.flows:FLOWS")
    if not items:
        raise InvalidArgumentError(f"{spec!r} is an empty list: it names no flow")
    for item in items:
        if not isinstance(item, Flow) and not _looks_like_a_flow(item):
            name = getattr(item, "__qualname__", None) or type(item).__name__
            where = getattr(item, "__module__", None)
            shown = f"{where}.{name}" if where else name
            raise InvalidArgumentError(
                f"{spec!r} names {shown}, which is not a flow: a flow is a function of "
                "(ctx, input), best decorated with @flow (from loom_kernel import flow)"
            )
    return [item if isinstance(item, Flow) else flow(item) for item in items]


def _looks_like_a_flow(item: object) -> bool:
    """A plain function that can be a flow: a Python function (not a builtin or a class)
    taking exactly two positional parameters, ctx and the input."""
    if not inspect.isfunction(item):
        return False
    parameters = list(inspect.signature(item).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(parameters) == 2 and all(p.kind in positional for p in parameters)


def load_queues(spec: str) -> list[Queue]:
    """The queues named by `module:attribute` (a Queue, or a list of them).

    Raises:
        InvalidArgumentError: the spec is malformed, or names nothing that is a queue.
    """
    items = _load(spec, "--queues", "myapp.flows:QUEUES")
    if not items or not all(isinstance(item, Queue) for item in items):
        raise InvalidArgumentError(f"{spec!r} is not a Queue or a list of queues")
    return items


class _UnhostedError(LoomError):
    """A live run of a flow the new code does not have: deploying it strands the run."""


def _candidates(
    engine: Engine, args: argparse.Namespace, seen: list[int]
) -> Iterator[tuple[str, Execution | LoomError]]:
    """The live runs (filtered by --flow, at most --limit), in id order, each with its
    id; a run that cannot be read, or whose flow the new code lacks, comes as an
    error. `seen[0]` counts every run in the store."""
    given = 0
    for execution_id in execution_ids(engine.store):
        seen[0] += 1
        if args.limit is not None and given >= args.limit:
            return
        try:
            execution = engine.get(execution_id)
        except LoomError as exc:
            given += 1
            yield execution_id, exc
            continue
        if execution.status.finished or (args.flow and execution.flow != args.flow):
            continue
        given += 1
        if not engine.hosts(execution.flow):
            yield (
                execution_id,
                _UnhostedError(
                    f"{execution.status.value} run of flow {execution.flow!r}, which the new "
                    "code does not define: deploying it would strand this run"
                ),
            )
            continue
        yield execution_id, execution


#: What checking or migrating one run came to, and the line that says so.
_Outcome = tuple[str, str]


def _run(args: argparse.Namespace, act: Callable[[Engine, Execution], _Outcome]) -> int:
    try:
        flows = load_flows(args.flows)
        store = open_store(args.store, create=False)
    except LoomError as exc:
        print(f"loom: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    counts = {"ok": 0, "migrate": 0, "diverged": 0, "failed": 0}
    seen = [0]
    with store:
        engine = Engine(store, flows, listeners=[])
        if args.flow is not None and not _known_flow(engine, args.flow):
            print(
                f"loom: no flow {args.flow!r} in {args.flows}, and no run of it in the "
                "store: is --flow right? (a mistyped name would check nothing)",
                file=sys.stderr,
            )
            return 2
        for execution_id, found in _candidates(engine, args, seen):
            if isinstance(found, _UnhostedError):
                counts["failed"] += 1
                print(f"UNHOSTED   {execution_id}: {found}")
                continue
            if isinstance(found, LoomError):
                counts["failed"] += 1
                print(f"ERROR      {execution_id}: {type(found).__name__}: {found}")
                continue
            try:
                outcome, line = act(engine, found)
            except NonDeterminismError as exc:
                counts["diverged"] += 1
                print(
                    f"DIVERGES   {found.id} ({found.flow}, pinned {found.code_hash}): "
                    f"{exc.what} #{exc.index} recorded {exc.recorded!r}, "
                    f"the new code asks for {exc.found!r}"
                )
                continue
            except LoomError as exc:
                counts["failed"] += 1
                print(f"ERROR      {found.id}: {type(exc).__name__}: {exc}")
                continue
            counts[outcome] += 1
            print(line)
    if not seen[0]:
        print(
            f"loom: the store at {args.store} holds no runs at all: is --store right?",
            file=sys.stderr,
        )
        return 2
    print(
        f"{counts['ok']} ok, {counts['migrate']} need a migrate, {counts['diverged']} would "
        f"diverge, {counts['failed']} could not be checked"
    )
    if counts["migrate"]:
        print(
            f"loom: the new code refuses {counts['migrate']} run(s) pinned to other code until "
            f"they are moved to it: loom migrate --store {args.store} --flows {args.flows} "
            "(or keep their version registered beside the new one)",
            file=sys.stderr,
        )
    return 1 if counts["migrate"] or counts["diverged"] or counts["failed"] else 0


def _known_flow(engine: Engine, name: str) -> bool:
    """Whether the flows loaded define `name`, or the store holds a run of it."""
    if engine.hosts(name):
        return True
    try:
        return next(iter(engine.executions(flow=name)), None) is not None
    except LoomError:
        return True  # the listing below says what is wrong


def _check(engine: Engine, execution: Execution) -> _Outcome:
    """Whether the new code drives a live run as it is: its pinned code is the newest
    (and its history replays on it), or kept registered beside it. A run pinned to
    code the new flows lack is refused by them (CodeVersionError) until `loom migrate`
    moves it, even when its history replays: that needs a migrate."""
    newest = engine.newest(execution.flow).code_hash
    pinned = execution.code_hash
    if (
        pinned
        and pinned != newest
        and parts_of(engine).driver.flows.hosts_code(execution.flow, pinned)
    ):
        # Kept registered beside the new code (versioning.md, way 1): driven on its own.
        return "ok", (
            f"ok         {execution.id} ({execution.flow}): pinned {pinned}, which these flows keep"
        )
    engine.replay_check(execution.id)
    if pinned and pinned != newest:
        return "migrate", (
            f"MIGRATE    {execution.id} ({execution.flow}): pinned {pinned}, which these "
            f"flows lack; it replays on {newest}: move it with loom migrate"
        )
    return "ok", f"ok         {execution.id} ({execution.flow})"


def _migrator(reason: str | None) -> Callable[[Engine, Execution], _Outcome]:
    def migrate(engine: Engine, execution: Execution) -> _Outcome:
        moved = engine.resume_as(execution.id, engine.newest(execution.flow), reason=reason)
        if moved.code_hash == execution.code_hash:
            return "ok", f"ok         {execution.id} ({execution.flow}): already on this code"
        change = f"{execution.code_hash} -> {moved.code_hash}"
        return "ok", f"migrated   {execution.id} ({execution.flow}): {change}"

    return migrate


def _positive(text: str) -> int:
    number = int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"a limit is at least 1, not {number}")
    return number


def add_deploy_commands(commands: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add `replay-check` and `migrate` to the `loom` command's subparsers."""
    check = commands.add_parser(
        "replay-check",
        help="replay the store's live runs on the code you are about to deploy, writing nothing",
    )
    migrate = commands.add_parser(
        "migrate", help="move every live run whose history replays onto the given code (resume_as)"
    )
    for parser in (check, migrate):
        add_store_option(parser)
        parser.add_argument(
            "--flows", required=True, help="module:attribute of the flows to check against"
        )
        parser.add_argument("--flow", default=None, help="only runs of this flow")
        parser.add_argument("--limit", type=_positive, default=None, help="at most this many runs")
    migrate.add_argument("--reason", default=None, help="recorded in each run's _migrations")
    return {
        "replay-check": lambda args: _run(args, _check),
        "migrate": lambda args: _run(args, _migrator(args.reason)),
    }
