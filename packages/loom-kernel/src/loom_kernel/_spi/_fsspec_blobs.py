"""Blobs in any filesystem fsspec opens by URL or path: a local folder, `file://`,
`memory://`, `s3://` (with s3fs installed), ... (the `blobs` extra installs fsspec).

A blob `sha256:<hex>` is the file `<root>/sha256/<first two hex digits>/<hex>`: a
name that is safe on every filesystem, and directories of a few hundred files at
most however many blobs there are. A blob is written to a temporary name and
renamed where the filesystem can (a local disk), so a reader never meets half of one.
The trash is `<root>/trash/<hex>.<milliseconds when moved there>`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any, Final

from loom_kernel._core import InvalidArgumentError, StoreMisconfiguredError
from loom_kernel._spi._blobs import BlobNotFoundError, BlobStore

__all__ = ["FsspecBlobs"]

_HEX: Final = re.compile(r"[0-9a-f]{64}")
_TRASHED: Final = re.compile(r"([0-9a-f]{64})\.([0-9]{1,16})")
_TEMPORARY: Final = re.compile(r"[0-9a-f]{64}\.tmp[0-9a-f]{32}")


class FsspecBlobs(BlobStore):
    """Blobs under a root that fsspec opens (a URL, or a local path).

    Args:
        url: where the blobs live (`/var/lib/app/blobs`, `file:///...`, `memory://x`).
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
        protocol = self._fs.protocol
        self._local = "file" in ({protocol} if isinstance(protocol, str) else set(protocol))

    def _path(self, key: str) -> str:
        digest = key.removeprefix("sha256:")
        return f"{self._root}/sha256/{digest[:2]}/{digest}"

    def _files(self, base: str) -> dict[str, Any]:
        try:
            found: dict[str, Any] = self._fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return found

    def entries(self) -> Iterator[tuple[str, float]]:
        for path, info in sorted(self._files(f"{self._root}/sha256").items()):
            name = path.rsplit("/", 1)[-1]
            if _HEX.fullmatch(name):
                yield f"sha256:{name}", _written(info)

    def trashed(self) -> Iterator[tuple[str, float]]:
        for path in sorted(self._files(f"{self._root}/trash")):
            matched = _TRASHED.fullmatch(path.rsplit("/", 1)[-1])
            if matched:
                yield f"sha256:{matched[1]}", int(matched[2]) / 1000

    def remove_leftovers(self, before: float) -> int:
        removed = 0
        for path, info in self._files(f"{self._root}/sha256").items():
            if _TEMPORARY.fullmatch(path.rsplit("/", 1)[-1]) and _written(info) < before:
                with contextlib.suppress(FileNotFoundError):
                    self._fs.rm_file(path)
                    removed += 1
        return removed

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

    def _discard(self, key: str) -> None:
        digest = key.removeprefix("sha256:")
        self._fs.makedirs(f"{self._root}/trash", exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self._fs.mv(self._path(key), f"{self._root}/trash/{digest}.{time.time_ns() // 10**6}")

    def _in_trash(self, key: str) -> list[str]:
        digest = key.removeprefix("sha256:")
        return sorted(
            path
            for path in self._files(f"{self._root}/trash")
            if path.rsplit("/", 1)[-1].startswith(digest + ".")
        )

    def _restore(self, key: str) -> bool:
        copies = self._in_trash(key)
        if not copies:
            return False
        path = self._path(key)
        self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        try:
            self._fs.mv(copies[-1], path)
        except FileNotFoundError:
            return self._modified(key) is not None  # brought back by another reader
        for other in copies[:-1]:
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(other)
        return True

    def _purge(self, key: str) -> None:
        for path in self._in_trash(key):
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(path)


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
