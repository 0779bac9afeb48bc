"""Large payloads as content-addressed blobs: written before the record that names
them, read back byte-identically, shared by equal values, collected only when no
record names them and they are past their grace, never lost to a racing writer."""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dying_store import Crash, DyingStore
from hypothesis import given, settings
from hypothesis import strategies as st
from loom_kernel import Context, Engine, InvalidArgumentError, MemoryStore, Retention, flow
from loom_kernel import open_store as open_any
from loom_kernel.spi import (
    BlobNotFoundError,
    FsspecBlobs,
    JournalStore,
    MemoryBlobs,
    NewRecord,
    collect_blobs,
)
from loom_kernel.testing import FakeClock

BIG = 70 * 1024  # over the default threshold (64 KiB)


@flow(name="blob.big")
def big(ctx: Context, size: int) -> Any:
    data = ctx.step("make", lambda: {"text": "x" * size, "n": size})
    ctx.set_event("made", data)
    message = ctx.receive("more")
    return {"got": len(message["text"]), "made": len(data["text"])}


@flow(name="blob.random")
def randomly(ctx: Context, size: int) -> Any:
    return ctx.step("noise", lambda: "".join(random.choice("ab") for _ in range(size)))


FLOWS = [big, randomly]


def _memory(clock: Callable[[], float] = lambda: 1_000.0) -> JournalStore:
    store = MemoryStore()
    store.use_blobs(MemoryBlobs(clock))
    return store


@pytest.fixture(params=["memory", "sqlite", "moto"])
def blobbed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[JournalStore]:
    if request.param == "memory":
        store = _memory()
    elif request.param == "sqlite":
        store = open_any(f"sqlite:///{tempfile.mkdtemp(dir=tmp_path)}/loom.db")
    else:
        store = request.getfixturevalue("moto_server").store()
    assert store.blobs is not None, "every store keeps large payloads as blobs by default"
    yield store
    store.close()


def test_large_payloads_go_to_blobs_and_come_back_byte_identical(blobbed: JournalStore) -> None:
    engine = Engine(blobbed, FLOWS, listeners=[])
    engine.start("blob.big", BIG, key="b")
    engine.send("b", {"text": "y" * BIG}, topic="more")
    assert engine.get("b").result == {"got": BIG, "made": BIG}
    assert engine.get_events("b")["made"]["n"] == BIG
    for stream in ("ex/b", "inbox/b", "events/b"):
        journaled = blobbed.raw_read(stream)
        assert any(r.payload.startswith(b"\x00loom.blob\x00") for r in journaled), stream
        assert max(len(r.payload) for r in journaled) < 1024, "only references journaled"
    fresh = Engine(blobbed, FLOWS, listeners=[])  # a cold read, through the blobs
    assert fresh.frames("b")[0].result == {"text": "x" * BIG, "n": BIG}
    assert blobbed.blobs is not None
    assert collect_blobs(blobbed, grace=0).deleted == (), "every blob is named by a record"


def test_equal_values_share_one_blob_whatever_their_key_order() -> None:
    store = _memory()
    text = "z" * BIG
    one = json.dumps({"a": 1, "b": text}).encode()
    two = json.dumps({"b": text, "a": 1}).encode()
    store.append("s", 0, [NewRecord("k", one, 1.0), NewRecord("k", two, 1.0)])
    assert store.blobs is not None
    assert len(list(store.blobs.entries())) == 1
    assert [json.loads(r.payload) for r in store.read("s")] == [{"a": 1, "b": text}] * 2


def test_a_payload_that_looks_like_a_reference_is_refused() -> None:
    store = _memory()
    with pytest.raises(InvalidArgumentError):
        store.append("s", 0, [NewRecord("k", b"\x00loom.blob\x00" + b"x" * BIG, 1.0)])
    with pytest.raises(InvalidArgumentError):
        store.use_blobs(MemoryBlobs(), threshold=0)


def test_a_reference_whose_blob_is_gone_is_an_error_never_a_payload() -> None:
    store = _memory()
    store.append("s", 0, [NewRecord("k", b"x" * BIG, 1.0)])
    assert store.blobs is not None
    for key, _at in list(store.blobs.entries()):
        store.blobs.delete(key)
    with pytest.raises(BlobNotFoundError):
        store.read("s")


def test_collection_keeps_named_and_young_blobs() -> None:
    clock = FakeClock(1_000.0)
    store = _memory(clock)
    engine = Engine(store, FLOWS, listeners=[], clock=clock)
    engine.start("blob.random", BIG, key="kept")
    assert store.blobs is not None
    store.blobs.put(*_orphan("old"))
    clock.advance(100)
    store.blobs.put(*_orphan("young"))
    dry = collect_blobs(store, grace=50, now=clock, dry_run=True)
    assert dry.deleted == (_orphan("old")[0],)
    assert (dry.referenced, dry.young) == (2, 1), "the step's record and the run's end"
    assert len(list(store.blobs.entries())) == 4, "a dry run deletes nothing"
    assert collect_blobs(store, grace=50, now=clock).deleted == (_orphan("old")[0],)
    assert engine.frames("kept")[0].result is not None


def _orphan(tag: str) -> tuple[str, bytes]:
    content = json.dumps(tag * BIG).encode()
    return "sha256:" + hashlib.sha256(content).hexdigest(), content


