"""`loom schedule ...` as a user runs it (a subprocess of the installed `loom`), on
SQLite: create, ls, describe, pause, unpause, trigger, backfill and delete, each
printing what it did; bad input is a one-line `loom: ...` and a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LOOM = [
    sys.executable,
    "-c",
    "from loom_kernel._hosting._cli import main; raise SystemExit(main())",
]


def loom(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*LOOM, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
        check=False,
    )
    if ok:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def store(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/loom.db"


def test_a_schedule_through_its_whole_life_on_the_command_line(store: str) -> None:
    created = loom(
        "schedule", "create", "nightly", "--flow", "report", "--cron", "0 3 * * *",
        "--input", '{"region": "eu"}', "--overlap", "buffer_one", "--timezone",
        "Europe/Paris", "--store", store,
    )  # fmt: skip
    assert "nightly: report at '0 3 * * *' (Europe/Paris), overlap buffer_one" in created.stdout
    assert "active; next ticks: " in created.stdout

    listing = loom("schedule", "ls", "--store", store).stdout.splitlines()
    assert listing[0].split() == ["NAME", "FLOW", "CRON", "NEXT", "COUNTS"]
    assert listing[1].startswith("nightly ")
    assert "started 0, skipped 0, missed 0" in listing[1]
    [shown] = json.loads(loom("schedule", "ls", "--json", "--store", store).stdout)
    assert shown["input"] == {"region": "eu"}
    assert shown["timezone"] == "Europe/Paris"
    assert len(shown["next_ticks"]) >= 1
    assert all(tick.endswith(("T01:00:00Z", "T02:00:00Z")) for tick in shown["next_ticks"])

    paused = loom("schedule", "pause", "nightly", "--note", "db migration", "--store", store)
    assert "paused (db migration); next ticks: -" in paused.stdout
    assert "paused" in loom("schedule", "ls", "--store", store).stdout.splitlines()[1]
    unpaused = loom("schedule", "unpause", "nightly", "--store", store)
    assert "active; next ticks: " in unpaused.stdout

    triggered = loom("schedule", "trigger", "nightly", "--store", store).stdout.strip()
    assert triggered.startswith("sched/nightly@")
    backfilled = loom(
        "schedule", "backfill", "nightly", "--start", "2026-11-01T00:00Z", "--end",
        "2026-11-04T00:00Z", "--overlap", "allow_all", "--store", store,
    ).stdout  # fmt: skip
    assert "started 3 now" in backfilled
    for day in ("01", "02", "03"):
        assert f"sched/nightly@2026-11-{day}T02:00:00Z" in backfilled  # 03:00 in Paris

    described = json.loads(
        loom("schedule", "describe", "nightly", "--json", "--store", store).stdout
    )
    assert described["counts"]["started"] == 4
    assert described["last_run"] is not None
    text = loom("schedule", "describe", "nightly", "--store", store).stdout
    assert "started 4, skipped 0, missed 0" in text

    assert loom("schedule", "delete", "nightly", "--store", store).stdout.strip() == (
        "deleted nightly"
    )
    assert loom("schedule", "ls", "--store", store).stdout.splitlines()[1:] == []
    gone = loom("schedule", "describe", "nightly", "--store", store, ok=False)
    assert gone.returncode == 1
    assert gone.stderr.startswith("loom: ScheduleNotFoundError: ")


def test_bad_input_is_one_line_and_a_non_zero_exit(store: str, tmp_path: Path) -> None:
    loom("schedule", "create", "a", "--flow", "f", "--cron", "* * * * *", "--store", store)
    cases = [
        (["create", "a", "--flow", "f", "--cron", "* * * * *"], "ScheduleExistsError"),
        (["create", "b", "--flow", "f", "--cron", "61 * * * *"], "cron"),
        (["create", "c/d", "--flow", "f", "--cron", "* * * * *"], "InvalidIdError"),
        (["create", "e", "--flow", "f", "--cron", "* * * * *", "--input", "{"], "not JSON"),
        (["create", "g", "--flow", "f", "--cron", "* * * * *", "--timezone", "Mars/Base"], "zone"),
        (["pause", "nope"], "ScheduleNotFoundError"),
        (["trigger", "nope"], "ScheduleNotFoundError"),
        (["backfill", "a", "--start", "yesterday", "--end", "today"], "ISO 8601"),
    ]
    for args, says in cases:
        done = loom("schedule", *args, "--store", store, ok=False)
        assert done.returncode in (1, 2), args
        assert done.stderr.startswith("loom: "), (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)
        assert says in done.stderr, (args, done.stderr)
    typo = f"sqlite:///{tmp_path}/typo.db"
    for verb in (["ls"], ["pause", "a"], ["delete", "a"]):
        done = loom("schedule", *verb, "--store", typo, ok=False)
        assert done.returncode == 1
        assert "no SQLite database at" in done.stderr
    assert not (tmp_path / "typo.db").exists(), "only create makes a store"
