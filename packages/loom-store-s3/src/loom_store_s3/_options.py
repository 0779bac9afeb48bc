"""The store's settings, from `s3://bucket/prefix?…` URLs or from code."""

from __future__ import annotations

from math import isfinite
from typing import Final
from urllib.parse import parse_qsl, urlsplit

import attrs
from loom_kernel.spi import DEFAULT_BLOB_THRESHOLD, InvalidArgumentError, validate_stream_id

from loom_store_s3._layout import MAX_SHARDS

__all__ = ["S3Options", "parse_s3_url"]

_ADDRESSING: Final = ("auto", "path", "virtual")
# AWS refuses a request that arrives more than 15 minutes after it was signed.
SIGNATURE_WINDOW: Final = 900.0


def _positive(_instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not isinstance(value, int | float) or not isfinite(value) or value < 0:
        raise InvalidArgumentError(
            f"{attribute.name} must be a finite number of seconds >= 0, not {value!r}"
        )


@attrs.frozen
class S3Options:
    """How the store talks to S3 and when it may remove objects.

    Attributes:
        endpoint_url: an S3-compatible service (Ceph RGW, MinIO, moto); None for AWS.
        region: the bucket's region; None takes boto3's usual chain.
        addressing: 'path', 'virtual' or 'auto' (the default: path-style for a
            custom endpoint, boto3's choice on AWS).
        shards: how many key prefixes a new store spreads its streams over (read
            from the bucket for an existing store; 1 to 256).
        head_ttl: seconds this process trusts a stream head it learned, for the
            one-request append; after that an append first lists the stream.
        retention: seconds a trimmed or deleted batch object is kept before it is
            removed. Must exceed head_ttl plus AWS's 15-minute signature window,
            so no writer can still be aiming at a key that was removed.
        timeout: connect and read timeout of every request, in seconds.
        attempts: tries for a request that failed transiently (reads, deletes,
            and conditional writes whose outcome was confirmed).
        workers: parallel GETs when reading many batches.
        blobs: where payloads over `blob_threshold` bytes go: `bucket` (the default:
            this store's own bucket, under its prefix), `none` (kept in the batches),
            or an fsspec URL (s3fs installed, for `s3://other-bucket/...`).
        blob_threshold: the bytes over which a payload goes to the blobs.
    """

    endpoint_url: str | None = None
    region: str | None = None
    addressing: str = attrs.field(default="auto")
    shards: int = attrs.field(default=8)
    head_ttl: float = attrs.field(default=60.0, validator=_positive)
    retention: float = attrs.field(default=3600.0, validator=_positive)
    timeout: float = attrs.field(default=10.0, validator=_positive)
    attempts: int = attrs.field(default=4)
    workers: int = attrs.field(default=16)
    blobs: str = "bucket"
    blob_threshold: int = attrs.field(default=DEFAULT_BLOB_THRESHOLD)

    @addressing.validator
    def _check_addressing(self, _attribute: object, value: str) -> None:
        if value not in _ADDRESSING:
            raise InvalidArgumentError(f"addressing must be one of {_ADDRESSING}, not {value!r}")

    @shards.validator
    def _check_shards(self, _attribute: object, value: int) -> None:
        if not 1 <= value <= MAX_SHARDS:
            raise InvalidArgumentError(f"shards must be 1 to {MAX_SHARDS}, not {value}")

    @attempts.validator
    def _check_attempts(self, _attribute: object, value: int) -> None:
        if value < 1:
            raise InvalidArgumentError(f"attempts must be at least 1, not {value}")

    @blob_threshold.validator
    def _check_blob_threshold(self, _attribute: object, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"blob_threshold must be at least 1 byte, not {value!r}")

    @workers.validator
    def _check_workers(self, _attribute: object, value: int) -> None:
        if value < 1:
            raise InvalidArgumentError(f"workers must be at least 1, not {value}")

    @property
    def retention_is_safe(self) -> bool:
        """Whether removal waits out every cached head and signed request."""
        return self.retention > self.head_ttl + SIGNATURE_WINDOW


_FLOATS: Final = ("head_ttl", "retention", "timeout")
_INTS: Final = ("shards", "attempts", "workers", "blob_threshold")
_STRINGS: Final = ("endpoint_url", "region", "addressing", "blobs")


def parse_s3_url(url: str) -> tuple[str, str, S3Options]:
    """Split `s3://bucket/prefix?option=value&…` into bucket, prefix and options."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise InvalidArgumentError(f"an S3 store URL is s3://bucket/prefix?options, not {url!r}")
    bucket = parts.netloc
    prefix = parts.path.strip("/")
    if prefix:
        validate_stream_id(prefix)  # the same rules: it cannot climb out of the bucket
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    values = dict(pairs)
    if len(values) != len(pairs):
        names = [name for name, _ in pairs]
        repeated = sorted({name for name in names if names.count(name) > 1})
        raise InvalidArgumentError(f"s3 store options given more than once: {repeated}")
    if parts.fragment:
        raise InvalidArgumentError(f"an S3 store URL has no fragment ('#'): {url!r}")
    known = {*_FLOATS, *_INTS, *_STRINGS}
    unknown = set(values) - known
    if unknown:
        raise InvalidArgumentError(
            f"unknown s3 store options {sorted(unknown)}; known: {sorted(known)}"
        )
    settings: dict[str, object] = {}
    for name, text in values.items():
        try:
            settings[name] = (
                float(text) if name in _FLOATS else int(text) if name in _INTS else text or None
            )
        except ValueError:
            raise InvalidArgumentError(f"s3 store option {name}={text!r} is not a number") from None
    return bucket, prefix, S3Options(**settings)  # type: ignore[arg-type]
