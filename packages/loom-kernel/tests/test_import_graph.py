"""The kernel's modules import each other without a cycle (type-checking imports aside),
and the layers point one way: the pure core never imports the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import loom_kernel

PACKAGE = Path(loom_kernel.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path) -> set[str]:
    """The kernel modules `path` imports when it runs (not under `if TYPE_CHECKING:`)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.startswith("loom_kernel"):
                    found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("loom_kernel"))
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    visit(
                        [n for n in inner if isinstance(n, ast.stmt)]
                        + [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body]
                    )

    visit(ast.parse(path.read_text()).body)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {
        name: {target for target in _runtime_imports(path) if target in modules and target != name}
        for name, path in modules.items()
    }


def test_no_import_cycle_inside_the_kernel() -> None:
    graph = _graph()
    state: dict[str, str] = {}

    def walk(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if target.endswith("__init__") or target == "loom_kernel":
                continue  # the package's own namespace re-exports; never imported inside
            if state.get(target) == "open":
                raise AssertionError(" -> ".join([*trail, module, target]))
            if target not in state:
                walk(target, [*trail, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module, [])


def test_the_pure_core_does_not_import_the_runtime() -> None:
    graph = _graph()
    core = [
        "loom_kernel._core._events",
        "loom_kernel._core._codec",
        "loom_kernel._core._state",
        "loom_kernel._core._fast_fold",
        "loom_kernel._core._canonical",
        "loom_kernel._core._reachability",
    ]
    runtime = {
        "loom_kernel._engine._facade",
        "loom_kernel._replay._context",
        "loom_kernel._replay._driving",
    }
    for module in core:
        seen, todo = set(), [module]
        while todo:
            current = todo.pop()
            for target in graph.get(current, set()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        assert not seen & runtime, f"{module} reaches {sorted(seen & runtime)}"
