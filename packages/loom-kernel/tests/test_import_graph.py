"""The kernel's folders are its layers, and its imports say so.

Every import counts: at module level, inside functions, and under `if TYPE_CHECKING:`
(a type two modules need belongs below both). The layers, lowest first, are
`LAYERS`; a module imports its own layer's modules and the faces of the layers below
it, never a layer above, never another layer's private module, and never its own
layer's face. Other distributions import only the public faces. No module outside
the engine's folder reads a private member of `Engine`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import loom_kernel

PACKAGE = Path(loom_kernel.__file__).parent
ROOT = PACKAGE.parents[3]
#: The layers, lowest first.
LAYERS = ("_core", "_spi", "_replay", "_coordination", "_engine", "_tools", "_hosting")
#: What other distributions (and the docs' examples) may import of the kernel.
PUBLIC = {"loom_kernel", "loom_kernel.spi", "loom_kernel.events", "loom_kernel.testing"}
#: Standard modules that read a clock, the disk or the network: not in the pure core.
IMPURE = {"os", "time", "socket", "random", "uuid", "secrets", "subprocess", "io", "asyncio"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[tuple[str, int]]:
    """Every module `path` imports (absolute names), with the line, wherever it is."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
            for alias in node.names:  # `from loom_kernel._core import _state`
                yield f"{node.module}.{alias.name}", node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno


def _kernel_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    modules = _kernel_modules()
    return {
        name: {target for target, _ in _imports(path) if target in modules and target != name}
        for name, path in modules.items()
    }


def _layer(module: str) -> int | None:
    """The rank of a module's layer (None for the public faces, above every layer)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_no_import_cycle_anywhere_in_the_kernel() -> None:
    graph = _graph()
    state: dict[str, str] = {}

    def walk(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                raise AssertionError(" -> ".join([*trail, module, target]))
            if target not in state:
                walk(target, [*trail, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module, [])


def test_each_layer_imports_only_itself_and_the_faces_of_the_layers_below() -> None:
    wrong = []
    modules = _kernel_modules()
    for name, path in sorted(modules.items()):
        rank = _layer(name)
        if rank is None:
            continue  # a public face: it may re-export any layer
        own = LAYERS[rank]
        for target, line in _imports(path):
            if not target.startswith("loom_kernel") or target not in modules:
                continue
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            target_rank = _layer(target)
            if target_rank is None:
                wrong.append(f"{where}: a public face, above every layer")
            elif target_rank > rank:
                wrong.append(f"{where}: {LAYERS[target_rank]} is above {own}")
            elif target_rank < rank and target != f"loom_kernel.{LAYERS[target_rank]}":
                wrong.append(f"{where}: another layer's private module (import its face)")
            elif target == f"loom_kernel.{own}" and not name.endswith(own):
                wrong.append(f"{where}: its own layer's face (import the module)")
    assert not wrong, "\n".join(wrong)


def test_the_core_reads_no_clock_and_does_no_io() -> None:
    for path in sorted((PACKAGE / "_core").glob("*.py")):
        used = {target.split(".")[0] for target, _ in _imports(path)}
        assert not used & IMPURE, f"{path.name} imports {sorted(used & IMPURE)}"


def _outside_the_kernel() -> Iterator[Path]:
    for folder in ("packages", "tests", "bench", "docs"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if PACKAGE not in path.parents and ".venv" not in path.parts:
                yield path


def test_other_distributions_use_only_the_kernels_public_faces() -> None:
    modules = _kernel_modules()
    wrong = []
    for path in _outside_the_kernel():
        if {"tests", "bench"} & set(path.relative_to(ROOT).parts):
            continue  # tests and benchmarks may use named seams
        for target, line in _imports(path):
            if target in modules and target not in PUBLIC:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def _engine_private_members() -> set[str]:
    """The names of Engine's private methods and attributes."""
    tree = ast.parse((PACKAGE / "_engine" / "_facade.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    names = set()
    for node in ast.walk(engine):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("_"):
            names.add(node.name)
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr.startswith("_")
        ):
            names.add(node.attr)
    return {name for name in names if not (name.startswith("__") and name.endswith("__"))}


def test_nothing_outside_the_engines_folder_reads_a_private_member_of_engine() -> None:
    private = _engine_private_members()
    candidates = [p for p in PACKAGE.rglob("*.py") if (PACKAGE / "_engine") not in p.parents]
    wrong = []
    for path in [*candidates, *_outside_the_kernel()]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr}")
    assert not wrong, "\n".join(wrong)
