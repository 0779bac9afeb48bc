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
    assert collect_blobs(blobbed, grace=0).discarded == (), "every blob is named by a record"


def test_equal_payloads_share_one_blob_and_every_payload_reads_back_as_written() -> None:
    store = _memory()
    text = "z" * BIG
    one = json.dumps({"a": 1, "b": text}).encode()
    two = json.dumps({"b": text, "a": 1}).encode()
    store.append("s", 0, [NewRecord("k", one, 1.0), NewRecord("k", one, 1.0)])
    store.append("s", 2, [NewRecord("k", two, 1.0)])
    assert store.blobs is not None
    assert len(list(store.blobs.entries())) == 2, "one per distinct payload"
    assert [r.payload for r in store.read("s")] == [one, one, two], "the bytes as written"


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
    assert dry.discarded == (_orphan("old")[0],)
    assert (dry.referenced, dry.young) == (2, 1), "the step's record and the run's end"
    assert len(list(store.blobs.entries())) == 4, "a dry run deletes nothing"
    first = collect_blobs(store, grace=50, now=clock)
    assert (first.discarded, first.deleted) == ((_orphan("old")[0],), ())
    assert [key for key, _ in store.blobs.trashed()] == [_orphan("old")[0]]
    clock.advance(10)
    assert collect_blobs(store, grace=50, now=clock).deleted == (), "in the trash a grace"
    clock.advance(50)
    assert collect_blobs(store, grace=50, now=clock).deleted == (_orphan("old")[0],)
    assert _orphan("old")[0] not in dict(store.blobs.trashed())
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
    assert len(collect_blobs(store, grace=10, now=clock).discarded) == 2
    clock.advance(100)
    assert len(collect_blobs(store, grace=10, now=clock).deleted) == 2
    assert list(store.blobs.entries()) == []
    assert list(store.blobs.trashed()) == []


def _all_named_blobs_live(store: JournalStore) -> None:
    assert store.blobs is not None
    named = {
        r.payload[len(b"\x00loom.blob\x00") :].decode()
        for s in store.streams()
        for r in store.raw_read(s)
        if r.payload.startswith(b"\x00loom.blob\x00")
    }
    assert named == {key for key, _ in store.blobs.entries()}
    assert list(store.blobs.trashed()) == []


def test_a_kill_between_a_blob_and_its_record_leaves_no_dangling_reference() -> None:
    """The step's blob is written, then the process dies before its record lands; a
    collection, a resume (the step runs again: another value, another blob), and two
    more collections: the orphan is gone and every record's blob is there."""
    clock = FakeClock(1_000.0)

    class DiesAtTheStep(MemoryStore):
        armed = True

        def _append(self, stream: str, expected: int, records: Any) -> int:
            if self.armed and expected == 1:  # the step's record, after the start's
                self.armed = False
                raise Crash
            return super()._append(stream, expected, records)

    store = DiesAtTheStep()
    store.use_blobs(MemoryBlobs(clock))
    with pytest.raises(Crash):
        Engine(store, FLOWS, listeners=[], clock=clock).start("blob.random", BIG, key="k")
    assert store.blobs is not None
    assert len(list(store.blobs.entries())) == 1, "the orphan: written, never named"
    clock.advance(100)
    collect_blobs(store, grace=10, now=clock)
    engine = Engine(store, FLOWS, listeners=[], clock=clock)
    engine.recover()
    assert len(engine.get("k").result) == BIG
    for _ in range(2):
        clock.advance(100)
        collect_blobs(store, grace=10, now=clock)
    _all_named_blobs_live(store)


@pytest.mark.parametrize("after", [False, True], ids=["before-it-lands", "after-it-lands"])
def test_a_kill_at_every_store_call_of_a_run_with_blobs_loses_none(after: bool) -> None:
    clock = FakeClock(1_000.0)
    counting = DyingStore(_memory(clock), 10**9, after=False, as_it_dies=lambda: None)
    Engine(counting, FLOWS, listeners=[], clock=clock).start("blob.random", BIG, key="k")
    for at in range(1, counting.calls + 1):
        inner = _memory(clock)  # the blobs are the inner store's: the wrapper only dies
        dying = DyingStore(inner, at, after=after, as_it_dies=lambda: None)
        with pytest.raises(Crash):
            Engine(dying, FLOWS, listeners=[], clock=clock).start("blob.random", BIG, key="k")
        clock.advance(100)
        collect_blobs(inner, grace=10, now=clock)
        engine = Engine(inner, FLOWS, listeners=[], clock=clock)
        engine.recover()
        assert len(engine.start("blob.random", BIG, key="k").result) == BIG, at
        for _ in range(2):
            clock.advance(100)
            collect_blobs(inner, grace=10, now=clock)
        _all_named_blobs_live(inner)


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


