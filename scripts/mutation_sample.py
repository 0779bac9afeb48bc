"""Sample mutations of Loom's code and count how many the test suite catches.

    python3 -m uv run python scripts/mutation_sample.py [--sample 200] [--seed 1]
        [--only kernel|stores|postgres|orchestration]
        [--equivalent scripts/equivalent-mutants.txt]
        [--mutants ID ...] [--check-equivalents]

Each mutant is one small change to one module, made on its syntax tree: a statement
deleted, `return X` made `return None`, a comparison or a boolean flipped, an integer
constant off by one. The sampler copies the source tree to a scratch directory once,
runs each package's tests there once under coverage, then the top-level tests (the
packages and stores together) under coverage of every sampled package, to learn which
tests run each line; then for each sampled mutant it writes the mutated module, runs
the tests that run its line (stopping at the first failure; slow tests and Ceph
RGW's excluded), and if they pass, its package's whole suite (a test may run the line
in a process of its own, which coverage does not follow); a line no test runs in
pytest's own process, or one run at import time, gets the whole suite at once. A
mutant that survives those meets last the tests, of any package or the top-level
ones, that run some line of its module (a class field only a top-level test uses).
Then it puts the module back. A mutant is caught when a test fails (or the run times out).

Mutant ids (`loom_kernel/_core/_codec.py:41:0:delete statement`: the module under its
package's `src`, then line, column, operator) are stable for a given source, so a mutant
judged unable to change behaviour (an equivalent mutant) can be listed in the
`--equivalent` file and left out of the score. The score is printed with the survivors.
Not part of CI: a run of 200 mutants takes about half an hour on two cores.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "kernel": ("packages/loom-kernel/src/loom_kernel", ["packages/loom-kernel/tests"]),
    "sqlite": (
        "packages/loom-store-sqlite/src/loom_store_sqlite",
        ["packages/loom-store-sqlite/tests"],
    ),
    "s3": ("packages/loom-store-s3/src/loom_store_s3", ["packages/loom-store-s3/tests"]),
    "postgres": (
        "packages/loom-store-postgres/src/loom_store_postgres",
        ["packages/loom-store-postgres/tests"],
    ),
    "orchestration": (
        "packages/loom-orchestration/src/loom_orchestration",
        ["packages/loom-orchestration/tests"],
    ),
}
#: The tests of the packages together (the runtime on every store, its processes): run
#: for a mutant when they reach its line, as the package's own tests are.
TOP_LEVEL = "tests"
GROUPS = {
    "kernel": ["kernel"],
    "stores": ["sqlite", "s3", "postgres"],
    "postgres": ["postgres"],
    "orchestration": ["orchestration"],
}
#: Modules a mutant of which no test should be expected to catch: the command line's
#: printing, the demo's narration, the benchmark-only and typing-only helpers, and the
#: test support a store ships for its own tests (`testing.py`, `pytest_plugin.py`: the
#: local S3 servers), as the kernel's `testing/` package is left out.
SKIPPED = {
    "_cli.py",
    "_demo.py",
    "_timeline.py",
    "__init__.py",
    "_deploy.py",
    "testing.py",
    "pytest_plugin.py",
}
FLIPS = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}


@dataclass(frozen=True)
class Mutant:
    package: str
    path: Path  # relative to ROOT
    number: int  # which site of the module, in walk order
    line: int
    column: int
    operator: str
    statement_line: int  # the first line of the statement holding it (what coverage sees)
    text: str  # the source line it is on, stripped (what an equivalent entry is anchored to)
    at_import: bool = False  # outside every function body: it runs as the module is imported

    @property
    def module(self) -> str:
        """The module's path in its package's source, e.g. `loom_kernel/_core/_codec.py`."""
        return "/".join(self.path.parts[self.path.parts.index("src") + 1 :])

    @property
    def id(self) -> str:
        return f"{self.module}:{self.line}:{self.column}:{self.operator}"


def _is_export_list(node: ast.AST) -> bool:
    """`__all__ = [...]`: what `import *` takes, which no module of the project uses."""
    return isinstance(node, ast.Assign) and any(
        isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
    )


def _is_type_variable(node: ast.AST) -> bool:
    """`T = TypeVar("T")`: read only by annotations, which are strings at run time
    (every module has `from __future__ import annotations`)."""
    return (
        isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "TypeVar"
    )


def _is_docstring(node: ast.AST) -> bool:
    """A docstring, or the `...` body of an abstract method or an overload."""
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and (isinstance(node.value.value, str) or node.value.value is Ellipsis)
    )


def _sites(tree: ast.Module) -> Iterator[tuple[ast.AST, str]]:
    """Every place a mutation can be made, with the operator's name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and type(node.ops[0]) in FLIPS:
            yield node, f"flip {type(node.ops[0]).__name__}"
        elif isinstance(node, ast.BoolOp):
            yield node, f"flip {type(node.op).__name__}"
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node, "drop not"
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            yield node, f"flip {node.value}"
        elif (
            isinstance(node, ast.Constant)
            and type(node.value) is int
            and not isinstance(node.value, bool)
        ):
            yield node, f"{node.value}+1"
        elif (
            isinstance(node, ast.Return)
            and node.value is not None
            and not (isinstance(node.value, ast.Constant) and node.value.value is None)
        ):
            yield node, "return None"
        elif isinstance(
            node, ast.Expr | ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Raise | ast.Delete
        ) and not (_is_docstring(node) or _is_export_list(node) or _is_type_variable(node)):
            yield node, "delete statement"


