"""Whether anything committed to a WAL database since a moment, without a call into
SQLite.

Every commit to a database in WAL mode rewrites the WAL-index header at the start of
its `-shm` file (https://www.sqlite.org/walformat.html, "The WAL-Index Header"): 48
bytes, written twice (the second copy first), whose `iChange` counts transactions.
Reading those bytes through a read-only memory map costs no system call and never
lets go of the GIL, where any statement does (under many threads, each such call
waits behind the other threads' Python: measured, a second statement per step halved
the steps of 16 threads). The header's bytes are a stamp: while they stay the same,
nobody has committed. (They never come back once changed: a commit adds frames, whose
checksums the header carries, and a new WAL gets new random salts.) The header says
nothing about who committed: see `StampedHeads` for how a store tells its own
commits apart.

SQLite holds POSIX locks on the `-shm` file, and POSIX drops every lock a process
holds on a file when the process closes any descriptor of that file: SQLite's own
connections would lose theirs, and another process opening the database would then
take the file for unused and truncate it under their map (a bus error). So a
descriptor opened here, and the map (`mmap` keeps a duplicate of it), is never closed
while the file can be in use: each file is mapped once per process and kept, and let
go only once the file is unlinked (SQLite unlinks it as the last connection anywhere
closes) and no other descriptor of this process refers to it (a file deleted by
someone else while SQLite still uses it keeps SQLite's descriptors, and locks, open:
closing ours then would drop them). Where the process's descriptors cannot be listed
(no `/proc/self/fd`), nothing is let go.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from typing import Final

__all__ = ["MOST_FILES", "WalIndex", "files_lock", "let_go_of_unlinked", "mapped_files"]

_HEADER: Final = 48
#: iVersion, the header's first field.
_VERSION_FIELD: Final = struct.Struct("=I")
_VERSION: Final = 3007000  # the only WAL-index version SQLite has written
#: The most `-shm` files one process keeps mapped; past it, a store opened on yet
#: another file reads its heads from SQLite.
MOST_FILES: Final = 256

#: (device, inode) -> the descriptor and the map of one `-shm` file (None: shorter
#: than the header when opened), never closed while the file is linked.
_files: dict[tuple[int, int], tuple[int, mmap.mmap | None]] = {}
#: Maps whose descriptor something else closed (its number may be another file's now):
#: kept open, never used, since the file they map may still be in use.
_abandoned: list[mmap.mmap] = []
#: Held while the registry (`_files`, `_abandoned`) is read or changed.
files_lock: Final = threading.Lock()
# A child forked while another thread held it would wait for it for ever.
os.register_at_fork(
    before=files_lock.acquire,
    after_in_parent=files_lock.release,
    after_in_child=files_lock.release,
)
_DESCRIPTORS: Final = "/proc/self/fd"


def _map_of(path: str) -> mmap.mmap | None:
    """The process's map of the file at `path`, made once; None if it cannot be."""
    try:
        status = os.stat(path)  # by name: a descriptor opened only to look is one to close
    except OSError:
        return None
    with files_lock:
        known = _files.get((status.st_dev, status.st_ino))
        if known is not None:
            return known[1]
        _let_go_of_unlinked()
        if len(_files) >= MOST_FILES:
            return None
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        # From here on the descriptor is kept: closing it would drop SQLite's locks.
        opened = os.fstat(descriptor)  # the name may have moved to another file since
        view: mmap.mmap | None
        try:
            view = mmap.mmap(descriptor, 2 * _HEADER, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # shorter than the header, or no mmap here
            view = None
        _files[(opened.st_dev, opened.st_ino)] = (descriptor, view)
        return view if (opened.st_dev, opened.st_ino) == (status.st_dev, status.st_ino) else None


def mapped_files() -> dict[tuple[int, int], int]:
    """The `-shm` files this process keeps mapped, by (device, inode), each with the
    descriptor kept open for it (for tests and tools)."""
    with files_lock:
        return {key: descriptor for key, (descriptor, _view) in _files.items()}


def let_go_of_unlinked() -> None:
    """Close the maps of files SQLite has unlinked (as the last connection to a database
    anywhere closes) that no other descriptor of this process refers to: no
    connection of this process uses them, so no lock is lost. A store calls it as it
    closes, so the descriptors of a closed database do not pile up."""
    with files_lock:
        _let_go_of_unlinked()


def _let_go_of_unlinked() -> None:
    """`let_go_of_unlinked`, with the lock held."""
    unlinked: dict[tuple[int, int], tuple[int, mmap.mmap | None]] = {}
    for key, (descriptor, view) in list(_files.items()):
        try:
            status = os.fstat(descriptor)
        except OSError:
            status = None
        if status is None or (status.st_dev, status.st_ino) != key:
            # Closed by someone else, its number maybe another file's now: not ours
            # to close; the map's own duplicate still holds the file, which may be in use.
            del _files[key]
            if view is not None:
                _abandoned.append(view)
        elif status.st_nlink == 0:
            unlinked[key] = (descriptor, view)
    if not unlinked:
        return
    held = _descriptors_of(set(unlinked))
    for key, (descriptor, view) in unlinked.items():
        # Ours: the descriptor, and the duplicate a map keeps.
        if held is None or held.get(key, 0) != 1 + (view is not None):
            continue  # another descriptor of this process refers to it: SQLite's, say
        del _files[key]
        if view is not None:
            view.close()
        os.close(descriptor)


def _descriptors_of(files: set[tuple[int, int]]) -> dict[tuple[int, int], int] | None:
    """How many of this process's descriptors refer to each of `files`, by (device,
    inode); None where they cannot be listed."""
    try:
        names = os.listdir(_DESCRIPTORS)
    except OSError:
        return None
    counts: dict[tuple[int, int], int] = dict.fromkeys(files, 0)
    for name in names:
        try:
            status = os.stat(f"{_DESCRIPTORS}/{name}")
        except OSError:  # closed meanwhile, or the listing's own descriptor
            continue
        key = (status.st_dev, status.st_ino)
        if key in counts:
            counts[key] += 1
    return counts


class WalIndex:
    """A read-only view of one database's WAL-index header, for one store.

    Read only while the store is open: its connections keep SQLite's shared lock on
    the file, so no other process truncates it under the map. (A read that began just
    as the store closed would need, before its next bytecode, every connection of
    this process to the file closed, and another process's connection to have died
    holding it, and a third to open it. It takes no lock: an interrupt could leave
    one held.)
    """

    __slots__ = ("_map",)

    def __init__(self, view: mmap.mmap) -> None:
        self._map: mmap.mmap | None = view

    @classmethod
    def open(cls, database: str) -> WalIndex | None:
        """The view of `database`'s `-shm` file, or None where there is none to read
        (not in WAL mode, a file SQLite has not made yet, a system that will not map
        it, too many files mapped already)."""
        view = _map_of(os.path.realpath(database) + "-shm")
        if view is None:
            return None
        index = cls(view)
        stamp = index.stamp()
        if stamp is None or _VERSION_FIELD.unpack_from(stamp)[0] != _VERSION:
            index.close()
            return None
        return index

    def stamp(self) -> bytes | None:
        """The header now, or None while a commit is rewriting it (its two copies
        differ), or once closed."""
        view = self._map
        if view is None:
            return None
        try:
            first = view[:_HEADER]
            second = view[_HEADER : 2 * _HEADER]
        except ValueError:  # let go of: the file was unlinked under the store
            return None
        return first if first == second else None

    def close(self) -> None:
        """Read no more (called before the store closes its connections); the map
        itself is the process's, kept while the file is linked."""
        self._map = None