def test_a_writer_stalled_past_the_trash_puts_its_deleted_blob_again() -> None:
    """Two collections between the blob and its record: the first moved the blob to the
    trash, the second, a grace later, deleted it; the writer writes it again."""
    clock = FakeClock(1_000.0)
    blobs = MemoryBlobs(clock)

    class Stalled(MemoryStore):
        def _append(self, stream: str, expected: int, records: Any) -> int:
            for _ in range(2):
                clock.advance(100)
                collect_blobs(self, grace=10, now=clock)
            assert list(blobs.entries()) == []
            assert list(blobs.trashed()) == []
            return super()._append(stream, expected, records)

    store = Stalled()
    store.use_blobs(blobs)
    store.append("s", 0, [NewRecord("k", json.dumps("w" * BIG).encode(), 1.0)])
    assert json.loads(store.read("s")[0].payload) == "w" * BIG


def test_the_default_threshold_is_64_kib() -> None:
    store = _memory()
    assert store.blobs is not None
    store.append("s", 0, [NewRecord("k", b"x" * (64 * 1024), 1.0)])
    assert list(store.blobs.entries()) == [], "64 KiB stays in the journal"
    store.append("s", 1, [NewRecord("k", b"x" * (64 * 1024 + 1), 1.0)])
    assert len(list(store.blobs.entries())) == 1, "a byte more goes to the blob store"


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
    assert collect_blobs(store, grace=0).discarded == ()
    store.blobs.discard(key)
    assert [k for k, _ in store.blobs.trashed()] == [key]
    assert store.read("s")[0].payload == b"q" * 5000, "a read brings it back from the trash"
    assert list(store.blobs.trashed()) == []
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
    assert "moved 0 blobs" in young.stdout
    done = loom("--blobs", "--grace", "0s", "--keep-last", "0", "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["blobs_discarded"]) == 3, "the stray one and the run's two"
    again = loom("--blobs", "--grace", "0s", "--json")
    assert len(json.loads(again.stdout)["blobs_deleted"]) == 3, "then out of the trash"


def test_json_that_a_canonical_form_would_change_reads_back_as_written(
    blobbed: JournalStore,
) -> None:
    """A float that is whole, a negative zero, a big exponent: read back as written,
    through a replay too (a canonical re-encoding would make 1.0 an int)."""
    pad = "p" * BIG

    @flow(name="blob.floats")
    def floats(ctx: Context, _input: Any) -> Any:
        got = ctx.step("numbers", lambda: {"w": 1.0, "z": -0.0, "e": 1e16, "pad": pad})
        ctx.receive("go")
        return [type(got["w"]).__name__, str(got["z"]), repr(got["e"])]

    Engine(blobbed, [floats], listeners=[]).start("blob.floats", key="f")
    fresh = Engine(blobbed, [floats], listeners=[])  # replays the step from its blob
    fresh.send("f", None, topic="go")
    assert fresh.get("f").result == ["float", "-0.0", "1e+16"]
    odd = b'{ "a" : 1.50, "a": 2, "s": "\\ud83d\\ude00", "pad": "' + pad.encode() + b'"}'
    blobbed.append(
        "odd", 0, [NewRecord("k", odd, 1.0), NewRecord("k", odd.decode().encode("utf-16"), 1.0)]
    )
    assert [r.payload for r in blobbed.read("odd")] == [odd, odd.decode().encode("utf-16")]


def test_a_payload_that_begins_as_a_reference_is_refused_at_any_size() -> None:
    for store in (MemoryStore(), _memory()):
        with pytest.raises(InvalidArgumentError, match="blob reference"):
            store.append("s", 0, [NewRecord("k", b"\x00loom.blob\x00sha256:" + b"0" * 64, 1.0)])
        with pytest.raises(InvalidArgumentError):
            store.append("s", 0, [NewRecord("k", b"\x00loom.blob\x00junk", 1.0)])
        store.append("s", 0, [NewRecord("k", b"\x00other", 1.0)])  # a NUL alone is fine
        assert store.read("s")[0].payload == b"\x00other"


def test_a_damaged_reference_does_not_stop_a_collection() -> None:
    clock = FakeClock(1_000.0)
    store = MemoryStore()
    store.use_blobs(MemoryBlobs(clock))
    store.append("s", 0, [NewRecord("k", b"x" * BIG, 1.0)])
    bad = b"\x00loom.blob\x00sha256:" + b"Z" * 64  # a reference's length, a key that is not
    store._append("damaged", 0, (NewRecord("k", bad, 1.0),))  # as damage writes it
    clock.advance(100)
    collected = collect_blobs(store, grace=10, now=clock)
    assert (collected.referenced, collected.discarded) == (1, ())


def test_sqlite_keeps_its_blobs_in_a_folder_beside_the_database(tmp_path: Path) -> None:
    folder = tmp_path / "a b#c"
    folder.mkdir()
    store = open_any(f"sqlite:///{folder}/loom.db".replace(" ", "%20").replace("#", "%23"))
    store.append("s", 0, [NewRecord("k", b"y" * BIG, 1.0)])
    assert (folder / "loom.db.blobs" / "sha256").is_dir()
    assert store.read("s")[0].payload == b"y" * BIG
    store.close()
