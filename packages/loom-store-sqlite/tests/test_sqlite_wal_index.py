"""The WAL-index header, read through a map of the `-shm` file: a stamp that shows
whether anybody committed, and a map that takes none of SQLite's locks away."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from loom_kernel.spi import NewRecord
from loom_store_sqlite import _walindex, open_sqlite_store
from loom_store_sqlite._walindex import WalIndex, mapped_files
from loom_store_sqlite.testing import wal_index

#: Tries, from another process, the write lock on the byte SQLite's connections hold
#: shared while they use the `-shm` file (its "DMS" lock, byte 128). Got, a new
#: connection would take the file for unused and truncate it under their map.
_PROBE = """
import fcntl, os, struct, sys
descriptor = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.fcntl(descriptor, fcntl.F_SETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 128, 1, 0))
except OSError:
    print("held")
else:
    print("free")
"""


def _record() -> list[NewRecord]:
    return [NewRecord("k", b"{}", 1.0)]


def _lock_on_shm(database: Path) -> str:
    return _lock_on(f"{database}-shm")


def _lock_on(file: str) -> str:
    probe = [sys.executable, "-c", _PROBE, file]
    return subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()


def test_mapping_the_header_leaves_sqlites_locks_on_the_file(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    store = open_sqlite_store(f"sqlite://{path}")
    assert wal_index(store) is not None
    store.append("ex/a", 0, _record())
    assert _lock_on_shm(path) == "held"
    other = open_sqlite_store(f"sqlite://{path}")  # the same file mapped again, then let go
    other.append("ex/b", 0, _record())
    other.close()
    assert _lock_on_shm(path) == "held", "closing a store let go of the other's locks"
    assert store.head("ex/b") == 1
    store.close()


def test_a_file_is_mapped_once_per_process(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    before = _mapped_files()
    one = open_sqlite_store(f"sqlite://{path}")
    mapped = mapped_files()
    two = open_sqlite_store(f"sqlite://{path}")
    assert wal_index(one) is not None
    assert wal_index(two) is not None
    assert len(set(mapped) - before) == 1, "mapped as the first store opened it"
    assert mapped_files() == mapped, "not again: the second store's view reads the same map"
    one.close()
    two.close()


def test_a_closed_view_reads_nothing_and_closes_twice(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/c.db")
    index = wal_index(store)
    assert index is not None
    assert index.stamp() is not None
    store.close()
    store.close()
    assert index.stamp() is None


def test_the_header_read_mid_write_is_no_stamp(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path}/w.db")
    store.append("ex/a", 0, _record())
    index = wal_index(store)
    assert index is not None
    stamp = index.stamp()
    assert stamp is not None
    copies = bytearray(stamp * 2)
    copies[8] ^= 1  # the first copy rewritten, the second not yet
    view = mmap.mmap(-1, len(copies))
    view.write(bytes(copies))
    assert WalIndex(view).stamp() is None
    view.seek(0)
    view.write(stamp * 2)
    assert WalIndex(view).stamp() == stamp
    store.close()


def test_no_view_where_there_is_no_file_to_map(tmp_path: Path) -> None:
    assert WalIndex.open(str(tmp_path / "missing.db")) is None
    assert wal_index(open_sqlite_store("sqlite:///:memory:")) is None
    (tmp_path / "short.db-shm").write_bytes(b"\0" * 10)
    assert WalIndex.open(str(tmp_path / "short.db")) is None, "shorter than a header"
    (tmp_path / "zero.db-shm").write_bytes(b"\0" * 4096)
    assert WalIndex.open(str(tmp_path / "zero.db")) is None, "not a WAL index"


def _mapped_files() -> set[tuple[int, int]]:
    return set(mapped_files())


def test_a_closed_database_leaves_no_descriptor_open(tmp_path: Path) -> None:
    before = _mapped_files()
    store = open_sqlite_store(f"sqlite://{tmp_path}/u.db")
    store.append("ex/a", 0, _record())
    assert _mapped_files() - before, "mapped while it is open"
    store.close()  # the last connection: SQLite unlinks the -shm file
    assert not (tmp_path / "u.db-shm").exists()
    assert not _mapped_files() - before, "let go of as the store closed"


def test_a_database_another_store_holds_open_stays_mapped(tmp_path: Path) -> None:
    one = open_sqlite_store(f"sqlite://{tmp_path}/h.db")
    two = open_sqlite_store(f"sqlite://{tmp_path}/h.db")
    mapped = _mapped_files()
    two.close()
    assert _mapped_files() == mapped, "still linked: SQLite's locks on it must stay"
    index = wal_index(one)
    assert index is not None
    assert index.stamp() is not None
    one.close()


@pytest.mark.parametrize("end", ["store.close()", "del store; gc.collect()"])
def test_many_databases_opened_and_ended_under_a_low_descriptor_limit(
    tmp_path: Path, end: str
) -> None:
    script = f"""
