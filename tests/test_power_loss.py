"""A power loss on SQLite at synchronous=full, simulated: a real process runs
workflows with tests/durable_copy.c loaded, which keeps each database file as it was
at its last sync; the test opens those copies, what a power loss could leave at worst.

The claim under test (docs/spi.md, docs/stores/sqlite.md): an unsynced append (a run
index's hint or close) is lost, if at all, only with what was appended after it and
not synced. So every acknowledged run is there, as it was acknowledged, every journal
is indexed (no run started without its hint), and a close the loss took is written
again by `recover()`."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loom_kernel import Engine, Status, open_store
from loom_kernel._coordination._run_index import partition_of
from power_loss_flow import three

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def durable_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("simulating a power loss needs a C compiler (cc) for durable_copy.c")
    library = tmp_path_factory.mktemp("shim") / "durable_copy.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(HERE / "durable_copy.c")],
        check=True,
    )
    return library


def _workload(
    library: Path, folder: Path, runs: int, *, compact_often: bool = False
) -> subprocess.Popen[str]:
    environment = {
        **os.environ,
        **({"LOOM_COMPACT_OFTEN": "1"} if compact_often else {}),
        "LD_PRELOAD": " ".join(filter(None, [str(library), os.environ.get("LD_PRELOAD")])),
        "LOOM_DURABLE_DIR": str(folder),
    }
    return subprocess.Popen(
        [sys.executable, str(HERE / "power_loss_flow.py"), str(folder / "loom.db"), str(runs)],
        env=environment,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _after_the_loss(folder: Path) -> Path:
    """The database as a power loss could leave it: each file as of its last sync."""
    left = folder / "after"
    left.mkdir()
    for name in ("loom.db", "loom.db-wal"):
        synced = folder / f"{name}.durable"
        if synced.exists():
            shutil.copyfile(synced, left / name)
        elif name == "loom.db":
            (left / name).touch()  # never synced: nothing of it is sure to be there
    return left / "loom.db"


def _acknowledged(lines: list[str]) -> dict[str, Status]:
    return {line.split()[1]: Status(line.split()[0]) for line in lines if line != "finished"}


def _check(database: Path, acknowledged: dict[str, Status]) -> Engine:
    store = open_store(f"sqlite:///{str(database).lstrip('/')}")
    engine = Engine(store, [three], listeners=[])
    for execution_id, status in acknowledged.items():
        assert engine.get(execution_id).status is status, execution_id
    journals = {name.removeprefix("ex/") for name in store.streams("ex/")}
    listed = {run.id for run in engine.runs()}
    assert journals <= listed, f"started with no index entry: {sorted(journals - listed)}"
    return engine


def _closed_in_index(engine: Engine, execution_id: str) -> bool:
    store = engine.store
    partition = store.read(f"runs/open/{partition_of(execution_id)}")
    return any(
        record.kind == "loom.run.closed" and execution_id.encode() in record.payload
        for record in partition
    )


def test_a_power_loss_after_the_last_run_keeps_every_run_and_recover_closes_it(
    durable_copy: Path, tmp_path: Path
) -> None:
    process = _workload(durable_copy, tmp_path, 12)
    assert process.stdout is not None
    lines = [process.stdout.readline().strip() for _ in range(13)]
    assert lines[-1] == "finished"
    process.send_signal(signal.SIGKILL)  # the power goes just after the last run
    process.wait(10)
    acknowledged = _acknowledged(lines)
    last = next(i for i, s in reversed(acknowledged.items()) if s is Status.COMPLETED)
    whole = Engine(open_store(f"sqlite:///{str(tmp_path / 'loom.db').lstrip('/')}"), [three])
    assert _closed_in_index(whole, last), "the live database has the last run's close"
    whole.store.close()
    engine = _check(_after_the_loss(tmp_path), acknowledged)
    try:
        # The last close was unsynced and nothing synced came after it: the copy as of
        # the last sync has the run ended but not closed (so the copy is what a power
        # loss leaves, not the live file), and recover() closes it.
        assert engine.get(last).status is Status.COMPLETED
        assert not _closed_in_index(engine, last), "the copy kept an unsynced close"
        engine.recover()
        assert _closed_in_index(engine, last)
    finally:
        engine.store.close()


@pytest.mark.parametrize(
    ("seed", "compact_often"), [(seed, False) for seed in range(4)] + [(4, True), (5, True)]
)
def test_a_power_loss_at_any_moment_leaves_no_run_unindexed_or_lost(
    durable_copy: Path, tmp_path: Path, seed: int, compact_often: bool
) -> None:
    """With `compact_often`, the loss may also land in a compaction of the run index,
    whose batches of ended runs are unsynced until its checkpoint: no ended run may be
    trimmed out of its partition and not filed under its status."""
    process = _workload(durable_copy, tmp_path, 400, compact_often=compact_often)
    assert process.stdout is not None
    lines: list[str] = []
    want = random.Random(seed).randint(3, 40)
    deadline = time.monotonic() + 60
    while len(lines) < want:
        assert time.monotonic() < deadline, f"the workload acknowledged {len(lines)} runs"
        lines.append(process.stdout.readline().strip())
    time.sleep(random.Random(seed).random() * 0.02)
    process.send_signal(signal.SIGKILL)  # the power goes: no sync after this one
    process.wait(10)
    rest = process.stdout.read().splitlines()  # printed before the kill landed
    engine = _check(_after_the_loss(tmp_path), _acknowledged(lines + rest))
    try:
        if compact_often:
            assert engine.store.streams("runs/completed/"), "no compaction before the loss"
        engine.recover()
        for run in engine.runs():
            assert run.status in (Status.COMPLETED, Status.SUSPENDED), run
    finally:
        engine.store.close()
