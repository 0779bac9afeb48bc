"""`loom lint`: each rule finds its problem with file:line and a fix; the walk ends on a
symbolic-link loop; the project's own examples and demo are clean."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from loom_kernel._hosting._cli import main
from loom_kernel._tools import lint_source, python_files

ROOT = Path(__file__).parents[3]

BAD_FLOW = """
import asyncio, os, random, time, threading, uuid
from datetime import datetime
from loom_kernel import flow

@flow
def bad(ctx, order):
    started = time.time()                       # LOOM001
    when = datetime.now()                       # LOOM001
    pick = random.choice([1, 2])                # LOOM002
    key = uuid.uuid4()                          # LOOM003
    region = os.environ["REGION"]               # LOOM004
    region = os.getenv("REGION")                # LOOM004
    threading.Thread(target=print).start()      # LOOM005
    data = open("orders.csv").read()            # LOOM006
    ctx.step("nested", lambda: ctx.now())       # LOOM007
    for sku in {"a", "b"}:                      # LOOM009
        ctx.step(sku, print)
    time.sleep(5)                               # LOOM010
    ctx.sleep(5)
    fine = ctx.step("clock", time.time)         # a reference, run by the step: fine
    also = ctx.step("wait", lambda: time.sleep(1))  # in a step: fine
    also_fine = ctx.step("io", lambda: open("x").read())
    return [sorted(set(order))]

@flow
async def forgetful(ctx, order):
    ctx.suspend("approve")                      # LOOM008
    ctx.receive("shipped")                      # LOOM008
    ctx.set_event("status", "paid")             # LOOM008
    if ctx.suspend("approve"):                  # LOOM008
        pass
    if not ctx.suspend("approve"):              # LOOM008
        pass
    await asyncio.sleep(1)                      # LOOM010
    await ctx.sleep(1)
    later = ctx.step("later", print)            # a coroutine awaited below: fine
    await later
    await ctx.step("ok", print)
    secrets = {"token": "x"}
    token = secrets.get("token")                # a local named secrets: fine
    return [x for x in set(order)]              # LOOM009

def helper(order):
    return time.time()                          # not a flow: not linted
"""


def test_every_rule_finds_its_problem_with_its_line() -> None:
    findings = lint_source(BAD_FLOW, "bad.py")
    found = {(f.rule, f.line) for f in findings}
    lines = {
        number: line.split("# ")[-1].strip()
        for number, line in enumerate(BAD_FLOW.splitlines(), start=1)
        if "# LOOM" in line
    }
    assert found == {(rule, number) for number, rule in lines.items()}
    first = next(f for f in findings if f.rule == "LOOM001")
    assert str(first).startswith("bad.py:8:15: LOOM001 reads the wall clock")
    assert "fix: use ctx.now()" in str(first)


IMPORTED_NAMES = """
import time as t
from time import time
from random import random, getrandbits
from uuid import uuid4
from os import environ
from loom_kernel import flow

@flow
def aliased(ctx, order):
    a = t.time()                                # LOOM001
    b = time()                                  # LOOM001
    c = random()                                # LOOM002
    d = getrandbits(8)                          # LOOM002
    e = uuid4()                                 # LOOM003
    f = environ.get("REGION")                   # LOOM004
    g = environ["REGION"]                       # LOOM004

    def stamp():
        return time()                           # a step function: fine

    if order:
        def later():
            return t.time()                     # nested deeper: not walked either
    return ctx.step("stamp", stamp)