import gc, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from loom_kernel.spi import NewRecord
from loom_store_sqlite import open_sqlite_store
for number in range(300):
    store = open_sqlite_store("sqlite://{tmp_path}/many-" + str(number) + ".db")
    store.append("ex/a", 0, [NewRecord("k", b"{{}}", 1.0)])
    {end}
print("done")
"""
    run = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True
    )
    assert run.stdout.strip() == "done", run.stderr[-2000:]


def test_past_the_most_files_a_store_reads_its_heads_from_sqlite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_walindex, "MOST_FILES", 0)
    keep = open_sqlite_store(f"sqlite://{tmp_path}/k.db")
    assert wal_index(keep) is None
    keep.append("ex/a", 0, _record())
    assert keep.head("ex/a") == 1
    keep.close()


def _registered(database: Path) -> tuple[tuple[int, int], int]:
    """The registry's key and descriptor for a database's `-shm` file."""
    status = os.stat(f"{database}-shm")
    key = (status.st_dev, status.st_ino)
    return key, mapped_files()[key]


_linux_descriptors = pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd (Linux)"
)


@_linux_descriptors
def test_a_shm_file_deleted_while_in_use_keeps_sqlites_locks(tmp_path: Path) -> None:
    """Deleted by someone else while a connection still uses it: unlinked, yet SQLite's
    descriptors still refer to it, so letting go of the map would drop their locks
    (another attached process could then write at once)."""
    path = tmp_path / "d.db"
    store = open_sqlite_store(f"sqlite://{path}")
    store.append("ex/a", 0, _record())
    key, descriptor = _registered(path)
    os.unlink(f"{path}-shm")
    open_sqlite_store(f"sqlite://{tmp_path}/other.db").close()  # lets go of the unlinked
    assert key in mapped_files(), "SQLite still uses the file: the map is kept"
    assert _lock_on(f"/proc/{os.getpid()}/fd/{descriptor}") == "held"
    store.append("ex/a", 1, _record())
    store.close()  # SQLite's last descriptor of it closes: now nothing refers to it
    assert key not in mapped_files()


def test_a_descriptor_closed_behind_the_registry_is_never_closed_again(tmp_path: Path) -> None:
    """A close-all-descriptors elsewhere, and the number reused by an unlinked file: it is
    not the registry's to close."""
    path = tmp_path / "f.db"
    store = open_sqlite_store(f"sqlite://{path}")
    store.append("ex/a", 0, _record())
    key, descriptor = _registered(path)
    with tempfile.TemporaryFile() as stranger:  # unlinked from the start
        os.dup2(stranger.fileno(), descriptor)  # the registry's number is the stranger's now
        _walindex.let_go_of_unlinked()
        assert key not in mapped_files(), "forgotten"
        os.fstat(descriptor)  # still open: not closed by the registry
        os.close(descriptor)
    assert store.head("ex/a") == 1
    store.close()


def test_a_child_forked_while_the_registry_is_in_use_can_use_it(tmp_path: Path) -> None:
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _walindex.files_lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    threading.Timer(0.2, release.set).start()  # the fork waits for the lock until then
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's own run
        _walindex.let_go_of_unlinked()
        os._exit(0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        pytest.fail("the child inherited the registry's lock held and waited for it")
    holder.join()
    assert os.waitstatus_to_exitcode(status) == 0
