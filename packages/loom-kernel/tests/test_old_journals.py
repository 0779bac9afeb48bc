"""What an older Loom journaled (the 1.15 run in fixtures/journal_1_15.json) still folds
and goes on: its single-gate run resumes byte for byte as under 1.16, a snapshot's step
frame without `attempts` counts one, and a snapshot from before migrations existed
migrates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from loom_kernel import Context, Engine, MemoryStore, Status, flow
from loom_kernel.spi import JournalStore, NewRecord
from loom_kernel.testing import FakeClock

FIXTURE = Path(__file__).parent / "fixtures" / "journal_1_15.json"


def _load_fixture(store: JournalStore, frame_fields: tuple[str, ...] = ()) -> dict[str, Any]:
    """The 1.15 fixture run, appended to `store` and compacted (only the snapshot knows the
    resume), its snapshot's step frames without `frame_fields`."""
    fixture: dict[str, Any] = json.loads(FIXTURE.read_text())
    stream = "ex/" + fixture["execution_id"]
    records = [
        NewRecord(r["kind"], json.dumps(r["payload"]).encode(), r["timestamp"])
        for r in fixture["records"]
    ]
    store.append(stream, 0, records)
    for _index, frame in fixture["snapshot"]["state"]["steps"]:
        for field in frame_fields:
            del frame[field]
    snapshot = json.dumps(fixture["snapshot"]).encode()
    store.append("snap/" + fixture["execution_id"], 0, [NewRecord("loom.snapshot", snapshot, 0.0)])
    store.trim(stream, 5)  # only the snapshot knows the resume now
    return fixture


def _legacy_store(frame_fields: tuple[str, ...] = ()) -> MemoryStore:
    """A memory store holding the 1.15 fixture run (see `_load_fixture`)."""
    store = MemoryStore()
    _load_fixture(store, frame_fields)
    return store


@flow(name="single_gate", version="1")
def single_gate(ctx: Context, order: Any) -> Any:
    quote = ctx.step("quote", lambda: {"total": 42})
    approval = ctx.suspend("approval")
    return {"order": order, "quote": quote, "approval": approval}


def test_legacy_single_payload_fallback(clock: FakeClock) -> None:
    """ADR 0057 regression 3: a 1.15 log folds `_resumePayload` as a one-entry list, and the
    single-gate run resumes byte-identically to the same run journaled under 1.16."""
    legacy_store = MemoryStore()
    fixture = _load_fixture(legacy_store)
    legacy = Engine(legacy_store, [single_gate], clock=clock)
    state = legacy.state(fixture["execution_id"])
    assert state.resume_payloads == [{"approved": True, "by": "ada"}]
    assert legacy.recover() == [fixture["execution_id"]]
    legacy_done = legacy.get(fixture["execution_id"])
    assert legacy_done.status is Status.COMPLETED
    assert legacy_done.result["approval"] == {"approved": True, "by": "ada"}

    modern_store = MemoryStore()
    modern = Engine(modern_store, [single_gate], clock=clock)
    modern.start("single_gate", {"order": 7}, key="legacy-1")
    modern.resume("legacy-1", {"approved": True, "by": "ada"})
    # The recovering engine first claims the ownerless 1.15 run (docs/running.md);
    # past that record, the run goes on byte for byte as under 1.16 and later.
    legacy_tail = legacy_store.read("ex/legacy-1", 4)
    modern_tail = modern_store.read("ex/legacy-1", 4)
    assert legacy_tail[0].kind == "EXECUTION_CLAIMED"
    assert [(r.kind, r.payload) for r in legacy_tail[1:]] == [
        (r.kind, r.payload) for r in modern_tail
    ]


@pytest.mark.usefixtures("flow_loop")
def test_a_snapshot_frame_without_attempts_counts_one() -> None:
    engine = Engine(_legacy_store(("attempts",)), [], clock=FakeClock(), listeners=[])
    assert engine.frames("legacy-1")[0].attempts == 1


@pytest.mark.usefixtures("flow_loop")
def test_a_snapshot_from_before_migrations_existed_migrates() -> None:
    store = _legacy_store()

    @flow(name="single_gate", version="2")
    def single_gate_v2(ctx: Context, order: Any) -> Any:
        quote = ctx.step("quote", lambda: {"total": 42})
        return {"order": order, "quote": quote, "approval": ctx.suspend("approval")}

    @flow(name="single_gate", version="1")
    def single_gate_v1(ctx: Context, order: Any) -> Any:
        quote = ctx.step("quote", lambda: {"total": 42})
        return {"order": order, "quote": quote, "approval": ctx.suspend("approval")}

    engine = Engine(store, [single_gate_v1, single_gate_v2], clock=FakeClock(), listeners=[])
    assert engine.state("legacy-1").variables["_migrations"] == []
    moved = engine.resume_as("legacy-1", "2", reason="test")
    assert moved.code_hash == "version:2"
    assert len(engine.state("legacy-1").variables["_migrations"]) == 1
