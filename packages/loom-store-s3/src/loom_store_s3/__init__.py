"""Loom's S3 store: the journal SPI on S3 conditional writes (`If-None-Match: *`).

Open it with `loom_kernel.open_store("s3://bucket/prefix?endpoint_url=…&region=…")`,
or build an `S3Store` in code with your own boto3 session or client.
docs/stores/s3.md covers the layout, permissions, consistency, costs and failures.
"""

from __future__ import annotations

from loom_kernel import InvalidArgumentError

from loom_store_s3._options import S3Options, parse_s3_url
from loom_store_s3._store import S3Store

__all__ = ["S3Options", "S3Store", "open_s3_store"]


def open_s3_store(url: str) -> S3Store:
    """Open `s3://bucket/prefix?option=value&…` (options: see S3Options).

    Credentials come from boto3's usual chain (environment, profile, instance role).
    """
    bucket, prefix, options = parse_s3_url(url)
    if not bucket:
        raise InvalidArgumentError(f"an S3 store URL names a bucket: {url!r}")
    return S3Store(bucket, prefix, options)
