"""The operator's verbs as a user runs them (`python -m loom_kernel ...` in a
subprocess, the store named by LOOM_STORE): describe, steps, cancel, send, and ls's
header, --limit and --json; a bad id, a run in the wrong state or a store that
cannot be opened is one `loom: ...` line and exit status 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from loom_kernel import Context, Engine, Queue, Rate, RetryPolicy, Status, flow, open_store


@flow(name="ops.parks", version="1")
def parks(ctx: Context, _input: Any) -> Any:
    ctx.step("prepare", lambda: {"ready": True})
    ctx.set_event("progress", 1)
    return ctx.suspend("approve")


@flow(name="ops.listens", version="1")
def listens(ctx: Context, _input: Any) -> Any:
    return ctx.receive("orders")


@flow(name="ops.fails", version="1")
def fails(ctx: Context, _input: Any) -> Any:
    def boom() -> None:
        raise ValueError("no stock")

    ctx.step("ok", lambda: 1)
    return ctx.step("charge", boom, retry=RetryPolicy(attempts=2, backoff=0))


FLOWS = [parks, listens, fails]


def loom(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "LOOM_STORE": url}
    return subprocess.run(
        [sys.executable, "-m", "loom_kernel", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
        check=False,
    )


@pytest.fixture
def url(tmp_path: Path) -> str:
    address = f"sqlite:///{tmp_path}/ops.db"
    with open_store(address) as store:
        engine = Engine(store, FLOWS, listeners=[])
        engine.start("ops.parks", {"order": 7}, key="order-7")
        engine.start("ops.parks", None, key="order-7/c0", parent="order-7")
        engine.start("ops.listens", key="inbox-1")
        engine.send("inbox-1", "early", topic="other")
        engine.start("ops.fails", key="broken")
    return address


def test_describe_says_what_a_run_is_and_waits_for(url: str) -> None:
    done = loom(url, "describe", "order-7")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.startswith("order-7: ops.parks (code ")
    assert "suspended" in text.splitlines()[0]
    assert "waiting on gate 'approve'" in text
    assert "child order-7/c0 (ops.parks): suspended" in text
    assert "published 'progress': 1" in text
    described = loom(url, "describe", "inbox-1", "--json")
    assert described.returncode == 0, described.stderr
    data = json.loads(described.stdout)
    assert data["status"] == "suspended"
    assert data["topics"] == ["orders"]
    assert data["inbox"] == {"messages": 1, "unread": 1}
    failed = json.loads(loom(url, "describe", "broken", "--json").stdout)
    assert failed["error"]["type"] == "loom_kernel.StepFailedError"


def test_steps_lists_each_step_its_outcome_and_attempts(url: str) -> None:
    lines = loom(url, "steps", "broken").stdout.splitlines()
    assert lines[0].split() == ["#", "STEP", "OUTCOME", "TRIES", "RESULT"]
    assert lines[1].split()[:4] == ["0", "ok", "ok", "1"]
    assert lines[2].split()[:4] == ["1", "charge", "failed", "2"]
    assert "ValueError: no stock" in lines[2]
    rows = json.loads(loom(url, "steps", "order-7", "--json").stdout)
    assert [row["name"] for row in rows] == ["prepare", "loom.event:progress"]
    assert rows[0]["result"] == {"ready": True}


def test_cancel_ends_a_run_once_and_refuses_a_finished_one(url: str) -> None:
    done = loom(url, "cancel", "order-7/c0", "--reason", "customer asked")
    assert (done.returncode, done.stdout.strip()) == (0, "order-7/c0: cancelled")
    again = loom(url, "cancel", "order-7/c0")
    assert again.returncode == 1
    assert again.stderr.strip() == "loom: order-7/c0 is cancelled: there is nothing to cancel"
    with open_store(url) as store:
        assert Engine(store, listeners=[]).get("order-7/c0").cancel_reason == "customer asked"


def test_send_journals_a_message_a_worker_delivers(url: str) -> None:
    done = loom(url, "send", "inbox-1", '{"sku": 42}', "--topic", "orders", "--key", "o-1")
    assert done.returncode == 0, done.stderr
    assert "message 2 in its inbox" in done.stdout
    assert (
        "message 2"
        in loom(url, "send", "inbox-1", '"again"', "--topic", "orders", "--key", "o-1").stdout
    )
    with open_store(url) as store:
        worker = Engine(store, FLOWS, listeners=[])
        worker.recover()
        assert worker.get("inbox-1").result == {"sku": 42}
    bad = loom(url, "send", "order-7", "not json")
    assert bad.returncode == 1
    assert bad.stderr.startswith("loom: InvalidArgumentError: MESSAGE is JSON")


def test_resume_journals_a_gate_resume_a_worker_drives_on(url: str) -> None:
    wrong = loom(url, "resume", "order-7", '"yes"', "--on", "finance")
    assert wrong.returncode == 1
    assert wrong.stderr.startswith("loom: NotSuspendedError")
    done = loom(url, "resume", "order-7", '{"ok": true}', "--on", "approve", "--key", "r-1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "order-7: resumed at 'approve'; a worker drives it on"
    again = loom(url, "resume", "order-7", '{"ok": true}', "--key", "r-1")
    assert "delivered already" in again.stdout
    with open_store(url) as store:
        worker = Engine(store, FLOWS, listeners=[])
        worker.recover()
        assert worker.get("order-7").result == {"ok": True}
    finished = loom(url, "resume", "order-7", "1")
    assert finished.returncode == 1
    assert finished.stderr.startswith("loom: NotSuspendedError")


def test_queues_shows_each_queues_limits_waiting_and_active(url: str, tmp_path: Path) -> None:
    (tmp_path / "ops_queues.py").write_text(
        "from loom_kernel import Queue, Rate\n"
        "QUEUES = [Queue('mail', concurrency=2, per_key=1, rate=Rate(10, per=60)), Queue('idle')]\n"
    )
    with open_store(url) as store:
        engine = Engine(
            store,
            FLOWS,
            listeners=[],
            queues=[Queue("mail", concurrency=2, per_key=1, rate=Rate(10, per=60)), Queue("idle")],
        )
        for number in range(3):
            engine.enqueue("ops.listens", key=f"mail-{number}", queue="mail")
    environment = {
        **os.environ,
        "LOOM_STORE": url,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-m", "loom_kernel", "queues", "--queues", "ops_queues:QUEUES"],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["QUEUE", "WAITING", "ACTIVE", "LIMITS"]
    assert lines[1].split()[:3] == ["mail", "3", "0"]
    assert "concurrency 2, per key 1, rate 10 per 60 s" in lines[1]
    assert lines[2].split() == ["idle", "0", "0", "none"]
    bad = loom(url, "queues", "--queues", "no_such_module:QUEUES")
    assert bad.returncode == 1
    assert bad.stderr.startswith("loom: ")


def test_retry_starts_an_ended_run_again_for_a_worker(url: str) -> None:
    refused = loom(url, "retry", "order-7")
    assert refused.returncode == 1
    assert "only a run that ended" in refused.stderr
    done = loom(url, "retry", "broken", "--from-step", "1", "--key", "broken-2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "broken-2: started again from broken; a worker drives it"
    too_far = loom(url, "retry", "broken", "--from-step", "5")
    assert too_far.returncode == 1
    assert too_far.stderr.startswith("loom: InvalidArgumentError: from_step is at most 2")
    with open_store(url) as store:
        worker = Engine(store, FLOWS, listeners=[])
        worker.recover()
        again = worker.get("broken-2")
        assert (again.status, again.retry_of) == (Status.FAILED, "broken")
    assert "started again from broken" in loom(url, "describe", "broken-2").stdout
    with open_store(url) as store:
        worker = Engine(store, FLOWS, listeners=[])
        assert [frame.name for frame in worker.frames("broken-2").values()] == ["ok", "charge"]


def test_ls_lists_newest_first_with_times_a_limit_a_since_and_json(url: str) -> None:
    lines = loom(url, "ls").stdout.splitlines()
    assert lines[0].split() == ["ID", "FLOW", "STATUS", "STARTED", "ENDED", "WAITING", "ON"]
    assert len(lines) == 5
    listed = json.loads(loom(url, "ls", "--json").stdout)
    assert [run["id"] for run in listed] == ["broken", "inbox-1", "order-7/c0", "order-7"]
    starts = [run["started_at"] for run in listed]
    assert starts == sorted(starts, reverse=True), "newest first"
    assert listed[0]["ended_at"] is not None
    assert listed[1]["ended_at"] is None, "a parked run has not ended"
    assert listed[2]["parent"] == "order-7"
    assert listed[0]["status"] == Status.FAILED.value
    assert len(json.loads(loom(url, "ls", "--json", "--limit", "2").stdout)) == 2
    assert json.loads(loom(url, "ls", "--json", "--since", "2h").stdout) == listed
    assert json.loads(loom(url, "ls", "--json", "--since", "2999-01-01T00:00Z").stdout) == []
    bad = loom(url, "ls", "--since", "yesterday")
    assert bad.returncode == 2
    assert "--since is an ISO 8601 time" in bad.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["describe", "nobody"], "loom: ExecutionNotFoundError"),
        (["steps", "nobody"], "loom: ExecutionNotFoundError"),
        (["cancel", "nobody"], "loom: ExecutionNotFoundError"),
        (["send", "nobody", "1"], "loom: ExecutionNotFoundError"),
        (["send", "broken", "1"], "loom: RunFinishedError"),
        (["describe", "bad//id"], "loom: InvalidIdError"),
    ],
)
def test_a_bad_id_or_a_run_in_the_wrong_state_is_one_line(
    url: str, args: list[str], says: str
) -> None:
    done = loom(url, *args)
    assert done.returncode == 1
    assert done.stderr.startswith(says), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_store_that_cannot_be_opened_is_one_line(tmp_path: Path) -> None:
    done = loom(f"sqlite:///{tmp_path}/typo.db", "describe", "x")
    assert done.returncode == 1
    assert "no SQLite database at" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "typo.db").exists()