def _mutate(tree: ast.Module, number: int) -> ast.Module:
    """A copy of `tree` with site `number` mutated."""
    mutated = copy.deepcopy(tree)
    node, _operator = list(_sites(mutated))[number]
    if isinstance(node, ast.Compare):
        node.ops[0] = FLIPS[type(node.ops[0])]()
    elif isinstance(node, ast.BoolOp):
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif isinstance(node, ast.UnaryOp):
        _replace_expression(mutated, node, node.operand)
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        node.value = not node.value
    elif isinstance(node, ast.Constant):
        node.value = node.value + 1
    elif isinstance(node, ast.Return):
        node.value = ast.Constant(value=None)
    else:
        _replace_with_pass(mutated, node)
    return ast.fix_missing_locations(mutated)


def _replace_with_pass(tree: ast.Module, target: ast.AST) -> None:
    for parent in ast.walk(tree):
        for _field, value in ast.iter_fields(parent):
            if isinstance(value, list) and target in value:
                value[value.index(target)] = ast.Pass()
                return


def _replace_expression(tree: ast.Module, target: ast.AST, replacement: ast.expr) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, field, replacement)
                return
            if isinstance(value, list) and target in value:
                value[value.index(target)] = replacement
                return


def _all_mutants(packages: list[str]) -> list[Mutant]:
    found: list[Mutant] = []
    for package in packages:
        source_dir, _tests = PACKAGES[package]
        for path in sorted((ROOT / source_dir).rglob("*.py")):
            if path.name in SKIPPED or "testing" in path.parts:
                continue
            source = path.read_text()
            source_lines = source.splitlines()
            tree = ast.parse(source)
            statements = _statement_lines(tree)
            bodies = _function_bodies(tree)
            for number, (node, operator) in enumerate(_sites(tree)):
                line = statements.get(id(node), getattr(node, "lineno", 0))
                found.append(
                    Mutant(
                        package,
                        path.relative_to(ROOT),
                        number,
                        getattr(node, "lineno", 0),
                        getattr(node, "col_offset", 0),
                        operator,
                        line,
                        source_lines[getattr(node, "lineno", 1) - 1].strip(),
                        not any(first <= line <= last for first, last in bodies),
                    )
                )
    return found


def _function_bodies(tree: ast.Module) -> list[tuple[int, int]]:
    """The lines of every function's (and lambda's) body: what runs when it is called,
    not as its module is imported (its decorators and defaults do)."""
    bodies = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            bodies.append((node.body[0].lineno, node.end_lineno or node.body[-1].lineno))
        elif isinstance(node, ast.Lambda):
            bodies.append((node.body.lineno, node.body.end_lineno or node.body.lineno))
    return bodies


def _statement_lines(tree: ast.Module) -> dict[int, int]:
    """For each node (by id), the first line of the innermost statement holding it."""
    lines: dict[int, int] = {}
    for statement in ast.walk(tree):  # outer statements come first; inner ones overwrite
        if isinstance(statement, ast.stmt):
            for node in ast.walk(statement):
                lines[id(node)] = statement.lineno
    return lines


