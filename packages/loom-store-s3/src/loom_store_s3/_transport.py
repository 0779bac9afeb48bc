"""Requests to S3, each with its failure translated into the kernel's error tree.

Every call runs with botocore's own retries off: reads, listings, deletes and
blind writes are retried here (they are idempotent); a conditional write is
never retried blindly, because a write whose reply was lost may have landed.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import Any, Final, Literal, TypeVar

from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from loom_kernel.spi import (
    AmbiguousWriteError,
    InvalidArgumentError,
    StoreMisconfiguredError,
    StoreUnavailableError,
)

__all__ = ["Outcome", "Transport", "classify", "remedy"]

_log = logging.getLogger("loom.s3")

T = TypeVar("T")
Outcome = Literal["ours", "taken"]

#: Error codes that mean "the request was refused on purpose" and will not change on retry.
_PERMANENT: Final = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket"}
)
_NOT_FOUND: Final = frozenset({"NoSuchKey", "404", "NotFound"})
#: botocore's errors for a request that failed in transit (timeouts, lost connections).
_TRANSPORT_FAULTS: Final = (BotoConnectionError, HTTPClientError)


def classify(exc: BaseException) -> Literal["conflict", "missing", "permanent", "transient"]:
    """What an S3 failure means for the store.

    conflict: 412, the conditional write found the key taken. missing: 404.
    permanent: credentials, permissions or a missing bucket. transient: everything
    else (409 ConditionalRequestConflict, 5xx, SlowDown, timeouts, lost
    connections): the request may or may not have taken effect.
    """
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "PreconditionFailed" or status == 412:
            return "conflict"
        if code in _NOT_FOUND or (status == 404 and code != "NoSuchBucket"):
            return "missing"
        if code in _PERMANENT or status in (400, 401, 403):
            return "permanent"
        return "transient"
    if isinstance(exc, BotoCoreError) and not isinstance(exc, _TRANSPORT_FAULTS):
        return "permanent"  # no credentials, a bad parameter: retrying cannot help
    return "transient"


def remedy(exc: BaseException) -> str:
    """What to fix after a permanent refusal (see `classify`)."""
    code, status = "", None
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code == "NoSuchBucket":
        return "the bucket does not exist: create it, or fix the bucket name, endpoint or region"
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 401:
        return "the credentials are wrong: check the access key, the secret and the region"
    if code == "AccessDenied" or status == 403:
        return (
            "the credentials may not do this: grant s3:GetObject, s3:PutObject, "
            "s3:DeleteObject and s3:ListBucket on the bucket and prefix (docs/stores/s3.md)"
        )
    if isinstance(exc, BotoCoreError) and "Credentials" in type(exc).__name__:
        return (
            "no credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "a profile, or a role"
        )
    return "the request itself is refused: check the endpoint, region and addressing options"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"{error.get('Code', '?')} (HTTP {status}): {error.get('Message') or ''}".rstrip(
            ": "
        )
    return f"{type(exc).__name__}: {exc}"


class Transport:
    """The store's S3 client, one bucket, with retries and error translation."""

    def __init__(self, client: Any, bucket: str, attempts: int) -> None:
        retries = client.meta.config.retries or {}
        total = retries.get("total_max_attempts")
        if total is None and "max_attempts" in retries:
            total = retries["max_attempts"] + 1
        if total != 1:  # None: botocore's default, which retries
            raise InvalidArgumentError(
                "the S3 client passed to the store must have botocore's retries off "
                "(Config(retries={'total_max_attempts': 1})): a conditional write retried "
                "blindly can report a false conflict against its own landed write"
            )
        self.client = client
        self.bucket = bucket
        self.attempts = attempts

    # -- retrying idempotent calls --------------------------------------------------

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        for attempt in range(self.attempts):
            try:
                return call()
            except (ClientError, BotoCoreError) as exc:
                if classify(exc) != "transient":
                    raise self._fail(what, exc) from exc
                if attempt + 1 == self.attempts:
                    raise StoreUnavailableError(
                        f"S3 {what} failed {self.attempts} times on bucket {self.bucket!r}: "
                        f"{_describe(exc)}"
                    ) from exc
                _log.debug("S3 %s failed (%s); retrying", what, _describe(exc))
                self.backoff(attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def backoff(attempt: int) -> None:
        time.sleep(min(1.0, 0.02 * 2**attempt) * (0.5 + random.random()))  # noqa: S311

    def _fail(self, what: str, exc: BaseException) -> StoreMisconfiguredError:
        """A refusal no retry can change, with what to do about it."""
        return StoreMisconfiguredError(
            f"S3 {what} on bucket {self.bucket!r}: {_describe(exc)} ({remedy(exc)})"
        )

    # -- the requests the store makes -------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The object's bytes, None when it does not exist."""

        def call() -> bytes | None:
            try:
                response = self.client.get_object(Bucket=self.bucket, Key=key)
                return bytes(response["Body"].read())
            except ClientError as exc:
                if classify(exc) == "missing":
                    return None
                raise

        return self._retrying(f"GET {key}", call)

    def commit_of(self, key: str) -> str | None:
        """The commit id stored with an object (HEAD), None when it does not exist."""

        def call() -> str | None:
            try:
                response = self.client.head_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                if classify(exc) == "missing":
                    return None
                raise
            return str(response.get("Metadata", {}).get("loom-commit", ""))

        return self._retrying(f"HEAD {key}", call)

    def modified(self, key: str) -> float | None:
        """When an object was last written (HEAD), None when it does not exist."""

        def call() -> float | None:
            try:
                response = self.client.head_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                if classify(exc) == "missing":
                    return None
                raise
            return float(response["LastModified"].timestamp())

        return self._retrying(f"HEAD {key}", call)

    def put(self, key: str, body: bytes, commit: str = "") -> None:
        """An unconditional write (idempotent: markers, stubs, index entries)."""
        self._retrying(
            f"PUT {key}",
            lambda: self.client.put_object(
                Bucket=self.bucket, Key=key, Body=body, Metadata={"loom-commit": commit}
            ),
        )

    def put_new(self, key: str, body: bytes, commit: str, *, lose_reply: bool = False) -> Outcome:
        """Create `key` only if it does not exist (If-None-Match: *).

        Returns "ours" when this write created the key, "taken" when another write
        holds it. An ambiguous failure (409, 5xx, a timeout, a lost reply) is resolved
        by reading back the commit id stored with the object; when the key is still
        absent the write is sent again, with the same commit id.

        Raises:
            StoreUnavailableError: the outcome could not be learned.
        """
        last: BaseException | None = None
        for attempt in range(self.attempts):
            try:
                self.client.put_object(
                    Bucket=self.bucket,
                    Key=key,
                    Body=body,
                    IfNoneMatch="*",
                    Metadata={"loom-commit": commit},
                )
                if lose_reply:
                    lose_reply = False
                    raise AmbiguousWriteError("injected fault: the reply was lost")
                return "ours"
            except (ClientError, BotoCoreError, AmbiguousWriteError) as exc:
                kind = classify(exc)
                if kind == "permanent":
                    raise self._fail(f"conditional PUT {key}", exc) from exc
                if kind == "conflict" and attempt == 0:
                    return "taken"  # no earlier attempt of ours can hold the key
                last = exc
            found = self.commit_of(key)
            if found is not None:
                return "ours" if found == commit else "taken"
            if attempt + 1 < self.attempts:
                _log.debug("conditional PUT %s did not land (%s); sending again", key, last)
                self.backoff(attempt)
        raise StoreUnavailableError(
            f"S3 conditional PUT {key} on bucket {self.bucket!r} did not land after "
            f"{self.attempts} attempts: {_describe(last) if last else 'unknown'}"
        ) from last

    def delete(self, keys: list[str]) -> None:
        """Remove objects (absent ones are fine), a thousand per request."""
        for start in range(0, len(keys), 1000):
            chunk = keys[start : start + 1000]
            request = {"Objects": [{"Key": key} for key in chunk], "Quiet": True}

            def call(request: dict[str, Any] = request) -> None:
                response = self.client.delete_objects(Bucket=self.bucket, Delete=request)
                errors = response.get("Errors") or []
                if errors:
                    raise StoreUnavailableError(f"S3 DeleteObjects left {len(errors)} objects")

            self._retrying("DeleteObjects", call)

    def pages(
        self,
        prefix: str,
        *,
        start_after: str | None = None,
        delimiter: str | None = None,
        page_size: int = 1000,
    ) -> Iterator[dict[str, Any]]:
        """ListObjectsV2 responses, page by page, in key order."""
        arguments: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": page_size}
        if start_after is not None:
            arguments["StartAfter"] = start_after
        if delimiter is not None:
            arguments["Delimiter"] = delimiter
        while True:
            page: dict[str, Any] = self._retrying(
                f"LIST {prefix}", lambda: self.client.list_objects_v2(**arguments)
            )
            yield page
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            arguments.pop("StartAfter", None)
            arguments["ContinuationToken"] = token