"""


def test_names_are_followed_through_imports_and_nested_functions_are_not_walked() -> None:
    found = sorted((f.rule, f.line) for f in lint_source(IMPORTED_NAMES, "aliased.py"))
    expected = sorted(
        (line.split("# ")[-1].strip(), number)
        for number, line in enumerate(IMPORTED_NAMES.splitlines(), start=1)
        if "# LOOM" in line
    )
    assert found == expected


def test_a_file_too_deep_to_parse_is_reported_not_raised(tmp_path: Path) -> None:
    (tmp_path / "deep.py").write_text("x = " + "-" * 200_000 + "1\n")
    (tmp_path / "nul.py").write_bytes(b"x = 1\x00\n")
    from loom_kernel._tools import lint_paths

    findings, unreadable = lint_paths([str(tmp_path)])
    assert findings == []
    assert len(unreadable) == 2


def test_a_flow_is_found_by_its_decorator_or_its_ctx_parameter() -> None:
    source = textwrap.dedent(
        """
        import time
        from loom_kernel import flow as lf
        @lf(name="x", version="2")
        def decorated(context, _):
            return time.time()
        def by_parameter(ctx, _):
            return time.time()
        """
    )
    assert [f.line for f in lint_source(source)] == [6, 8]


def test_the_walk_does_not_follow_links_and_ends_on_a_loop(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "deep").mkdir(parents=True)
    (tmp_path / "pkg" / "deep" / "flows.py").write_text(BAD_FLOW)
    (tmp_path / "pkg" / "clean.py").write_text("x = 1\n")
    os.symlink(tmp_path / "pkg", tmp_path / "pkg" / "deep" / "loop")  # a cycle
    os.symlink(tmp_path / "pkg" / "deep" / "flows.py", tmp_path / "pkg" / "alias.py")
    (tmp_path / "pkg" / ".hidden").mkdir()
    (tmp_path / "pkg" / ".hidden" / "skip.py").write_text(BAD_FLOW)
    files = sorted(path.relative_to(tmp_path).as_posix() for path in python_files([str(tmp_path)]))
    assert files == ["pkg/clean.py", "pkg/deep/flows.py"]


def test_the_walk_yields_files_in_name_order_each_directory_before_the_next(
    tmp_path: Path,
) -> None:
    for name in ("b.py", "a.py", "c/d.py", "c/a.py", "ca.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    files = [path.relative_to(tmp_path).as_posix() for path in python_files([str(tmp_path)])]
    assert files == ["a.py", "b.py", "c/a.py", "c/d.py", "ca.py"]  # the lint's output order


def test_the_command_exits_non_zero_on_problems_and_zero_when_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.py").write_text(BAD_FLOW)
    (tmp_path / "broken.py").write_text("def (:\n")
    assert main(["lint", str(tmp_path / "bad.py")]) == 1
    assert "LOOM006 does I/O in a flow body" in capsys.readouterr().out
    assert main(["lint", str(tmp_path / "broken.py")]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert main(["lint", str(tmp_path / "missing")]) == 1


def test_the_projects_own_examples_and_demo_are_clean(capsys: pytest.CaptureFixture[str]) -> None:
    demo = ROOT / "packages" / "loom-kernel" / "src" / "loom_kernel" / "_hosting" / "_demo.py"
    assert main(["lint", str(ROOT / "docs" / "examples"), str(demo)]) == 0
    assert "no problems found" in capsys.readouterr().out


def test_a_call_through_a_module_attribute_is_matched_by_its_last_two_names() -> None:
    source = "import tools\nfrom loom_kernel import flow\n@flow\ndef f(ctx, _):\n"
    source += "    return tools.datetime.now()\n"
    assert [f.rule for f in lint_source(source, "via.py")] == ["LOOM001"]


def test_ctx_calls_with_fewer_arguments_than_a_step_are_clean() -> None:
    source = textwrap.dedent(
        """
        from loom_kernel import flow
        @flow
        def gated(ctx, _):
            name = ctx.suspend("approve")
            ctx.sleep(5)
            ctx.step(name)  # refused when it runs, not the linter's business
            return ctx.now()
        """
    )
    assert lint_source(source) == []


def test_a_step_function_defined_in_the_flow_and_passed_by_name_is_walked_for_ctx() -> None:
    source = textwrap.dedent(
        """
        from loom_kernel import flow

        @flow
        def by_name(ctx, order):
            def fetch():
                return ctx.now()
            def clean():
                return order
            ctx.step("clean", clean)
            return ctx.step("fetch", fetch)
        """
    )
    assert [(f.rule, f.line) for f in lint_source(source, "named.py")] == [("LOOM007", 7)]


ORDERED_LOOPS = """
from loom_kernel import flow

@flow
def ordered(ctx, order):
    for i in range(3):
        ctx.step(f"s{i}", print)
    for sku in sorted(set(order)):
        ctx.step(sku, print)
    return [x for x in list(order)]
"""


def test_loops_over_calls_that_are_not_sets_are_not_flagged() -> None:
    """LOOM009 is for a set's order: `range(...)`, `sorted(set(...))` and `list(...)`
    iterate in an order every process shares."""
    assert lint_source(ORDERED_LOOPS, "ordered.py") == []
