"""A store's blobs in its own bucket: `<prefix>!blobs/sha256/<hex>`, beside its
journals ('!' keeps them out of every stream's keys, see `_layout`)."""

from __future__ import annotations

from collections.abc import Iterator

from loom_kernel.spi import BlobNotFoundError, BlobStore

from loom_store_s3._transport import Transport

__all__ = ["BucketBlobs"]


class BucketBlobs(BlobStore):
    """Blobs under `root` in the bucket a transport talks to (S3 keeps each write
    whole: no reader meets half an object)."""

    def __init__(self, transport: Transport, root: str) -> None:
        self._transport = transport
        self._root = root

    def _key(self, key: str) -> str:
        return self._root + key.replace(":", "/", 1)

    def entries(self) -> Iterator[tuple[str, float]]:
        base = self._root + "sha256/"
        for page in self._transport.pages(base):
            for item in page.get("Contents") or []:
                digest = str(item["Key"])[len(base) :]
                if len(digest) == 64:
                    yield f"sha256:{digest}", float(item["LastModified"].timestamp())

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
