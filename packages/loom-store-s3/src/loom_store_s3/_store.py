"""The journal SPI on S3: one conditional PUT per append, no lock service."""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, Final

import attrs
import boto3
from botocore.config import Config
from loom_kernel.spi import (
    ConflictError,
    FaultInjection,
    FsspecBlobs,
    InvalidArgumentError,
    JournalStore,
    NewRecord,
    Record,
    SchemaError,
    StoreMisconfiguredError,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
    validate_stream_id,
)

from loom_store_s3._batch import Batch, decode_batch, encode_batch, encode_marker
from loom_store_s3._blobs import BucketBlobs
from loom_store_s3._layout import FORMAT, MAX_SHARDS, Layout
from loom_store_s3._options import SIGNATURE_WINDOW, S3Options
from loom_store_s3._transport import Transport

__all__ = ["S3Store"]

_log = logging.getLogger("loom.s3")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@attrs.frozen
class _Key:
    key: str
    number: int
    modified: float  # seconds since the epoch, from the listing


@attrs.frozen
class _Scan:
    """One listing of a stream: its batches in order, its floor, its last batch read."""

    batches: tuple[_Key, ...]
    floors: tuple[_Key, ...]
    last: Batch | None

    @property
    def head(self) -> int:
        return 0 if self.last is None else self.last.end

    @property
    def floor(self) -> int:
        top = max((marker.number for marker in self.floors), default=0)
        return self.head if self.deleted else top

    @property
    def deleted(self) -> bool:
        return self.last is not None and self.last.state == "tomb"

    def ends(self) -> Iterator[tuple[_Key, int]]:
        """Each batch, in order, with the position of its last record (the next
        batch's first key, or the head for the last batch)."""
        batches = self.batches
        for index, key in enumerate(batches):
            yield key, batches[index + 1].number if index + 1 < len(batches) else self.head


@attrs.define
class _Known:
    head: int
    learned: float  # time.monotonic()


#: The largest object one S3 PUT may write: 5 GiB.
_LARGEST_PUT: Final = 5 * 1024**3


