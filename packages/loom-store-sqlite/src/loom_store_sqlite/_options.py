"""What a `sqlite:` store URL says: the database's path, percent-decoded, and the
options in its query (`SqliteOptions`), each checked as it is read, so a URL that
would be misread (a '#' cutting the path short, an option given twice, a timeout
that is not a finite number of seconds) is refused with InvalidArgumentError before
any file is touched."""

from __future__ import annotations

from math import isfinite
from typing import Final
from urllib.parse import parse_qsl, unquote, urlsplit

import attrs
from loom_kernel.spi import DEFAULT_BLOB_THRESHOLD, InvalidArgumentError

__all__ = ["SqliteOptions", "parse_store_url"]

_SYNCHRONOUS: Final = ("off", "normal", "full", "extra")


@attrs.frozen
class SqliteOptions:
    """Options from the URL query.

    Attributes:
        synchronous: SQLite's `synchronous` pragma. `full` (the default) makes a
            completed step survive power loss; `normal` survives a process crash but
            may lose the last commits on power loss.
        timeout: seconds a writer waits for another writer's lock before giving up
            with StoreUnavailableError.
        blobs: where payloads over `blob_threshold` bytes go, as an fsspec URL; by
            default (None) a folder beside the database, `<path>.blobs`; `none`
            keeps every payload in the database.
        blob_threshold: the bytes over which a payload goes to the blobs.
    """

    synchronous: str = "full"
    timeout: float = 10.0
    blobs: str | None = None
    blob_threshold: int = DEFAULT_BLOB_THRESHOLD

    @classmethod
    def parse(cls, query: str) -> SqliteOptions:
        """Read `synchronous=`, `timeout=`, `blobs=` and `blob_threshold=` from a URL query.

        Raises:
            InvalidArgumentError: an unknown or repeated option, or a bad value.
        """
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False)
        values = dict(pairs)
        if len(values) != len(pairs):
            names = [name for name, _ in pairs]
            repeated = sorted({name for name in names if names.count(name) > 1})
            raise InvalidArgumentError(f"sqlite store options given more than once: {repeated}")
        unknown = set(values) - {"synchronous", "timeout", "blobs", "blob_threshold"}
        if unknown:
            raise InvalidArgumentError(f"unknown sqlite store options: {sorted(unknown)}")
        synchronous = values.get("synchronous", "full").lower()
        if synchronous not in _SYNCHRONOUS:
            raise InvalidArgumentError(
                f"synchronous must be one of {_SYNCHRONOUS}, not {synchronous!r}"
            )
        try:
            timeout = float(values.get("timeout", "10"))
        except ValueError:
            raise InvalidArgumentError(
                f"timeout must be seconds, not {values['timeout']!r}"
            ) from None
        if not isfinite(timeout) or timeout < 0:
            raise InvalidArgumentError(
                f"timeout must be a finite number of seconds >= 0, not {values['timeout']!r}"
            )
        threshold = values.get("blob_threshold", str(DEFAULT_BLOB_THRESHOLD))
        if not threshold.isdigit() or int(threshold) < 1:
            raise InvalidArgumentError(
                f"blob_threshold must be a whole number of bytes >= 1, not {threshold!r}"
            )
        blobs = values.get("blobs")
        if blobs is not None and not blobs:
            raise InvalidArgumentError("blobs must be an fsspec URL or none, not empty")
        return cls(
            synchronous=synchronous,
            timeout=timeout,
            blobs=blobs,
            blob_threshold=int(threshold),
        )


def parse_store_url(url: str) -> tuple[str, SqliteOptions]:
    """The database path and the options of `sqlite:///absolute/path.db`,
    `sqlite://relative/path.db` or `sqlite:///:memory:` (see `open_sqlite_store`).

    Raises:
        InvalidArgumentError: not a sqlite store URL, a fragment, no path, or bad options.
    """
    parts = urlsplit(url)
    if parts.scheme != "sqlite":
        raise InvalidArgumentError(f"not a sqlite store URL: {url!r}")
    if "#" in url:
        raise InvalidArgumentError(
            f"a sqlite store URL has no fragment: '#' in {url!r} would cut the path short; "
            "write it as %23 in a file name"
        )
    path = unquote(parts.netloc + parts.path, errors="strict")
    if parts.netloc == "" and parts.path.startswith("/:memory:"):
        path = ":memory:"
    elif path.startswith("//"):  # sqlite:////abs/path, as SQLAlchemy spells it
        path = "/" + path.lstrip("/")
    if not path or path == "/":
        raise InvalidArgumentError(
            f"a sqlite store URL names a file: sqlite:///path/to/loom.db, not {url!r}"
        )
    return path, SqliteOptions.parse(parts.query)
