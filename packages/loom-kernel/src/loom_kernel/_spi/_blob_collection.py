"""Collecting blobs: the seed's gc walk (`reachable`) from every record of a store
that names a blob, then the trash (see `_blobs` for why a writer racing the collector
never loses its blob)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import attrs

from loom_kernel._core import (
    InvalidArgumentError,
    InvalidIdError,
    NotFoundError,
    TrimmedError,
    reachable,
)
from loom_kernel._spi._blobs import blob_of
from loom_kernel._spi._journal import JournalStore

__all__ = ["BlobsCollected", "collect_blobs"]

logger = logging.getLogger("loom")


@attrs.frozen
class BlobsCollected:
    """What `collect_blobs` did (or, with `dry_run`, would do).

    Attributes:
        discarded: blobs no record names, written longer than the grace ago: moved to
            the trash (a read brings one back).
        deleted: blobs deleted from the trash: no record named them, and they were
            moved there longer than the grace ago.
        restored: blobs brought back from the trash: a record names them again.
        referenced: how many blobs records name.
        young: unnamed blobs kept because they are within the grace.
        dry_run: whether it only said what it would do.
    """

    discarded: tuple[str, ...]
    deleted: tuple[str, ...]
    restored: tuple[str, ...]
    referenced: int
    young: int
    dry_run: bool


def collect_blobs(
    store: JournalStore,
    *,
    grace: float = 3600.0,
    now: Callable[[], float] = time.time,
    dry_run: bool = False,
) -> BlobsCollected:
    """Move the blobs no record of `store` names, written longer than `grace` ago, to the
    trash, and delete those moved there longer than `grace` ago that no record names.

    The live blobs and the trash are listed first, then every stream of the store is
    read for the blobs its records name (the gc walk from them). A blob is moved to the
    trash only when it was still not written again when looked at just before; a blob
    in the trash that a record names is brought back. So a blob is deleted two graces
    at least after its last write, by two collections that found no record naming it.

    Raises:
        InvalidArgumentError: the store has no blob store, or `grace` is negative.
    """
    blobs = store.blobs
    if blobs is None:
        raise InvalidArgumentError("the store has no blob store: there are no blobs to collect")
    if isinstance(grace, bool) or not isinstance(grace, int | float) or not grace >= 0:
        raise InvalidArgumentError(f"grace is a number of seconds >= 0, not {grace!r}")
    cutoff = now() - grace
    live = list(blobs.entries())
    trash = list(blobs.trashed())
    named = reachable(_named_blobs(store), lambda _key: ())
    discarded: list[str] = []
    deleted: list[str] = []
    restored: list[str] = []
    young = 0
    for key, moved in trash:
        if key in named:
            if not dry_run:
                blobs.restore(key)
            restored.append(key)
        elif moved < cutoff:
            if not dry_run:
                blobs.purge(key)
            deleted.append(key)
    for key, written in live:
        if key in named:
            continue
        if written >= cutoff:
            young += 1
            continue
        again = blobs.modified(key)
        if again is None or again >= cutoff:
            continue  # gone already, or written again meanwhile: a writer names it
        if not dry_run:
            blobs.discard(key)
        discarded.append(key)
    if not dry_run:
        blobs.remove_leftovers(cutoff)
    return BlobsCollected(
        tuple(discarded), tuple(deleted), tuple(restored), len(named), young, dry_run
    )


def _named_blobs(store: JournalStore) -> Iterator[str]:
    """Every blob a record of the store names, read without resolving them."""
    after: str | None = None
    while names := store.streams("", after, 500):
        for stream in names:
            yield from _named_in(store, stream)
        after = names[-1]


def _named_in(store: JournalStore, stream: str) -> Iterator[str]:
    position = 0
    while True:
        try:
            records = store.raw_read(stream, position, 1000)
        except TrimmedError as exc:
            position = exc.floor
            continue
        except NotFoundError:
            return  # deleted meanwhile
        for record in records:
            try:
                key = blob_of(record.payload)
            except InvalidIdError as exc:  # a damaged reference names nothing to keep
                logger.warning("loom: %s record %d: %s", stream, record.position, exc)
                continue
            if key is not None:
                yield key
        if len(records) < 1000:
            return
        position = records[-1].position
