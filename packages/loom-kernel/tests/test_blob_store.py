"""The blob store's public face (`BlobStore`, here `MemoryBlobs` and `FsspecBlobs` on a
folder): every key is checked before it becomes a path or an object key, and a store
with nothing half written has no leftovers to count."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from loom_kernel.spi import BlobStore, FsspecBlobs, InvalidIdError, MemoryBlobs

BAD_KEYS: tuple[Any, ...] = ("../escape", "sha256:../../x", "sha256:" + "A" * 64, "", None, 7)


def _memory(_folder: Path) -> BlobStore:
    return MemoryBlobs()


def _folder(folder: Path) -> BlobStore:
    return FsspecBlobs(f"file://{folder}")


@pytest.fixture(params=[_memory, _folder], ids=["memory", "fsspec"])
def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    make: Callable[[Path], BlobStore] = request.param
    return make(tmp_path / "blobs")


@pytest.mark.parametrize("key", BAD_KEYS)
def test_every_call_checks_its_key_first(blobs: BlobStore, key: Any) -> None:
    calls: list[Callable[[], object]] = [
        lambda: blobs.put(key, b"x"),
        lambda: blobs.get(key),
        lambda: blobs.exists(key),
        lambda: blobs.delete(key),
        lambda: blobs.discard(key),
        lambda: blobs.restore(key),
        lambda: blobs.purge(key),
    ]
    for call in calls:
        with pytest.raises(InvalidIdError):
            call()


def test_a_blob_reads_back_and_nothing_is_left_half_written(blobs: BlobStore) -> None:
    key = "sha256:" + hashlib.sha256(b"payload").hexdigest()
    assert not blobs.exists(key)
    blobs.put(key, b"payload")
    assert blobs.exists(key)
    assert blobs.get(key) == b"payload"
    assert blobs.remove_leftovers(float("inf")) == 0
    blobs.discard(key)
    assert not blobs.exists(key), "in the trash, not live"
    assert blobs.restore(key)
    assert blobs.exists(key)


def test_a_discarded_blob_is_in_the_trash_since_the_moment_it_was_discarded(
    blobs: BlobStore,
) -> None:
    """The collector purges the trash a grace after each discard: a discard's time read
    back wrong (late or early by a fraction) would purge too soon, or never."""
    key = "sha256:" + hashlib.sha256(b"old").hexdigest()
    blobs.put(key, b"old")
    before = time.time()
    blobs.discard(key)
    after = time.time()
    ((trashed, at),) = list(blobs.trashed())
    assert trashed == key
    assert before - 0.002 <= at <= after + 0.002
