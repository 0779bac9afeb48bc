"""A store's blobs in its own bucket: `<prefix>!blobs/sha256/<hex>`, beside its
journals ('!' keeps them out of every stream's keys, see `_layout`), and their trash
`<prefix>!blobs/trash/<hex>.<milliseconds when moved there>`."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Final

from loom_kernel.spi import BlobNotFoundError, BlobStore

from loom_store_s3._transport import Transport

__all__ = ["BucketBlobs"]

_HEX: Final = re.compile(r"[0-9a-f]{64}")
_TRASHED: Final = re.compile(r"([0-9a-f]{64})\.([0-9]{1,16})")


class BucketBlobs(BlobStore):
    """Blobs under `root` in the bucket a transport talks to (S3 keeps each write
    whole: no reader meets half an object)."""

    def __init__(self, transport: Transport, root: str) -> None:
        self._transport = transport
        self._root = root

    def _key(self, key: str) -> str:
        return self._root + key.replace(":", "/", 1)

    def _listed(self, base: str) -> Iterator[tuple[str, float]]:
        for page in self._transport.pages(base):
            for item in page.get("Contents") or []:
                yield str(item["Key"])[len(base) :], float(item["LastModified"].timestamp())

    def entries(self) -> Iterator[tuple[str, float]]:
        for name, written in self._listed(self._root + "sha256/"):
            if _HEX.fullmatch(name):
                yield f"sha256:{name}", written

    def trashed(self) -> Iterator[tuple[str, float]]:
        for name, _written in self._listed(self._root + "trash/"):
            matched = _TRASHED.fullmatch(name)
            if matched:
                yield f"sha256:{matched[1]}", int(matched[2]) / 1000

    def _put(self, key: str, data: bytes) -> None:
        self._transport.put(self._key(key), data)

    def _get(self, key: str) -> bytes:
        data = self._transport.get(self._key(key))
        if data is None:
            raise BlobNotFoundError(f"no blob {key} in s3://{self._transport.bucket}/{self._root}")
        return data

    def _delete(self, key: str) -> None:
        self._transport.delete([self._key(key)])

    def _modified(self, key: str) -> float | None:
        return self._transport.modified(self._key(key))

    def _discard(self, key: str) -> None:
        data = self._transport.get(self._key(key))
        if data is None:
            return
        digest = key.removeprefix("sha256:")
        self._transport.put(f"{self._root}trash/{digest}.{time.time_ns() // 10**6}", data)
        self._transport.delete([self._key(key)])

    def _in_trash(self, key: str) -> list[str]:
        """The keys of the blob's copies in the trash, oldest first."""
        copies = self._root + "trash/" + key.removeprefix("sha256:") + "."
        return sorted(copies + stamp for stamp, _at in self._listed(copies))

    def _restore(self, key: str) -> bool:
        copies = self._in_trash(key)
        for copy in reversed(copies):
            data = self._transport.get(copy)
            if data is not None:
                self._transport.put(self._key(key), data)
                self._transport.delete(copies)
                return True
        return False

    def _purge(self, key: str) -> None:
        self._transport.delete(self._in_trash(key))
