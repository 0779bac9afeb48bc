"""Collecting blobs: the seed's gc walk (`reachable`) from every record of a store
that names a blob; see `_blobs` for why a writer racing the collector never loses
its blob."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import attrs

from loom_kernel._core import InvalidArgumentError, NotFoundError, TrimmedError, reachable
from loom_kernel._spi._blobs import blob_of
from loom_kernel._spi._journal import JournalStore

__all__ = ["BlobsCollected", "collect_blobs"]


@attrs.frozen
class BlobsCollected:
    """What `collect_blobs` did (or, with `dry_run`, would do).

    Attributes:
        deleted: the blobs deleted.
        referenced: how many blobs records refer to.
        young: unreferenced blobs kept because they are within the grace period.
        dry_run: whether it only said what it would delete.
    """

    deleted: tuple[str, ...]
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
    """Delete the blobs no record of `store` refers to that are older than `grace`.

    The blobs are listed first, then every stream of the store is read for the blobs
    its records name (the gc walk from them); a blob is deleted only when no record
    names it and it was last written more than `grace` seconds before the listing
    and, looked at again just before its deletion, still is.

    Raises:
        InvalidArgumentError: the store has no blob store, or `grace` is negative.
    """
    blobs = store.blobs
    if blobs is None:
        raise InvalidArgumentError("the store has no blob store: there are no blobs to collect")
    if not isinstance(grace, int | float) or not grace >= 0:
        raise InvalidArgumentError(f"grace is a number of seconds >= 0, not {grace!r}")
    cutoff = now() - grace
    listed = list(blobs.entries())
    named = reachable(_named_blobs(store), lambda _key: ())
    deleted: list[str] = []
    young = 0
    for key, written in listed:
        if key in named:
            continue
        if written >= cutoff:
            young += 1
            continue
        again = blobs.modified(key)
        if again is None or again >= cutoff:
            continue  # gone already, or written again meanwhile: a writer refers to it
        if not dry_run:
            blobs.delete(key)
        deleted.append(key)
    return BlobsCollected(tuple(deleted), len(named), young, dry_run)


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
            key = blob_of(record.payload)
            if key is not None:
                yield key
        if len(records) < 1000:
            return
        position = records[-1].position