#: {source path relative to the scratch copy: {line: {test node ids}}}; an empty
#: node id set means the line runs at import time.
Coverage = dict[str, dict[int, set[str]]]


def _coverage(scratch: Path, packages: list[str], timeout: float) -> Coverage:
    """Run each package's tests once under coverage, one context per test; then the
    top-level tests (`tests/`: the stores and packages together) under coverage of
    every sampled package, so a mutant is also run against those that reach its line."""
    lines: Coverage = {}
    for package in packages:
        source, tests = PACKAGES[package]
        _measure(scratch, package, sources=[source], tests=tests, timeout=timeout, lines=lines)
    everything = [PACKAGES[package][0] for package in packages]
    _measure(
        scratch,
        "top-level",
        sources=everything,
        tests=[TOP_LEVEL],
        timeout=timeout,
        lines=lines,
        # Their moto cases take a minute each under coverage, near the per-test limit:
        # the S3 store's own tests run on moto.
        deselect="not rgw and not moto",
    )
    return lines


def _measure(
    scratch: Path,
    name: str,
    *,
    sources: list[str],
    tests: list[str],
    timeout: float,
    lines: Coverage,
    deselect: str = "not rgw",
) -> None:
    """Run `tests` (those `deselect`, a `-k` expression, keeps) under coverage of
    `sources`, adding to `lines` which test ran which line."""
    import coverage  # noqa: PLC0415 (a dev dependency, only this script needs it)

    data_file = scratch / f".coverage-{name}"
    run = subprocess.run(
        [
            *_pytest_command("0"),
            "-k",
            deselect,
            *(f"--cov={scratch / source}" for source in sources),
            "--cov-context=test",
            "--cov-report=",
            *(str(scratch / test) for test in tests),
        ],
        cwd=scratch,
        env={**_environment(scratch), "COVERAGE_FILE": str(data_file)},
        capture_output=True,
        text=True,
        timeout=timeout * 4,
        check=False,
    )
    if run.returncode != 0:
        raise SystemExit(
            f"{name}'s tests failed under coverage, so no mutant can be judged:\n"
            + "\n".join(run.stdout.splitlines()[-120:])
        )
    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    for measured in data.measured_files():
        by_line = lines.setdefault(str(Path(measured).relative_to(scratch)), {})
        for line, contexts in data.contexts_by_lineno(measured).items():
            tests_here = by_line.setdefault(line, set())
            tests_here.update(
                context.split("|")[0] for context in contexts if context.split("|")[0]
            )


def _tests_for(mutant: Mutant, lines: Coverage) -> list[str] | None:
    """The tests that run the mutant's line; None for the package's whole suite (a line
    run at import time), [] when no test runs it.

    A line outside every function body runs at import time whatever coverage says:
    a module imported before coverage starts (by a pytest plugin that an entry point
    loads first) has none of its import-time lines measured."""
    if mutant.at_import:
        return None
    by_line = lines.get(str(mutant.path), {})
    # A statement spread over lines (a multi-line condition) may record no event on
    # its first line, only on the lines of its parts: the mutant's own line counts too.
    ran = [by_line[line] for line in (mutant.statement_line, mutant.line) if line in by_line]
    if not ran:
        return []
    tests = {test for found in ran for test in found if "rgw" not in test}
    return sorted(tests) if tests else None


def _module_tests(mutant: Mutant, lines: Coverage) -> list[str]:
    """The tests outside the mutant's package (the top-level ones, another package's)
    that run some line of its module: for a line run at import time (a field of a
    class, a constant), the tests that use what it defines, wherever they live."""
    own = tuple(PACKAGES[mutant.package][1])  # run already, as its package's suite
    by_line = lines.get(str(mutant.path), {})
    found = {test for tests in by_line.values() for test in tests}
    return sorted(test for test in found if "rgw" not in test and not test.startswith(own))


