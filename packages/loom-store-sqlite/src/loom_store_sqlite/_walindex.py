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
closes, so no lock on it is left to lose).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from typing import Final

__all__ = ["WalIndex", "let_go_of_unlinked"]

_HEADER: Final = 48
#: iVersion, the header's first field.
_VERSION_FIELD: Final = struct.Struct("=I")
_VERSION: Final = 3007000  # the only WAL-index version SQLite has written
#: The most `-shm` files one process keeps mapped; past it, a store opened on yet
#: another file reads its heads from SQLite.
_MOST_FILES: Final = 256

#: (device, inode) -> the descriptor and the map of one `-shm` file (None: shorter
#: than the header when opened), never closed while the file is linked.
_files: dict[tuple[int, int], tuple[int, mmap.mmap | None]] = {}
_files_lock: Final = threading.Lock()


def _map_of(path: str) -> mmap.mmap | None:
    """The process's map of the file at `path`, made once; None if it cannot be."""
    try:
        status = os.stat(path)  # by name: a descriptor opened only to look is one to close
    except OSError:
        return None
    with _files_lock:
        known = _files.get((status.st_dev, status.st_ino))
        if known is not None:
            return known[1]
        _let_go_of_unlinked()
        if len(_files) >= _MOST_FILES:
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


def let_go_of_unlinked() -> None:
    """Close the maps of files SQLite has unlinked (as the last connection to a database
    anywhere closes): no connection uses them, so no lock is lost. A store calls it as
    it closes, so the descriptors of a closed database do not pile up."""
    with _files_lock:
        _let_go_of_unlinked()


def _let_go_of_unlinked() -> None:
    """`let_go_of_unlinked`, with the lock held."""
    for key, (descriptor, view) in list(_files.items()):
        try:
            linked = os.fstat(descriptor).st_nlink > 0
        except OSError:
            linked = True  # cannot tell: keep it
        if not linked:
            del _files[key]
            if view is not None:
                view.close()
            os.close(descriptor)


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