class S3Store(FaultInjection, JournalStore):
    """Streams in an S3 bucket under a prefix; safe for many processes on many machines.

    An append is one PUT with `If-None-Match: *` of the key named by the stream and
    the expected head, so of two writers at the same head exactly one creates it.
    docs/stores/s3.md describes the layout, the costs and the failure handling.

    Args:
        bucket: the bucket (it must exist).
        prefix: where in the bucket this store's keys live ('' for the top).
        options: endpoint, region, timeouts, shards, head cache and retention.
        client: a boto3 S3 client with retries off; by default one is made from
            `session` (or boto3's default session) and the options.
        session: a boto3 Session to make the client from.
    """

    head_is_cheap = False  # a head is a LIST and a GET: the engine skips its pre-step look
    #: S3's largest single PUT is 5 GiB; an append is one object (a header line, then
    #: its payloads), so a MiB is kept for the header.
    max_record_bytes = _LARGEST_PUT - 1024 * 1024

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        options: S3Options | None = None,
        *,
        client: Any = None,
        session: Any = None,
    ) -> None:
        self._options = options or S3Options()
        if not isinstance(bucket, str) or not _BUCKET.fullmatch(bucket):
            raise InvalidArgumentError(
                f"not an S3 bucket name (3-63 of a-z 0-9 . -, starting and ending with a "
                f"letter or digit): {bucket!r}"
            )
        if prefix:
            validate_stream_id(prefix)  # the stream-id rules: it cannot climb out of the bucket
        self.bucket = bucket
        self.prefix = prefix
        self._transport = Transport(
            client if client is not None else _make_client(self._options, session),
            bucket,
            self._options.attempts,
        )
        self._layout = self._open_layout()
        blobs = self._options.blobs
        if blobs == "bucket":
            self.use_blobs(
                BucketBlobs(self._transport, self._layout.root + "blobs/"),
                self._options.blob_threshold,
            )
        elif blobs.lower() != "none":
            self.use_blobs(FsspecBlobs(blobs), self._options.blob_threshold)
        self._known: dict[str, _Known] = {}
        self._known_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            max_workers=self._options.workers, thread_name_prefix="loom-s3"
        )
        self._closed = False
        if not self._options.retention_is_safe:
            _log.warning(
                "S3 store %s/%s: retention %.0f s does not exceed head_ttl %.0f s plus the "
                "15-minute signature window; a very late writer could reuse a removed key",
                bucket,
                prefix,
                self._options.retention,
                self._options.head_ttl,
            )

    def _open_layout(self) -> Layout:
        """Read the layout descriptor (writing it for a new store), then prove the server
        refuses a conditional write to an existing key: every append relies on it."""
        key = Layout(self.prefix, 1).descriptor_key
        body = self._transport.get(key)
        if body is None:
            descriptor = json.dumps({"format": FORMAT, "shards": self._options.shards}).encode()
            self._transport.put_new(key, descriptor, "layout")  # a racing opener's is as good
            body = self._transport.get(key)
            if body is None:
                raise StoreUnavailableError(f"cannot create the layout descriptor {key!r}")
        layout = self._read_descriptor(key, body)
        if self._transport.put_new(key, body, "layout-probe") != "taken":
            raise StoreMisconfiguredError(
                f"s3://{self.bucket}/{self.prefix}: the server accepted a conditional write "
                "(If-None-Match: *) to an existing key, so appends would not be atomic. "
                "Ceph RGW before Reef ignores If-None-Match on versioned buckets: use an "
                "unversioned bucket there, or a server that honours conditional writes"
            )
        return layout

    def _read_descriptor(self, key: str, body: bytes) -> Layout:
        try:
            descriptor = json.loads(body)
            version, shards = descriptor["format"], descriptor["shards"]
        except (ValueError, KeyError, TypeError):
            raise StoreMisconfiguredError(f"damaged layout descriptor {key!r}") from None
        if not isinstance(version, int) or version > FORMAT:
            raise SchemaError(
                f"s3://{self.bucket}/{self.prefix} was written by a newer loom-store-s3 "
                f"(format {version}; this one reads format {FORMAT}): upgrade loom-store-s3"
            )
        if not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
            raise StoreMisconfiguredError(f"damaged layout descriptor {key!r}: shards={shards!r}")
        return Layout(self.prefix, shards)

    @property
    def options(self) -> S3Options:
        """The options this store was opened with."""
        return self._options

    def close(self) -> None:
        """Stop the read workers; the boto3 client needs no closing."""
        self._closed = True
        self._pool.shutdown(wait=False)

    # -- what a stream looks like ------------------------------------------------------

    def _scan(self, stream: str) -> _Scan:
        """List a stream's keys and read its last batch: its head, floor and liveness."""
        stream_dir = self._layout.stream_dir(stream)
        batches: list[_Key] = []
        floors: list[_Key] = []
        for page in self._transport.pages(stream_dir):
            for item in page.get("Contents", []):
                parsed = Layout.parse_entry(stream_dir, item["Key"])
                if parsed is None:
                    continue
                modified = item.get("LastModified")
                stamp = modified.timestamp() if isinstance(modified, datetime) else time.time()
                entry = _Key(item["Key"], parsed[1], stamp)
                (batches if parsed[0] == "R" else floors).append(entry)
        last = None
        if batches:
            last = self._get_batch(batches[-1].key)
            if last is None:  # removed since the listing (a concurrent sweep): look again
                return self._scan(stream)
            if last.start != batches[-1].number:
                raise StoreUnavailableError(
                    f"damaged batch object {batches[-1].key!r}: it says it starts at {last.start}"
                )
        scan = _Scan(tuple(batches), tuple(floors), last)
        self._learn(stream, scan.head)
        return scan

    def _get_batch(self, key: str) -> Batch | None:
        body = self._transport.get(key)
        return None if body is None else decode_batch(key, body)

    def _learn(self, stream: str, head: int) -> None:
        with self._known_lock:
            self._known[stream] = _Known(head, time.monotonic())

    def _forget(self, stream: str) -> None:
        with self._known_lock:
            self._known.pop(stream, None)

    def _trusted_head(self, stream: str) -> int | None:
        with self._known_lock:
            known = self._known.get(stream)
        if known is None or time.monotonic() - known.learned >= self._options.head_ttl:
            return None
        return known.head

    # -- the SPI hooks -------------------------------------------------------------------

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        lose_reply = self._next_fault(stream)
        if expected != 0 and self._trusted_head(stream) != expected:
            # Not the one-request path: the head must be a real batch boundary, never a
            # position inside a batch (that would create an overlapping batch). Zero
            # always is one, and key 0 is never removed (see _clean), so an append at
            # 0 to a stream that exists, or did, meets that key and is refused.
            scan = self._scan(stream)
            if scan.deleted:
                raise StreamDeletedError(stream, scan.head)
            if scan.head != expected:
                raise ConflictError(stream, expected, scan.head)
        commit = uuid.uuid4().hex
        body = encode_batch(commit, expected, records)
        if len(body) > _LARGEST_PUT:
            raise InvalidArgumentError(
                f"an append of {len(records)} records is {len(body):,} bytes, over S3's "
                f"largest object of {_LARGEST_PUT:,}: nothing was written; append fewer "
                "records at once"
            )
        key = self._layout.batch_key(stream, expected)
        try:
            outcome = self._transport.put_new(key, body, commit, lose_reply=lose_reply)
        except StoreUnavailableError:
            self._forget(stream)
            raise
        if outcome == "ours":
            new_head = expected + len(records)
            self._learn(stream, new_head)
            return new_head
        scan = self._scan(stream)
        if scan.deleted:
            raise StreamDeletedError(stream, scan.head)
        raise ConflictError(stream, expected, scan.head)

    def _head(self, stream: str) -> int:
        scan = self._scan(stream)
        if scan.deleted:
            raise StreamDeletedError(stream, scan.head)
        return scan.head

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        if self._nothing_after(stream, after):
            return []
        for _ in range(3):
            scan = self._scan(stream)
            if scan.last is None:
                return []
            if scan.deleted:
                raise StreamDeletedError(stream, scan.head)
            if after < scan.floor:
                raise TrimmedError(stream, after, scan.floor)
            found = self._read_batches(scan, after, limit)
            if found is not None:
                return found
        raise StoreUnavailableError(f"{stream!r} kept changing under a read; try again")

    def _nothing_after(self, stream: str, after: int) -> bool:
        """Whether one GET shows the stream holds nothing after `after` (a reader that
        polls a stream it has read up to its head pays a GET, not a LIST).

        An append after `after` writes the batch key `after`, if `after` is a batch
        boundary: 0 always is, and so is a head this process learned. That key is
        never removed within the retention period of its writing (key 0 never is),
        so if it is missing now, and the head was `after` less than that long ago,
        nothing was appended since: the head is still `after`, learned again now.
        A key that is there (a batch, a stub, a tombstone) says nothing alone: the
        caller scans.
        """
        if after != 0:
            with self._known_lock:
                known = self._known.get(stream)
            window = self._options.retention - self._options.head_ttl - SIGNATURE_WINDOW
            if known is None or known.head != after or time.monotonic() - known.learned >= window:
                return False
        if self._transport.get(self._layout.batch_key(stream, after)) is not None:
            return False
        self._learn(stream, after)
        return True

    def _read_batches(self, scan: _Scan, after: int, limit: int | None) -> list[Record] | None:
        """The records after `after` from the scanned batches; None if one vanished."""
        assert scan.last is not None
        stop = scan.head if limit is None else min(scan.head, after + limit)
        if stop <= after:
            return []
        wanted = [key.key for key, end in scan.ends() if end > after and key.number < stop]
        last_key = scan.batches[-1].key
        if self._closed:
            raise StoreUnavailableError(f"S3 store s3://{self.bucket}/{self.prefix} is closed")
        fetched = list(
            self._pool.map(
                lambda key: scan.last if key == last_key else self._get_batch(key), wanted
            )
        )
        records: list[Record] = []
        for batch in fetched:
            if batch is None:
                return None
            if batch.state != "live":
                continue  # a stub or tombstone holds no readable records
            records.extend(batch.records)
        return [record for record in records if after < record.position <= stop]

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        names = heapq.merge(
            *(self._shard_names(shard, prefix, after) for shard in range(self._layout.shards))
        )
        return list(itertools.islice(names, limit))

    def _shard_names(self, shard: int, prefix: str, after: str | None) -> Iterator[str]:
        """Live stream names of one shard with `prefix`, after `after`, in order, lazily."""
        root = self._layout.journal_root(shard)
        start_after = (
            Layout.after_stream(root, after) if after is not None and after >= prefix else None
        )
        for page in self._transport.pages(
            root + prefix, start_after=start_after, delimiter=Layout.end_marker()
        ):
            names = [
                Layout.name_from_prefix(root, item["Prefix"])
                for item in page.get("CommonPrefixes", [])
            ]
            if not names:
                continue
            dead = self._deleted_between(shard, prefix, names[0], names[-1])
            yield from (name for name in names if name not in dead)

    def _deleted_between(self, shard: int, prefix: str, first: str, last: str) -> set[str]:
        """Names in the shard's deleted-streams index from `first` to `last`."""
        root = self._layout.deleted_root(shard)
        bound = Layout.after_stream(root, last)
        dead: set[str] = set()
        for page in self._transport.pages(root + prefix, start_after=root + first):
            for item in page.get("Contents", []):
                if item["Key"] > bound:
                    return dead
                dead.add(Layout.name_from_prefix(root, item["Key"]))
        return dead

    def _trim(self, stream: str, before: int) -> None:
        scan = self._scan(stream)
        if scan.deleted:
            raise StreamDeletedError(stream, scan.head)
        self._check_trim(stream, before, scan.head)
        floor = before - 1
        if scan.last is None or floor <= scan.floor:
            return
        key = self._layout.floor_key(stream, floor)
        self._transport.put(key, b"")
        self._clean(stream, scan, floor)

    def _delete(self, stream: str) -> None:
        while True:
            scan = self._scan(stream)
            if scan.deleted:
                break
            commit = uuid.uuid4().hex
            key = self._layout.batch_key(stream, scan.head)
            body = encode_marker(commit, scan.head, 0, "tomb")
            if self._transport.put_new(key, body, commit) == "ours":
                # what a listing would show now, without listing again
                tomb = _Key(key, scan.head, time.time())
                scan = _Scan((*scan.batches, tomb), scan.floors, decode_batch(key, body))
                break
            # another writer appended first: retire the stream at its new head
        self._transport.put(self._layout.deleted_key(stream), b"")
        self._forget(stream)
        self._clean(stream, scan, scan.head)

    # -- removing what trim and delete left behind ---------------------------------------

    def _clean(self, stream: str, scan: _Scan, floor: int) -> int:
        """Remove what lies below `floor` and is older than the retention period.

        Two batch objects are never removed: the first (key 0, so an append at 0 can
        never recreate the stream) and the last (it holds the head; for a deleted
        stream it is the tombstone). Below the floor they become stubs instead.
        Returns how many objects were removed.
        """
        cutoff = time.time() - self._options.retention
        newest_floor = max((marker.number for marker in scan.floors), default=-1)
        doomed = [
            marker.key
            for marker in scan.floors
            if marker.number < max(newest_floor, floor) and marker.modified < cutoff
        ]
        if scan.deleted:
            doomed += [marker.key for marker in scan.floors if marker.modified < cutoff]
        for index, (key, end) in enumerate(scan.ends()):
            if end > floor:
                break
            keep = index == 0 or index == len(scan.batches) - 1
            if keep:
                self._stub(key.key)
            elif key.modified < cutoff:
                doomed.append(key.key)
        unique = sorted(set(doomed))
        self._transport.delete(unique)
        return len(unique)

    def _stub(self, key: str) -> None:
        """Overwrite a batch below the floor with a stub that keeps its start and count."""
        batch = self._get_batch(key)
        if batch is None or batch.state != "live":
            return
        stub = encode_marker(batch.commit, batch.start, batch.count, "stub")
        self._transport.put(key, stub, batch.commit)

    def sweep(self, prefix: str = "") -> int:
        """Remove trimmed and deleted batch objects whose retention has passed.

        trim() and delete() remove what is already old enough; run sweep()
        periodically (or after the retention period) for the rest. It visits every
        stream, deleted ones included, whose name starts with `prefix`.

        Returns:
            How many objects were removed.
        """
        removed = 0
        for shard in range(self._layout.shards):
            root = self._layout.journal_root(shard)
            for page in self._transport.pages(root + prefix, delimiter=Layout.end_marker()):
                for item in page.get("CommonPrefixes", []):
                    stream = Layout.name_from_prefix(root, item["Prefix"])
                    scan = self._scan(stream)
                    if scan.last is not None:
                        removed += self._clean(stream, scan, scan.floor)
        return removed


def _make_client(options: S3Options, session: Any) -> Any:
    """A boto3 S3 client for `options`, with botocore's own retries off."""
    addressing = options.addressing
    if addressing == "auto" and options.endpoint_url is not None:
        addressing = "path"
    config = Config(
        retries={"total_max_attempts": 1},
        connect_timeout=options.timeout,
        read_timeout=options.timeout,
        max_pool_connections=max(10, options.workers * 2),
        s3={"addressing_style": addressing},
        # Older S3-compatible servers (Ceph RGW among them) reject the CRC
        # checksums boto3 adds by default; S3 needs them only where it says so.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    factory = session if session is not None else boto3.session.Session()
    return factory.client(
        "s3", endpoint_url=options.endpoint_url, region_name=options.region, config=config
    )
