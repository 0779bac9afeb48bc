"""Blobs in any filesystem fsspec opens by URL: `file://`, `memory://`, `s3://` (with
s3fs installed), ... (the `blobs` extra installs fsspec).

A blob `sha256:<hex>` is the file `<root>/sha256/<first two hex digits>/<hex>`: a
name that is safe on every filesystem, and directories of a few hundred files at
most however many blobs there are. A blob is written to a temporary name and
renamed where the filesystem can (a local disk), so a reader never meets half of one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import uuid
from collections.abc import Iterator
from typing import Any

from loom_kernel._core import InvalidArgumentError, StoreMisconfiguredError
from loom_kernel._spi._blobs import BlobNotFoundError, BlobStore

__all__ = ["FsspecBlobs"]


class FsspecBlobs(BlobStore):
    """Blobs under a root URL that fsspec opens.

    Args:
        url: where the blobs live (`file:///var/lib/app/blobs`, `memory://blobs`, ...).
        storage_options: passed to fsspec for the filesystem (credentials, say).

    Raises:
        StoreMisconfiguredError: fsspec is not installed, or cannot open the URL.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        try:
            import fsspec  # noqa: PLC0415 - the optional `blobs` extra
        except ImportError:
            raise StoreMisconfiguredError(
                f"blobs at {url!r} need fsspec: pip install 'loom-kernel[blobs]'"
            ) from None
        if not isinstance(url, str) or not url:
            raise InvalidArgumentError(f"a blob store URL is a non-empty str, not {url!r}")
        try:
            self._fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except (ImportError, ValueError) as exc:
            raise StoreMisconfiguredError(f"fsspec cannot open {url!r}: {exc}") from None
        self.url = url
        self._root = root.rstrip("/")
        self._local = "file" in _protocols(self._fs)

    def _path(self, key: str) -> str:
        digest = key.removeprefix("sha256:")
        return f"{self._root}/sha256/{digest[:2]}/{digest}"

    def entries(self) -> Iterator[tuple[str, float]]:
        base = f"{self._root}/sha256"
        try:
            found = self._fs.find(base, detail=True)
        except FileNotFoundError:
            return
        for path, info in sorted(found.items()):
            name = path.rsplit("/", 1)[-1]
            if len(name) == 64 and ".tmp" not in name:
                yield f"sha256:{name}", _written(info)

    def _put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        if not self._local:
            self._fs.pipe_file(path, data)
            return
        temporary = f"{path}.tmp{uuid.uuid4().hex}"
        self._fs.pipe_file(temporary, data)
        self._fs.mv(temporary, path)

    def _get(self, key: str) -> bytes:
        try:
            data: bytes = self._fs.cat_file(self._path(key))
        except FileNotFoundError:
            raise BlobNotFoundError(f"no blob {key} in {self.url}") from None
        return data

    def _delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(self._path(key))

    def _modified(self, key: str) -> float | None:
        try:
            info = self._fs.info(self._path(key))
        except FileNotFoundError:
            return None
        return _written(info)


def _protocols(fs: Any) -> set[str]:
    protocol = fs.protocol
    return {protocol} if isinstance(protocol, str) else set(protocol)


def _written(info: dict[str, Any]) -> float:
    """When a file was last written, from fsspec's info (each filesystem names it its
    own way)."""
    for name in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(name)
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, dt.datetime):
            return value.timestamp()
    raise StoreMisconfiguredError(f"the blob filesystem gives no write time: {sorted(info)}")