def _run(scratch: Path, mutant: Mutant, timeout: float, lines: Coverage) -> str:
    """'caught', 'survived' or 'timeout' (caught) for one mutant."""
    tests = _tests_for(mutant, lines)
    if tests == []:
        tests = None  # no test runs its line in pytest's process: the whole suite
    target = scratch / mutant.path
    original = target.read_text()
    mutated = ast.unparse(_mutate(ast.parse(original), mutant.number))
    target.write_text(mutated)
    try:
        code = _pytest(scratch, mutant.package, timeout, tests)
        if code == 0 and tests is not None:
            # Tests that run the line in a process of their own (the command line's)
            # are not seen by coverage: a survivor goes to its package's whole suite.
            code = _pytest(scratch, mutant.package, timeout)
        others = _module_tests(mutant, lines)
        if code == 0 and others:
            # The package's suite is not every test of it: the top-level tests reach
            # the module too (a class field only they construct).
            code = _pytest(scratch, mutant.package, timeout, others)
        outcome = "survived" if code == 0 else "caught"
    except subprocess.TimeoutExpired:
        outcome = "timeout"
    finally:
        target.write_text(original)
    return outcome


def _environment(scratch: Path) -> dict[str, str]:
    """Imports resolve to the scratch copy's sources, not the installed ones."""
    source_dirs = [str((scratch / source).parent) for source, _ in PACKAGES.values()]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(source_dirs)}


def _check_baseline(scratch: Path, packages: list[str], timeout: float) -> None:
    """Unmutated, the copy imports itself and its tests pass: else every mutant would
    look caught (or none)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import loom_kernel; print(loom_kernel.__file__)"],
        env=_environment(scratch),
        capture_output=True,
        text=True,
        check=True,
    )
    if not probe.stdout.startswith(str(scratch)):
        raise SystemExit(f"the copy is not what is imported: {probe.stdout.strip()}")
    for package in packages:
        if _pytest(scratch, package, timeout, show=True) != 0:
            raise SystemExit(f"the unmutated tests of {package} fail: fix them first")


#: Seconds one test may take before pytest-timeout fails it: a mutant that makes a
#: test hang (a lost wake-up, a lock never released) is caught in this long, not at
#: the whole run's `--timeout`. The baseline run checks no test of the unmutated
#: tree takes as long.
PER_TEST_SECONDS: Final = 60


def _pytest_command(workers: str) -> list[str]:
    """pytest on the fast tests, quietly, with no cache, on `workers` processes, each
    test failed once it runs `PER_TEST_SECONDS`."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "not slow",
        "-p",
        "no:cacheprovider",
        "--timeout",
        str(PER_TEST_SECONDS),
        "-n",
        workers,
        # Not the project's loadgroup: with -n 0 it still leaves coverage's per-test
        # contexts empty, so every mutant ran its package's whole suite.
        "--dist",
        "no" if workers == "0" else "load",
    ]


