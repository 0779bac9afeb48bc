"""`loom lint`: find what makes a flow non-deterministic, by reading its source (no import).

A flow's body re-runs on every resume and must ask for the same calls each time, so
anything in it that can differ between runs (the clock, randomness, the environment,
I/O, threads, the order of a set) belongs in a step. Step functions (lambdas and
nested functions) are not linted for that: they run once and are journaled; nor is a
helper function the flow calls (lint it as a flow by giving it `ctx` first). Names
are followed through imports (`from time import time`, `import random as r`). What a
flow is: a function decorated with `@flow`, or whose first parameter is `ctx`.

The walk is iterative and never follows a symbolic link, so a link loop ends.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final

import attrs

__all__ = ["Finding", "lint_paths", "lint_source", "python_files"]


@attrs.frozen
class Finding:
    """One problem: where, which rule, what it is and how to fix it."""

    path: str
    line: int
    column: int
    rule: str
    message: str
    fix: str

    def __str__(self) -> str:
        return (
            f"{self.path}:{self.line}:{self.column}: {self.rule} {self.message} (fix: {self.fix})"
        )


#: Calls whose result differs between runs: dotted name -> (rule, what, fix).
_CALLS: Final[dict[str, tuple[str, str, str]]] = {}
for _names, _rule, _what, _fix in (
    (
        (
            "time.time",
            "time.time_ns",
            "time.monotonic",
            "time.perf_counter",
            "datetime.now",
            "datetime.utcnow",
            "datetime.today",
            "date.today",
            "datetime.datetime.now",
            "datetime.datetime.utcnow",
            "datetime.date.today",
        ),
        "LOOM001",
        "reads the wall clock in a flow body",
        "use ctx.now(), which is journaled",
    ),
    (
        (
            "random.random",
            "random.randint",
            "random.choice",
            "random.shuffle",
            "random.uniform",
            "random.sample",
            "random.randrange",
            "os.urandom",
            "secrets.token_hex",
            "secrets.token_bytes",
            "secrets.choice",
        ),
        "LOOM002",
        "draws a random value in a flow body",
        "use ctx.random(), or draw it inside a ctx.step",
    ),
    (
        ("uuid.uuid1", "uuid.uuid4"),
        "LOOM003",
        "makes a random UUID in a flow body",
        "use ctx.uuid(), which is journaled",
    ),
    (
        ("os.getenv", "os.environ.get"),
        "LOOM004",
        "reads the environment in a flow body",
        "read it inside a ctx.step, or pass it in the flow's input",
    ),
    (
        (
            "threading.Thread",
            "multiprocessing.Process",
            "concurrent.futures.ThreadPoolExecutor",
            "ThreadPoolExecutor",
            "ProcessPoolExecutor",
            "asyncio.to_thread",
        ),
        "LOOM005",
        "starts a thread or process in a flow body",
        "do the work in a ctx.step, or start a child flow",
    ),
    (
        (
            "open",
            "requests.get",
            "requests.post",
            "requests.put",
            "requests.delete",
            "requests.request",
            "httpx.get",
            "httpx.post",
            "urllib.request.urlopen",
            "urlopen",
            "socket.socket",
            "socket.create_connection",
            "subprocess.run",
            "subprocess.Popen",
            "subprocess.check_output",
            "sqlite3.connect",
            "Path.read_text",
            "Path.write_text",
        ),
        "LOOM006",
        "does I/O in a flow body",
        "do I/O inside a ctx.step, whose result is journaled",
    ),
    (
        ("time.sleep", "asyncio.sleep", "trio.sleep", "anyio.sleep"),
        "LOOM010",
        "sleeps in a flow body: the wait holds a worker's slot and is not journaled",
        "use ctx.sleep(seconds) (await it in an async flow), a durable timer",
    ),
):
    for _name in _names:
        _CALLS[_name] = (_rule, _what, _fix)

_AWAITABLE_CTX_CALLS: Final = frozenset(
    {"step", "suspend", "sleep", "receive", "set_event", "wait_first"}
)
_SET_MAKERS: Final = frozenset({"set", "frozenset"})


def _unawaited(call: ast.Call, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether an awaitable's call is used as if it were its result: discarded, taken
    for a truth value, compared, or returned (a coroutine is always true, and never
    equal to a result)."""
    parent = parents.get(call)
    if isinstance(parent, ast.Expr | ast.BoolOp | ast.Compare | ast.Return):
        return True
    if isinstance(parent, ast.UnaryOp):
        return isinstance(parent.op, ast.Not)
    return isinstance(parent, ast.If | ast.While | ast.IfExp | ast.Assert) and (parent.test is call)


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a Name or Attribute chain, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _imported_names(tree: ast.Module) -> dict[str, str]:
    """What each imported name stands for: `t` -> `time` for `import time as t`,
    `uuid4` -> `uuid.uuid4` for `from uuid import uuid4`."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _flow_names(tree: ast.Module) -> set[str]:
    """The names `flow` is known by in a module (`from loom_kernel import flow as lf`)."""
    names = {"flow"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loom_kernel"):
            names.update(alias.asname or alias.name for alias in node.names if alias.name == "flow")
    return names


def _is_flow(node: ast.FunctionDef | ast.AsyncFunctionDef, flow_names: set[str]) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = _dotted(target)
        if name is not None and name.split(".")[-1] in flow_names:
            return True
    arguments = node.args.posonlyargs + node.args.args
    return bool(arguments) and arguments[0].arg == "ctx"


class _FlowChecker:
    """The rules, applied to one flow function."""

    def __init__(
        self,
        path: str,
        flow: ast.FunctionDef | ast.AsyncFunctionDef,
        imported: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self.imported = imported or {}
        self.flow = flow
        self.is_async = isinstance(flow, ast.AsyncFunctionDef)
        arguments = flow.args.posonlyargs + flow.args.args
        self.ctx = arguments[0].arg if arguments else "ctx"
        self.nested = {
            node.name: node
            for node in ast.walk(flow)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node is not flow
        }
        self.findings: list[Finding] = []

    def add(self, node: ast.AST, rule: str, message: str, fix: str) -> None:
        line, column = getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
        self.findings.append(Finding(self.path, line, column + 1, rule, message, fix))

    def check(self) -> list[Finding]:
        parents: dict[ast.AST, ast.AST] = {}
        todo: list[ast.AST] = [
            statement
            for statement in self.flow.body
            if not isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        for statement in todo:
            parents[statement] = self.flow
        while todo:  # the flow's own body: nested functions and lambdas are not walked into
            node = todo.pop()
            self.check_node(node, parents)
            for child in ast.iter_child_nodes(node):
                parents[child] = node
                if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                    todo.append(child)
        return sorted(self.findings, key=lambda finding: (finding.line, finding.column))

    def check_node(self, node: ast.AST, parents: dict[ast.AST, ast.AST]) -> None:
        if isinstance(node, ast.Call):
            self.check_call(node, parents)
        elif isinstance(node, ast.Subscript) and self.resolve(node.value) == "os.environ":
            self.add(node, *_CALLS["os.getenv"])
        elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
            iterable = node.iter
            if isinstance(iterable, ast.Set | ast.SetComp) or (
                isinstance(iterable, ast.Call) and _dotted(iterable.func) in _SET_MAKERS
            ):
                self.add(
                    iterable,
                    "LOOM009",
                    "iterates over a set, whose order differs between processes",
                    "iterate over sorted(...) instead",
                )

    def resolve(self, node: ast.expr) -> str | None:
        """The dotted name of `node` with its head as imported (`t.time` -> `time.time`)."""
        name = _dotted(node)
        if name is None:
            return None
        head, dot, rest = name.partition(".")
        if head == self.ctx or head not in self.imported:
            return name
        return self.imported[head] + dot + rest

    def check_call(self, call: ast.Call, parents: dict[ast.AST, ast.AST]) -> None:
        name = _dotted(call.func)
        if name is None:
            return
        resolved = self.resolve(call.func) or name
        found = _CALLS.get(resolved) or _CALLS.get(".".join(resolved.split(".")[-2:]))
        imported = name.partition(".")[0] in self.imported  # not a local named `secrets`
        if found is None and imported and resolved.startswith(("random.", "secrets.")):
            found = _CALLS["random.random"]
        if found is not None:
            self.add(call, *found)
            return
        head, _, method = name.partition(".")
        if head != self.ctx:
            return
        if method == "step" and len(call.args) >= 2:
            self.check_step_function(call.args[1])
        if self.is_async and method in _AWAITABLE_CTX_CALLS and _unawaited(call, parents):
            self.add(
                call,
                "LOOM008",
                f"calls {name}(...) without await in an async flow: it does not happen",
                f"await {name}(...)",
            )

    def check_step_function(self, function: ast.expr) -> None:
        body: ast.AST | None = function if isinstance(function, ast.Lambda) else None
        if isinstance(function, ast.Name):
            body = self.nested.get(function.id)
        if body is None:
            return
        for node in ast.walk(body):
            if isinstance(node, ast.Call) and (_dotted(node.func) or "").startswith(self.ctx + "."):
                self.add(
                    node,
                    "LOOM007",
                    f"uses {self.ctx} inside a step function (refused at run time)",
                    "call ctx between steps, or start another flow from the step",
                )


def lint_source(source: str, path: str = "<source>") -> list[Finding]:
    """The findings in one module's source text.

    Raises:
        SyntaxError: the source is not Python.
    """
    tree = ast.parse(source, filename=path)
    flow_names = _flow_names(tree)
    imported = _imported_names(tree)
    findings: list[Finding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _is_flow(node, flow_names):
            findings.extend(_FlowChecker(path, node, imported).check())
    return findings


def python_files(paths: Iterable[str]) -> Iterator[Path]:
    """The .py files under `paths`, walked iteratively, never through a symbolic link.

    A path given is used as it is; a link met while walking (to a file or a
    directory, a loop included) is skipped, as are hidden directories and caches.
    """
    todo = [Path(path) for path in paths]
    while todo:
        path = todo.pop()
        if path.is_file():
            if path.suffix == ".py":
                yield path
            continue
        if not path.is_dir():
            continue
        with os.scandir(path) as entries:
            found = sorted(entries, key=lambda entry: entry.name, reverse=True)
        for entry in found:
            if entry.is_symlink() or entry.name.startswith(".") or entry.name == "__pycache__":
                continue
            if entry.is_dir(follow_symlinks=False) or entry.name.endswith(".py"):
                todo.append(Path(entry.path))


def lint_paths(paths: Iterable[str]) -> tuple[list[Finding], list[str]]:
    """Lint every Python file under `paths`.

    Returns:
        The findings, and the files that could not be read or parsed (with why).
    """
    findings: list[Finding] = []
    unreadable: list[str] = []
    for path in python_files(paths):
        try:
            findings.extend(lint_source(path.read_text(encoding="utf-8"), str(path)))
        except (OSError, ValueError, SyntaxError, MemoryError, RecursionError) as exc:
            unreadable.append(f"{path}: {type(exc).__name__}: {exc}")
    return findings, unreadable
