"""What a `postgresql:` store URL says: where the server is (libpq's own URI, passed on
as it is, with libpq's options such as `sslmode`), and the store's options, taken out
of the query and checked as they are read."""

from __future__ import annotations

import re
from math import isfinite
from typing import Final
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import attrs
from loom_kernel.spi import DEFAULT_BLOB_THRESHOLD, InvalidArgumentError

__all__ = ["PostgresOptions", "parse_postgres_url"]

_SCHEMA: Final = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_OURS: Final = frozenset(
    {"schema", "pool_min", "pool_max", "timeout", "blobs", "blob_threshold", "notify"}
)


@attrs.frozen
class PostgresOptions:
    """The store's options (the URL's query, less libpq's own).

    Attributes:
        schema: the PostgreSQL schema the store's tables live in (created if missing):
            lower-case letters, digits and `_`, so several stores share a database.
        pool_min: connections the pool keeps open.
        pool_max: the most connections the pool opens (reads each take one; appends
            of concurrent runs share one, committed together).
        timeout: seconds a call waits for a pooled connection, and for a lock or a
            statement, before it fails with StoreUnavailableError.
        blobs: where payloads over `blob_threshold` bytes go, as an fsspec URL; by
            default (None) every payload stays in the database, up to the store's
            `max_record_bytes`.
        blob_threshold: the bytes over which a payload goes to the blobs.
        notify: whether appends that have work for workers (run-index hints, queue
            admissions, timers) send a NOTIFY, and workers LISTEN for it.
    """

    schema: str = "loom"
    pool_min: int = 1
    pool_max: int = 10
    timeout: float = 10.0
    blobs: str | None = None
    blob_threshold: int = DEFAULT_BLOB_THRESHOLD
    notify: bool = True

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.schema, str) or _SCHEMA.fullmatch(self.schema) is None:
            raise InvalidArgumentError(
                "schema is 1 to 63 lower-case letters, digits and '_', not starting with a "
                f"digit: not {self.schema!r}"
            )
        for name in ("pool_min", "pool_max", "blob_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} is a whole number >= 1, not {value!r}")
        if self.pool_min > self.pool_max:
            raise InvalidArgumentError(
                f"pool_min ({self.pool_min}) is more than pool_max ({self.pool_max})"
            )
        if not isinstance(self.timeout, int | float) or not isfinite(self.timeout):
            raise InvalidArgumentError(f"timeout is a number of seconds, not {self.timeout!r}")
        if self.timeout <= 0:
            raise InvalidArgumentError(f"timeout is a number of seconds > 0, not {self.timeout!r}")

    @classmethod
    def from_query(cls, values: dict[str, str]) -> PostgresOptions:
        """The options from a URL query's values (the store's own names only).

        Raises:
            InvalidArgumentError: a bad value.
        """

        def whole(name: str, default: int) -> int:
            text = values.get(name)
            if text is None:
                return default
            if not text.isdigit():
                raise InvalidArgumentError(f"{name} is a whole number >= 1, not {text!r}")
            return int(text)

        try:
            timeout = float(values.get("timeout", "10"))
        except ValueError:
            raise InvalidArgumentError(
                f"timeout is a number of seconds, not {values['timeout']!r}"
            ) from None
        notify = values.get("notify", "on").lower()
        if notify not in ("on", "off"):
            raise InvalidArgumentError(f"notify is on or off, not {values['notify']!r}")
        blobs = values.get("blobs")
        if blobs is not None and not blobs:
            raise InvalidArgumentError("blobs is an fsspec URL or none, not empty")
        return cls(
            schema=values.get("schema", "loom"),
            pool_min=whole("pool_min", 1),
            pool_max=whole("pool_max", 10),
            timeout=timeout,
            blobs=None if blobs is None or blobs.lower() == "none" else blobs,
            blob_threshold=whole("blob_threshold", DEFAULT_BLOB_THRESHOLD),
            notify=notify == "on",
        )


def parse_postgres_url(url: str) -> tuple[str, PostgresOptions]:
    """libpq's connection URI and the store's options, from `postgresql://...`
    (or `postgres://...`).

    Raises:
        InvalidArgumentError: not such a URL, a fragment, or an option given twice or
            with a bad value.
    """
    if not isinstance(url, str):
        raise InvalidArgumentError(f"a PostgreSQL store URL is a str, not {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise InvalidArgumentError(
            f"a PostgreSQL store URL looks like postgresql://user@host/database, not {url!r}"
        )
    if parts.fragment or "#" in url:
        raise InvalidArgumentError(f"a PostgreSQL store URL has no fragment ('#'): {url!r}")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    names = [name for name, _ in pairs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InvalidArgumentError(f"PostgreSQL store options given more than once: {repeated}")
    ours = {name: value for name, value in pairs if name in _OURS}
    theirs = [(name, value) for name, value in pairs if name not in _OURS]
    # libpq decodes %XX in a URI's query, never '+': a space goes as %20.
    query = urlencode(theirs, quote_via=quote)
    conninfo = urlunsplit(("postgresql", parts.netloc, parts.path, query, ""))
    return conninfo, PostgresOptions.from_query(ours)