def _pytest(
    scratch: Path,
    package: str,
    timeout: float,
    only: list[str] | None = None,
    *,
    show: bool = False,
) -> int:
    _source, tests = PACKAGES[package]
    targets = only if only is not None else [str(scratch / test) for test in tests]
    workers = "2" if only is None or len(only) > 40 else "0"
    done = subprocess.run(
        [
            *_pytest_command(workers),
            "-x",
            "-k",
            "not rgw",  # the S3 store is judged on moto: Ceph RGW's start costs a minute
            *targets,
        ],
        cwd=scratch,
        env=_environment(scratch),
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    if show and done.returncode != 0:  # why the baseline failed
        print(done.stdout.decode(errors="replace")[-4000:], file=sys.stderr)
    return done.returncode


_EQUIVALENT_LINE = re.compile(r"^(?P<id>[^`#]+?)\s+`(?P<anchor>[^`]*)`\s*(#.*)?$")


def _equivalents(listing: Path, mutants: list[Mutant]) -> set[str]:
    """The ids, in today's tree, of the mutants the listing names.

    Each entry is `id `anchor`  # reason`: the id as printed when it was judged, and
    the source line it was on. Lines move, so an entry names the mutant of the same
    module, column and operator on a line reading the anchor, nearest to the line the
    id gives. An entry that no longer matches anything is reported, not guessed.
    """
    found: set[str] = set()
    modules = {mutant.module for mutant in mutants}
    for number, raw in enumerate(listing.read_text().splitlines(), 1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        match = _EQUIVALENT_LINE.match(raw.strip())
        if match is None:
            raise SystemExit(f"{listing}:{number}: not `id `source line`  # reason`")
        module, line, column, operator = match["id"].split(":", 3)
        if module not in modules:
            continue  # a package not sampled this time
        candidates = [
            mutant
            for mutant in mutants
            if mutant.module == module
            and mutant.column == int(column)
            and mutant.operator == operator
            and mutant.text == match["anchor"]
        ]
        if not candidates:
            print(f"{listing}:{number}: {match['id']} matches nothing now; judge it again")
            continue
        found.add(min(candidates, key=lambda mutant: abs(mutant.line - int(line))).id)
    return found


def _shard(text: str) -> tuple[int, int]:
    """`K/N` as (K, N), with 1 <= K <= N."""
    match = re.fullmatch(r"(\d+)/(\d+)", text)
    if match is None or not 1 <= int(match[1]) <= int(match[2]):
        raise SystemExit(f"--shard takes K/N with 1 <= K <= N, not {text!r}")
    return int(match[1]), int(match[2])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sample", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", choices=sorted(GROUPS), action="append")
    parser.add_argument(
        "--equivalent", type=Path, default=ROOT / "scripts" / "equivalent-mutants.txt"
    )
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument(
        "--mutants",
        nargs="+",
        default=None,
        help="run these mutant ids (as printed) instead of a sample, e.g. to check survivors",
    )
    parser.add_argument(
        "--shard",
        default="1/1",
        help="K/N: run the K-th of N interleaved parts of the sample (N processes, each "
        "with its own scratch copy, share the cores; add their counts for the score)",
    )
    parser.add_argument(
        "--check-equivalents",
        action="store_true",
        help="only say how many entries of the --equivalent list match a mutant of "
        "today's tree (each one that matches nothing is named), then exit; without --only",
    )
    args = parser.parse_args()
    shard, shards = _shard(args.shard)
    # Groups overlap (postgres is one of the stores): each package once.
    packages = list(
        dict.fromkeys(p for group in (args.only or sorted(GROUPS)) for p in GROUPS[group])
    )
    mutants = _all_mutants(packages)
    equivalent = _equivalents(args.equivalent, mutants) if args.equivalent.exists() else set()
    if args.check_equivalents:
        listed = sum(
            1
            for raw in args.equivalent.read_text().splitlines()
            if raw.strip() and not raw.lstrip().startswith("#")
        )
        print(f"{len(equivalent)} of {listed} entries match a mutant of today's tree")
        raise SystemExit(0 if len(equivalent) == listed else 1)
    if args.mutants:
        wanted = set(args.mutants)
        chosen = [mutant for mutant in mutants if mutant.id in wanted]
        missing = wanted - {mutant.id for mutant in chosen}
        if missing:
            raise SystemExit(f"no such mutant here: {', '.join(sorted(missing))}")
    else:
        chosen = random.Random(args.seed).sample(mutants, min(args.sample, len(mutants)))
    print(f"{len(mutants)} mutation sites in {', '.join(packages)}; sampling {len(chosen)}")
    with tempfile.TemporaryDirectory(prefix="loom-mutants-") as scratch_name:
        scratch = Path(scratch_name)
        for part in ("packages", "tests", "docs", "conftest.py", "pyproject.toml"):
            source = ROOT / part
            if source.is_dir():
                shutil.copytree(
                    source, scratch / part, ignore=shutil.ignore_patterns("__pycache__")
                )
            else:
                shutil.copy(source, scratch / part)
        _check_baseline(scratch, packages, args.timeout)
        lines = _coverage(scratch, packages, args.timeout)
        counts = {"caught": 0, "survived": 0, "timeout": 0, "equivalent": 0}
        survivors: list[Mutant] = []
        started = time.monotonic()
        in_order = sorted(chosen, key=lambda m: (str(m.path), m.number))
        for index, mutant in enumerate(in_order, 1):
            if index % shards != shard - 1:
                continue
            if mutant.id in equivalent:
                counts["equivalent"] += 1
                continue
            outcome = _run(scratch, mutant, args.timeout, lines)
            counts[outcome] += 1
            if outcome == "survived":
                survivors.append(mutant)
            print(f"[{index}/{len(chosen)}] {outcome:<8} {mutant.id}", flush=True)
    judged = counts["caught"] + counts["timeout"] + counts["survived"]
    score = (counts["caught"] + counts["timeout"]) / judged if judged else 1.0
    print(
        f"\ncaught {counts['caught'] + counts['timeout']} of {judged} behaviour-changing "
        f"mutants ({score:.1%}); {counts['equivalent']} listed as equivalent; "
        f"{time.monotonic() - started:.0f} s"
    )
    for mutant in survivors:
        print(f"SURVIVED {mutant.id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