def test_retention_then_collection_leaves_no_blob_of_a_deleted_run() -> None:
    clock = FakeClock(1_000.0)
    store = _memory(clock)
    engine = Engine(store, FLOWS, listeners=[], clock=clock)
    engine.start("blob.random", BIG, key="r")
    clock.advance(100)
    engine.gc(Retention(keep_for=0))
    assert store.blobs is not None
    assert len(collect_blobs(store, grace=10, now=clock).deleted) == 2
    assert list(store.blobs.entries()) == []


@pytest.mark.parametrize("after", [False, True], ids=["before-it-lands", "after-it-lands"])
def test_a_kill_between_a_blob_and_its_record_leaves_no_dangling_reference(after: bool) -> None:
    """Die at every store call of a run whose step writes a blob, then collect and
    resume: the run finishes, every record's blob is there, and the orphan of the
    dead attempt (a different value: the step is not deterministic) is collected."""
    clock = FakeClock(1_000.0)
    calls = DyingStore(_memory(clock), 10**9, after=False, as_it_dies=lambda: None)
    calls.use_blobs(MemoryBlobs(clock))
    Engine(calls, FLOWS, listeners=[], clock=clock).start("blob.random", BIG, key="k")
    for at in range(1, calls.calls + 1):
        inner = MemoryStore()
        blobs = MemoryBlobs(clock)
        inner.use_blobs(blobs)
        dying = DyingStore(inner, at, after=after, as_it_dies=lambda: None)
        dying.use_blobs(blobs)  # the blob is written before the call that dies
        with pytest.raises(Crash):
            Engine(dying, FLOWS, listeners=[], clock=clock).start("blob.random", BIG, key="k")
        clock.advance(100)
        collect_blobs(inner, grace=10, now=clock)
        engine = Engine(inner, FLOWS, listeners=[], clock=clock)
        engine.recover()
        assert len(engine.start("blob.random", BIG, key="k").result) == BIG, at
        clock.advance(100)
        collect_blobs(inner, grace=10, now=clock)
        named = {r.payload for s in inner.streams() for r in inner.raw_read(s)}
        keys = {key for key, _ in blobs.entries()}
        assert {p[len(b"\x00loom.blob\x00") :].decode() for p in named if p[:1] == b"\x00"} == (
            keys
        ), at


@settings(max_examples=40, deadline=None)
@given(stall=st.floats(0, 100), grace=st.floats(0, 50), collect_at=st.sampled_from([0, 1, 2]))
def test_a_writer_racing_the_collector_never_loses_its_blob(
    stall: float, grace: float, collect_at: int
) -> None:
    """The collector runs before the writer's blob, between the blob and its record
    (the writer stalled for `stall` seconds there), or after the record: the record
    always reads back."""
    clock = FakeClock(1_000.0)
    blobs = MemoryBlobs(clock)

    class Racing(MemoryStore):
        def _append(self, stream: str, expected: int, records: Any) -> int:
            if collect_at == 1:
                clock.advance(stall)
                collect_blobs(self, grace=grace, now=clock)
            return super()._append(stream, expected, records)

    store = Racing()
    store.use_blobs(blobs)
    payload = json.dumps("w" * BIG).encode()
    if collect_at == 0:
        collect_blobs(store, grace=grace, now=clock)
    store.append("s", 0, [NewRecord("k", payload, 1.0)])
    if collect_at == 2:
        clock.advance(stall)
        collect_blobs(store, grace=grace, now=clock)
    assert json.loads(store.read("s")[0].payload) == "w" * BIG


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_fsspec_blobs_by_url(scheme: str, tmp_path: Path) -> None:
    url = f"memory://blobs-{random.random()}" if scheme == "memory" else f"file://{tmp_path}/b"
    store = MemoryStore()
    store.use_blobs(FsspecBlobs(url), threshold=1024)
    store.append("s", 0, [NewRecord("k", b"q" * 5000, 1.0)])
    assert store.read("s")[0].payload == b"q" * 5000
    assert store.blobs is not None
    (key, _at), *rest = list(store.blobs.entries())
    assert rest == []
    assert collect_blobs(store, grace=0).deleted == ()
    store.blobs.delete(key)
    with pytest.raises(BlobNotFoundError):
        store.read("s")


def test_sqlite_blob_options(tmp_path: Path) -> None:
    kept = open_any(f"sqlite:///{tmp_path}/a.db?blobs=none")
    assert kept.blobs is None
    small = open_any(f"sqlite:///{tmp_path}/b.db?blob_threshold=10")
    small.append("s", 0, [NewRecord("k", b"x" * 11, 1.0)])
    assert (tmp_path / "b.db.blobs").is_dir()
    assert small.read("s")[0].payload == b"x" * 11
    for bad in ("blob_threshold=0", "blob_threshold=x", "blobs="):
        with pytest.raises(InvalidArgumentError):
            open_any(f"sqlite:///{tmp_path}/c.db?{bad}")
    for store in (kept, small):
        store.close()


def test_loom_gc_blobs_on_the_command_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path}/loom.db"
    with open_any(url) as store:
        Engine(store, FLOWS, listeners=[]).start("blob.random", BIG, key="r")
        assert store.blobs is not None
        store.blobs.put(*_orphan("stray"))

    def loom(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "loom_kernel", "gc", "--store", url, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    young = loom("--blobs")
    assert young.returncode == 0, young.stderr
    assert "deleted 0 blobs" in young.stdout
    done = loom("--blobs", "--grace", "0s", "--keep-last", "0", "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["blobs_deleted"]) == 3, "the stray one and the run's two"
