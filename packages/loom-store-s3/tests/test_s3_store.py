"""What the S3 store does beyond the shared contract: layout, costs, cleanup, isolation."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from loom_kernel import open_store
from loom_kernel.spi import (
    ConflictError,
    InvalidArgumentError,
    InvalidIdError,
    NewRecord,
    SchemaError,
    StoreMisconfiguredError,
    StoreUnavailableError,
    StreamDeletedError,
    TrimmedError,
)
from loom_store_s3 import S3Options, S3Store
from loom_store_s3._options import parse_s3_url
from loom_store_s3._store import _make_client
from loom_store_s3.testing import RequestCounter, S3Server


def _records(count: int, tag: str = "r") -> list[NewRecord]:
    return [NewRecord("test.s3", f"{tag}{index}".encode(), 2.5 + index) for index in range(count)]


def _keys(server: S3Server, store: S3Store) -> list[str]:
    client = server.client()
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=store.bucket, Prefix=store.prefix + "!"
    ):
        keys.extend(item["Key"] for item in page.get("Contents", []))
    return keys


def test_url_options_are_parsed_and_checked() -> None:
    bucket, prefix, options = parse_s3_url(
        "s3://my-bucket/loom/prod?endpoint_url=http://127.0.0.1:9000&region=eu-west-1"
        "&shards=16&head_ttl=5&retention=7200&timeout=3&attempts=2&workers=4"
    )
    assert (bucket, prefix) == ("my-bucket", "loom/prod")
    assert options == S3Options(
        endpoint_url="http://127.0.0.1:9000",
        region="eu-west-1",
        shards=16,
        head_ttl=5,
        retention=7200,
        timeout=3,
        attempts=2,
        workers=4,
    )
    for bad in (
        "s3:///no-bucket",
        "s3://b/p?colour=blue",
        "s3://b/p?shards=2&shards=4",
        "s3://b/p?timeout=nan",
        "s3://b/p?head_ttl=inf",
        "s3://b/p#fragment",
        "s3://b/p?shards=0",
        "s3://b/p?shards=many",
        "s3://b/../escape",
        "s3://b/a//b",
        "s3://b/p?retention=-1",
        "s3://b/p?addressing=sideways",
    ):
        with pytest.raises(InvalidArgumentError):
            parse_s3_url(bad)
    with pytest.raises(InvalidArgumentError, match=re.escape("more than once: ['shards']")):
        parse_s3_url("s3://b/p?region=x&shards=2&shards=4")


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("attempts=0", "attempts must be at least 1, not 0"),
        ("workers=0", "workers must be at least 1, not 0"),
        ("shards=257", "shards must be 1 to 256, not 257"),
    ],
)
def test_url_options_below_their_floor_are_refused_naming_the_option(query: str, says: str) -> None:
    with pytest.raises(InvalidArgumentError, match=says):
        parse_s3_url(f"s3://b/p?{query}")
    floor = parse_s3_url("s3://b/p?attempts=1&workers=1&shards=256")[2]
    assert (floor.attempts, floor.workers, floor.shards) == (1, 1, 256)


def test_open_store_finds_the_s3_scheme(moto_server: S3Server, monkeypatch: Any) -> None:
    for name, value in moto_server.environment().items():
        monkeypatch.setenv(name, value)
    bucket = moto_server.new_bucket()
    url = f"s3://{bucket}/via-url?endpoint_url={moto_server.endpoint_url}&shards=3"
    store = open_store(url)
    store.append("x", 0, _records(1))
    assert open_store(url).read("x")[0].payload == b"r0"


@pytest.mark.parametrize(
    "retries", [{"total_max_attempts": 3}, {"max_attempts": 2}, {"mode": "standard"}, None]
)
def test_a_client_with_retries_on_is_refused(moto_server: S3Server, retries: Any) -> None:
    client = moto_server.client(retries=retries)
    with pytest.raises(InvalidArgumentError, match="retries off"):
        S3Store(moto_server.new_bucket(), "p", client=client)


def test_a_client_with_retries_off_is_accepted(moto_server: S3Server) -> None:
    client = moto_server.client(retries={"max_attempts": 0})
    store = S3Store(moto_server.new_bucket(), "p", client=client)
    assert store.append("s", 0, _records(1)) == 1
    assert [r.payload for r in store.read("s")] == [b"r0"]


@pytest.mark.parametrize(
    ("bucket", "prefix"), [("UPPER", "p"), ("a", "p"), ("ok-bucket", "../up"), ("ok-bucket", "a!b")]
)
def test_bad_bucket_names_and_prefixes_are_refused_before_any_request(
    bucket: str, prefix: str
) -> None:
    with pytest.raises(InvalidArgumentError):
        S3Store(bucket, prefix, client=object())


def test_a_missing_bucket_is_a_clear_error(moto_server: S3Server) -> None:
    with pytest.raises(StoreMisconfiguredError, match=r"NoSuchBucket.*create it"):
        S3Store("loom-no-such-bucket", "p", client=moto_server.client())


def test_a_bucket_written_by_a_newer_format_is_refused(moto_server: S3Server) -> None:
    store = moto_server.store()
    moto_server.client().put_object(
        Bucket=store.bucket,
        Key=store.prefix + "!layout.json",
        Body=json.dumps({"format": 99, "shards": 2}).encode(),
    )
    with pytest.raises(SchemaError, match="newer loom-store-s3"):
        moto_server.reopen(store)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{not json", "damaged layout descriptor"),
        (b'{"shards": 2}', "damaged layout descriptor"),
        (b"[1, 2]", "damaged layout descriptor"),
        (b'{"format": 1, "shards": 0}', "shards=0"),
        (b'{"format": 1, "shards": 257}', "shards=257"),
        (b'{"format": 1, "shards": "2"}', "shards='2'"),
    ],
)
def test_a_damaged_layout_descriptor_is_a_misconfiguration(
    moto_server: S3Server, body: bytes, says: str
) -> None:
    store = moto_server.store()
    moto_server.client().put_object(
        Bucket=store.bucket, Key=store.prefix + "!layout.json", Body=body
    )
    with pytest.raises(StoreMisconfiguredError, match=re.escape(says)):
        moto_server.reopen(store)


def test_a_damaged_batch_is_a_clear_error(moto_server: S3Server) -> None:
    store = moto_server.store()
    store.append("s", 0, _records(2))
    (key,) = [key for key in _keys(moto_server, store) if "!R" in key]
    moto_server.client().put_object(Bucket=store.bucket, Key=key, Body=b'{"v":1}\nxx')
    with pytest.raises(StoreUnavailableError, match="damaged batch object"):
        store.read("s")


def test_a_last_batch_that_says_it_starts_elsewhere_is_named_in_the_error(
    moto_server: S3Server,
) -> None:
    store = moto_server.store()
    store.append("s", 0, _records(2))
    store.append("s", 2, _records(1))
    first, last = sorted(key for key in _keys(moto_server, store) if "!R" in key)
    client = moto_server.client()
    body = client.get_object(Bucket=store.bucket, Key=first)["Body"].read()
    client.put_object(Bucket=store.bucket, Key=last, Body=body)  # says it starts at 0
    cold = moto_server.reopen(store)
    with pytest.raises(StoreUnavailableError) as raised:
        cold.head("s")
    assert f"damaged batch object {last!r}: it says it starts at 0" in str(raised.value)


def test_one_put_per_append_on_a_known_head_and_one_list_for_a_cold_head(
    s3_server: S3Server,
) -> None:
    client = s3_server.client()
    store = s3_server.store(client=client)
    counter = RequestCounter(client)
    head = 0
    head = store.append("run/1", head, _records(1))  # a new stream: key 0, no look first
    assert counter.take() == {"PutObject": 1}
    for _ in range(5):
        head = store.append("run/1", head, _records(1))
        assert counter.take() == {"PutObject": 1}
    cold = s3_server.twin(store, client)
    # Opening reads the layout descriptor and proves conditional writes are refused.
    assert counter.take() == {"GetObject": 1, "PutObject": 1}
    assert cold.head("run/1") == 6
    assert counter.take() == {"ListObjectsV2": 1, "GetObject": 1}
    cold.append("run/1", 6, _records(1))  # learned by head(): one PUT
    assert counter.take() == {"PutObject": 1}
    with pytest.raises(ConflictError):
        store.append("run/1", 6, _records(1))  # stale cache: the PUT meets the twin's batch
    assert counter.take()["PutObject"] == 1


def test_stores_on_other_prefixes_never_see_each_other(moto_server: S3Server) -> None:
    bucket = moto_server.new_bucket()
    client = moto_server.client()
    options = S3Options(shards=2)
    stores = {p: S3Store(bucket, p, options, client=client) for p in ("", "a", "a/b", "ab")}
    for prefix, store in stores.items():
        store.append("a/b/s", 0, [NewRecord("k", prefix.encode(), 1.0)])
        store.append("b", 0, [NewRecord("k", prefix.encode(), 1.0)])
    for prefix, store in stores.items():
        assert store.streams() == ["a/b/s", "b"]
        assert [r.payload for r in store.read("a/b/s")] == [prefix.encode()]


def test_ids_cannot_leave_the_prefix(moto_server: S3Server) -> None:
    store = moto_server.store()
    for bad in ("../x", "a/../../x", "/abs", "a!b", "a%2F..", "a\\b"):
        with pytest.raises(InvalidIdError):
            store.append(bad, 0, _records(1))
    assert _keys(moto_server, store) == [store.prefix + "!layout.json"]


def test_trim_then_removal_after_retention_keeps_the_first_and_last_batches(
    s3_server: S3Server,
) -> None:
    store = s3_server.store(head_ttl=0, retention=0)
    head = 0
    for _ in range(6):
        head = store.append("s", head, _records(2))
    store.trim("s", 9)  # floor 8: batches 1-2, 3-4, 5-6, 7-8 are below it
    batches = sorted(key for key in _keys(s3_server, store) if "!R" in key)
    assert [int(key[-20:]) for key in batches] == [0, 8, 10]  # first (a stub), 9-10, 11-12
    from loom_store_s3._batch import decode_batch

    client = s3_server.client()
    first = client.get_object(Bucket=store.bucket, Key=batches[0])["Body"].read()
    assert decode_batch(batches[0], first).state == "stub", "its records are gone"
    assert b"r0" not in first
    assert [r.position for r in store.read("s", 8)] == [9, 10, 11, 12]
    with pytest.raises(TrimmedError):
        store.read("s", 7)
    with pytest.raises(ConflictError):
        store.append("s", 0, _records(1))  # the first key still blocks a re-creation
    with pytest.raises(ConflictError):
        store.append("s", 4, _records(1))  # a removed key: refused by the head check
    store.trim("s", 11)  # floor 10: the last but one batch, 9-10, is below it now
    batches = sorted(key for key in _keys(s3_server, store) if "!R" in key)
    assert [int(key[-20:]) for key in batches] == [0, 10]
    store.trim("s", 13)  # everything: the last batch stays, as a stub, holding the head
    assert store.head("s") == 12
    assert store.read("s", 12) == []
    assert store.append("s", 12, _records(1)) == 13


def test_removal_waits_for_the_retention_period_and_sweep_finishes_it(
    s3_server: S3Server,
) -> None:
    patient = s3_server.store()  # default retention: an hour
    head = 0
    for _ in range(4):
        head = patient.append("s", head, _records(1))
    patient.trim("s", 4)
    patient.delete("s")
    patient.append("t", 0, _records(1))
    before = _keys(s3_server, patient)
    assert sum("!R" in key for key in before) == 6  # s: 4 batches + tombstone; t: 1
    hasty = S3Store(
        patient.bucket,
        patient.prefix,
        S3Options(retention=0, head_ttl=0),
        client=s3_server.client(),
    )
    assert hasty.sweep() > 0
    left = sorted(key for key in _keys(s3_server, patient) if "!R" in key)
    assert [int(key[-20:]) for key in left] == [0, 4, 0]  # s: first stub + tombstone; t: one
    with pytest.raises(StreamDeletedError):
        patient.append("s", 0, _records(1))
    with pytest.raises(StreamDeletedError):
        patient.append("s", 4, _records(1))
    assert patient.streams() == ["t"]


def test_an_older_floor_marker_is_removed_only_once_past_the_retention_period(
    s3_server: S3Server,
) -> None:
    """A reader that listed before a trim may still need the floor it saw: the markers
    below the newest floor stay for the retention period, then go; the newest stays."""
    patient = s3_server.store()  # default retention: an hour
    head = 0
    for _ in range(4):
        head = patient.append("s", head, _records(1))
    patient.trim("s", 2)
    patient.trim("s", 4)
    floors = sorted(key for key in _keys(s3_server, patient) if "!F" in key)
    assert [int(key[-20:]) for key in floors] == [1, 3], "within the period: both stay"
    hasty = S3Store(
        patient.bucket,
        patient.prefix,
        S3Options(retention=0, head_ttl=0),
        client=s3_server.client(),
    )
    hasty.sweep()
    floors = sorted(key for key in _keys(s3_server, patient) if "!F" in key)
    assert [int(key[-20:]) for key in floors] == [3], "past it: only the newest stays"
    assert [r.position for r in patient.read("s", 3)] == [4]


def test_delete_on_a_versioned_bucket_still_retires_the_name(s3_server: S3Server) -> None:
    client = s3_server.client()
    bucket = s3_server.new_bucket()
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    if s3_server.name == "rgw":
        # Ceph RGW 16 (Pacific) ignores If-None-Match on versioned buckets: the store
        # proves that at open and refuses, rather than appending without atomicity.
        with pytest.raises(StoreMisconfiguredError, match="versioned buckets"):
            S3Store(bucket, "v", S3Options(), client=client)
        return
    store = S3Store(bucket, "v", S3Options(shards=2, retention=0, head_ttl=0), client=client)
    store.append("s", 0, _records(3))
    store.append("s", 3, _records(2))
    store.delete("s")
    store.sweep()
    fresh = S3Store(bucket, "v", S3Options(), client=client)
    for expected in (0, 3, 5):
        with pytest.raises(StreamDeletedError):
            fresh.append("s", expected, _records(1))
    assert fresh.streams() == []


def test_a_delete_racing_an_append_retires_the_stream_at_its_final_head(
    s3_server: S3Server,
) -> None:
    store = s3_server.store()
    writer = s3_server.twin(store)
    writer.append("s", 0, _records(1))
    store.head("s")  # the deleter learns head 1 ...
    writer.append("s", 1, _records(1))  # ... and the writer moves it to 2 first
    store.delete("s")
    with pytest.raises(StreamDeletedError) as caught:
        writer.append("s", 2, _records(1))
    assert caught.value.head == 2


def test_missing_credentials_are_a_clear_error_not_a_botocore_one(
    moto_server: S3Server, monkeypatch: Any, tmp_path: Any
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreMisconfiguredError, match=r"NoCredentialsError.*no credentials"):
        S3Store(moto_server.new_bucket(), "p", S3Options(endpoint_url=moto_server.endpoint_url))


def test_a_writer_that_no_longer_trusts_its_head_is_refused_at_a_removed_key(
    s3_server: S3Server,
) -> None:
    hasty = s3_server.store(head_ttl=0, retention=0)
    stale = s3_server.twin(hasty)  # the same head_ttl=0: it checks before every append
    stale.append("s", 0, _records(2))  # it learns head 2 ...
    head = 2
    for _ in range(3):
        head = hasty.append("s", head, _records(2))  # ... others append R2, R4, R6 ...
    hasty.trim("s", 7)  # ... and trim, removing R2 and R4 at once (retention 0)
    assert not any(key.endswith("R" + "2".zfill(20)) for key in _keys(s3_server, hasty))
    with pytest.raises(ConflictError) as caught:
        stale.append("s", 2, _records(1, "late"))
    assert caught.value.actual == 8
    assert [r.position for r in hasty.read("s", 6)] == [7, 8]


class _RefusingClient:
    """A boto3-like client whose every call fails with one S3 error."""

    def __init__(self, code: str, status: int, retries: Any = None) -> None:
        retries = retries or {"total_max_attempts": 1}
        self.meta = type("Meta", (), {"config": Config(retries=retries)})()
        self.error = ClientError(
            {
                "Error": {"Code": code, "Message": "refused"},
                "ResponseMetadata": {"HTTPStatusCode": status},
            },
            "GetObject",
        )
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        def call(**_: Any) -> Any:
            self.calls += 1
            raise self.error

        return call


@pytest.mark.parametrize(
    ("code", "status", "remedy"),
    [
        ("AccessDenied", 403, "s3:PutObject"),
        ("InvalidAccessKeyId", 403, "credentials are wrong"),
        ("SignatureDoesNotMatch", 403, "credentials are wrong"),
        ("NoSuchBucket", 404, "create it"),
        ("Forbidden", 403, "s3:PutObject"),  # a 403 whatever its code says
        ("AccessDenied", 400, "s3:PutObject"),  # an AccessDenied whatever its status
        ("", 401, "credentials are wrong"),
        ("InvalidArgument", 400, "the request itself is refused: check the endpoint"),
    ],
)
def test_a_permanent_refusal_is_misconfigured_with_its_remedy_and_never_retried(
    code: str, status: int, remedy: str
) -> None:
    client = _RefusingClient(code, status)
    with pytest.raises(StoreMisconfiguredError, match=remedy) as caught:
        S3Store("some-bucket", "p", S3Options(attempts=4), client=client)
    assert not isinstance(caught.value, StoreUnavailableError), "permanent is not transient"
    assert client.calls == 1, "a permanent refusal is not retried"


@pytest.mark.parametrize(("retries", "accepted"), [(0, True), (1, False)])
def test_a_client_not_built_by_botocore_with_max_attempts_is_judged_by_it(
    retries: int, accepted: bool
) -> None:
    """botocore turns `max_attempts` (retries after the first) into `total_max_attempts`
    when it builds a client; a client built otherwise is judged by `max_attempts`."""
    client = _RefusingClient("NoSuchBucket", 404, retries={"max_attempts": retries})
    expected = StoreMisconfiguredError if accepted else InvalidArgumentError
    with pytest.raises(expected, match="create it" if accepted else "retries off"):
        S3Store("some-bucket", "p", S3Options(attempts=1), client=client)


def test_a_connection_fault_is_retried_then_unavailable() -> None:
    from botocore.exceptions import EndpointConnectionError

    client = _RefusingClient("", 0)
    client.error = EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    with pytest.raises(StoreUnavailableError, match="Could not connect") as caught:
        S3Store("some-bucket", "p", S3Options(attempts=3), client=client)
    assert not isinstance(caught.value, StoreMisconfiguredError)
    assert client.calls == 3, "retried"


def test_a_transient_fault_is_retried_then_unavailable() -> None:
    client = _RefusingClient("SlowDown", 503)
    with pytest.raises(StoreUnavailableError, match="SlowDown"):
        S3Store("some-bucket", "p", S3Options(attempts=3), client=client)
    assert client.calls == 3


def test_the_documented_option_defaults() -> None:
    options = S3Options()
    assert (options.addressing, options.shards, options.head_ttl) == ("auto", 8, 60.0)
    assert (options.retention, options.timeout, options.attempts, options.workers) == (
        3600.0,
        10.0,
        4,
        16,
    )


@pytest.mark.parametrize(
    ("endpoint_url", "addressing", "style"),
    [
        ("http://127.0.0.1:1", "auto", "path"),  # a custom endpoint: path-style
        (None, "auto", "auto"),  # AWS: botocore picks
        ("http://127.0.0.1:1", "virtual", "virtual"),
        (None, "path", "path"),
    ],
)
def test_the_client_addresses_the_bucket_as_configured(
    endpoint_url: str | None, addressing: str, style: str
) -> None:
    import boto3

    options = S3Options(endpoint_url=endpoint_url, region="us-east-1", addressing=addressing)
    session = boto3.session.Session(aws_access_key_id="k", aws_secret_access_key="s")
    client = _make_client(options, session)
    assert client.meta.config.s3["addressing_style"] == style


@pytest.mark.parametrize(("workers", "pool"), [(1, 10), (5, 10), (6, 12), (16, 32)])
def test_the_connection_pool_fits_the_parallel_reads(workers: int, pool: int) -> None:
    import boto3

    options = S3Options(region="us-east-1", workers=workers)
    session = boto3.session.Session(aws_access_key_id="k", aws_secret_access_key="s")
    client = _make_client(options, session)
    assert client.meta.config.max_pool_connections == pool


def test_an_unauthorized_request_is_permanent_and_described_with_its_message() -> None:
    from loom_store_s3._transport import _describe, classify

    unauthorized = ClientError(
        {
            "Error": {"Code": "Unexplained", "Message": "no"},
            "ResponseMetadata": {"HTTPStatusCode": 401},
        },
        "GetObject",
    )
    assert classify(unauthorized) == "permanent"
    assert _describe(unauthorized) == "Unexplained (HTTP 401): no"
    bare = ClientError({"Error": {"Code": "X"}, "ResponseMetadata": {"HTTPStatusCode": 500}}, "Get")
    assert _describe(bare) == "X (HTTP 500)"


def test_a_retried_request_is_logged_on_the_loom_s3_logger(caplog: Any) -> None:
    import logging

    client = _RefusingClient("SlowDown", 503)
    with caplog.at_level(logging.DEBUG, logger="loom.s3"), pytest.raises(StoreUnavailableError):
        S3Store("some-bucket", "p", S3Options(attempts=2), client=client)
    assert any("retrying" in record.getMessage() for record in caplog.records)
    assert {record.name for record in caplog.records} == {"loom.s3"}


def test_a_listing_follows_every_page(moto_server: S3Server) -> None:
    store = S3Store(moto_server.new_bucket(), "p", client=moto_server.client())
    for number in range(5):
        store._transport.put(f"p!pages/{number}", b"")
    pages = list(store._transport.pages("p!pages/", page_size=2))
    assert [item["Key"] for page in pages for item in page.get("Contents", [])] == [
        f"p!pages/{number}" for number in range(5)
    ]
    assert len(pages) == 3


def test_an_idle_timer_poll_costs_the_same_however_many_minutes_were_handled(
    moto_server: S3Server,
) -> None:
    from loom_kernel._coordination import TimerIndex
    from loom_kernel.testing import FakeClock

    client = moto_server.client()
    store = moto_server.store(client=client)
    clock = FakeClock(1_700_000_040.0)
    index = TimerIndex(store, clock)
    counter = RequestCounter(client)

    def idle_poll() -> dict[str, int]:
        counter.take()
        assert TimerIndex(store, clock).fire_due(clock.now, lambda _entry: True) == ([], [])
        return counter.take()

    index.fire_due(clock.now, lambda _entry: True)  # the floor's origin
    clock.advance(60)
    index.fire_due(clock.now, lambda _entry: True)
    before = idle_poll()
    for minute in range(120):  # two hours of minutes, each with a timer, handled
        index.add(f"run-{minute}", 0, clock.now + 1)
        clock.advance(60)
        index.fire_due(clock.now, lambda _entry: True)
    assert len(TimerIndex(store, clock).buckets()) == 0
    after = idle_poll()
    assert after == before, "handled minutes leave tombstones the poll never lists"


def test_a_reader_polling_at_its_known_head_pays_one_get(s3_server: S3Server) -> None:
    client = s3_server.client()
    writer = s3_server.store()
    reader = s3_server.twin(writer, client)
    counter = RequestCounter(client)
    assert reader.read("never/written") == []
    assert counter.take() == {"GetObject": 1}, "key 0 missing: the stream never existed"
    head = writer.append("polled", 0, _records(2))
    assert len(reader.read("polled")) == 2  # key 0 is there: a scan, which learns the head
    counter.take()
    assert reader.read("polled", head) == []
    assert counter.take() == {"GetObject": 1}
    writer.append("polled", head, _records(1, "new"))
    assert [r.payload for r in reader.read("polled", head)] == [b"new0"]
    writer.delete("polled")
    with pytest.raises(StreamDeletedError):
        reader.read("polled", head + 1)  # the tombstone sits at the known head's key


def test_a_reader_trusts_no_missing_key_past_the_retention_margin(moto_server: S3Server) -> None:
    client = moto_server.client()
    store = S3Store(
        moto_server.new_bucket(),
        "short",
        S3Options(endpoint_url=moto_server.endpoint_url, retention=1, head_ttl=0.5),
        client=client,
    )  # removal may take a batch a reader still counts on: the one-GET read is off
    head = store.append("s", 0, _records(2))
    counter = RequestCounter(client)
    assert store.read("s", head) == []
    assert counter.take().get("ListObjectsV2") == 1


def test_a_closed_store_refuses_reads_with_a_clear_error(moto_server: S3Server) -> None:
    store = moto_server.store()
    head = 0
    for _ in range(3):
        head = store.append("s", head, _records(1))
    store.close()
    with pytest.raises(StoreUnavailableError, match="closed"):
        store.read("s")
    with pytest.raises(RuntimeError, match="shutdown"):  # its read workers are stopped
        store._pool.submit(print)


def test_a_deleted_stream_trimmed_to_its_head_leaves_no_floor_marker_after_a_sweep(
    moto_server: S3Server,
) -> None:
    patient = moto_server.store()
    head = 0
    for _ in range(4):
        head = patient.append("s", head, _records(1))
    patient.trim("s", head + 1)  # everything: the floor marker sits at the head
    patient.delete("s")
    assert [key for key in _keys(moto_server, patient) if "!F" in key]
    hasty = S3Store(
        patient.bucket,
        patient.prefix,
        S3Options(retention=0, head_ttl=0),
        client=moto_server.client(),
    )
    hasty.sweep()
    assert not [key for key in _keys(moto_server, patient) if "!F" in key]


@pytest.mark.parametrize("shards", [1, 256])
def test_a_store_of_the_fewest_or_most_shards_opens_again(
    moto_server: S3Server, shards: int
) -> None:
    store = moto_server.store(shards=shards)
    store.append("s", 0, _records(1))
    again = moto_server.twin(store)
    assert [r.payload for r in again.read("s")] == [b"r0"]
    assert again._layout.shards == shards


def test_a_trim_beyond_the_head_is_refused(moto_server: S3Server) -> None:
    from loom_kernel.spi import InvalidArgumentError, NewRecord

    client = moto_server.client(retries={"max_attempts": 0})
    store = S3Store(moto_server.new_bucket(), "p", client=client)
    store.append("s", 0, [NewRecord("k", b"r", 1.0)])
    with pytest.raises(InvalidArgumentError, match="its head is 1"):
        store.trim("s", 5)
    assert [record.payload for record in store.read("s")] == [b"r"], "nothing trimmed"
    store.trim("s", 2)  # everything: the most a trim may drop
    assert store.read("s", 1) == []


def test_a_store_of_one_shard_lists_and_reads_every_stream(s3_server: S3Server) -> None:
    store = s3_server.store(shards=1)
    for name in ("a", "b/c", "z"):
        store.append(name, 0, _records(2, name))
    assert store.streams() == ["a", "b/c", "z"]
    fresh = s3_server.twin(store)
    assert [r.payload for r in fresh.read("b/c")] == [b"b/c0", b"b/c1"]
    assert fresh.streams("b/") == ["b/c"]


def test_a_retention_too_short_for_cached_heads_and_signatures_is_warned_of(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="loom.s3"):
        s3_server.store(retention=3600, head_ttl=5)
    assert "does not exceed" not in caplog.text, "an hour is safe"
    with caplog.at_level("WARNING", logger="loom.s3"):
        s3_server.store(retention=60, head_ttl=5)
    assert "retention 60 s does not exceed head_ttl 5 s plus the 15-minute signature" in (
        caplog.text
    )


class _ShiftedClock:
    """The `time` module as the store sees it, moved on by `offset` seconds."""

    def __init__(self) -> None:
        import time

        self._time = time
        self.offset = 0.0

    def monotonic(self) -> float:
        return self._time.monotonic() + self.offset

    def time(self) -> float:
        return self._time.time() + self.offset


def test_a_reader_polling_at_its_known_head_for_long_keeps_paying_one_get(
    moto_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each poll that finds the next key missing learns the head again, so a reader that
    polls more often than the retention margin never falls back to a listing."""
    clock = _ShiftedClock()
    monkeypatch.setattr("loom_store_s3._store.time", clock)
    client = moto_server.client()
    store = S3Store(
        moto_server.new_bucket(),
        "poll",
        S3Options(endpoint_url=moto_server.endpoint_url, retention=1000, head_ttl=0),
        client=client,
    )  # the margin: 1000 - 0 - 900 = 100 s
    head = store.append("s", 0, _records(2))
    counter = RequestCounter(client)
    for _ in range(4):  # 240 s in all, 60 s between polls
        assert store.read("s", head) == []
        assert counter.take() == {"GetObject": 1}
        clock.offset += 60


def test_a_delete_past_the_retention_leaves_the_first_batch_and_the_tombstone_only(
    s3_server: S3Server,
) -> None:
    store = s3_server.store(head_ttl=0, retention=0)
    head = 0
    for _ in range(3):
        head = store.append("s", head, _records(2))
    store.delete("s")
    batches = sorted(int(key[-20:]) for key in _keys(s3_server, store) if "!R" in key)
    assert batches == [0, 6], "the first (a stub) and the tombstone at the head"
    with pytest.raises(StreamDeletedError):
        store.append("s", 6, _records(1))


def test_a_last_batch_removed_between_the_listing_and_its_read_is_listed_again(
    moto_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A concurrent sweep removed the last batch the listing named: the stream is
    listed again, not taken as empty."""
    store = moto_server.store(head_ttl=0)
    store.append("s", 0, _records(2))
    store.append("s", 2, _records(1))
    original = store._get_batch
    vanished: list[str] = []

    def first_read_misses(key: str) -> Any:
        if not vanished:
            vanished.append(key)
            return None
        return original(key)

    monkeypatch.setattr(store, "_get_batch", first_read_misses)
    assert store.head("s") == 3
    assert vanished, "the first read missed"


def test_large_payloads_in_the_batches_without_blobs(moto_server: Any) -> None:
    """With blobs=none a large payload is kept in its batch object, byte for byte."""
    from loom_kernel.spi import NewRecord

    store = moto_server.store(blobs="none")
    assert store.blobs is None
    payload = bytes(range(256)) * 1200
    store.append("big", 0, [NewRecord("k", payload, 1.0), NewRecord("k", b"small", 2.0)])
    assert [r.payload for r in store.read("big")] == [payload, b"small"]
    store.close()


def test_the_bucket_blob_store_lists_trashes_restores_and_purges(moto_server: Any) -> None:
    """The blobs of a store on S3 (beside its journals, under the store's prefix): what
    the collector walks (`entries`, `trashed`) and what it does to a blob."""
    import hashlib

    store = moto_server.store()
    blobs = store.blobs
    assert blobs is not None
    key = "sha256:" + hashlib.sha256(b"a blob").hexdigest()
    blobs.put(key, b"a blob")
    assert [name for name, _at in blobs.entries()] == [key]
    blobs.discard(key)
    assert list(blobs.entries()) == []
    assert [name for name, _at in blobs.trashed()] == [key]
    assert blobs.get(key) == b"a blob", "a read brings a trashed blob back"
    assert ([n for n, _ in blobs.entries()], list(blobs.trashed())) == ([key], [])
    blobs.discard(key)
    assert blobs.restore(key)
    blobs.discard(key)
    blobs.purge(key)
    assert (list(blobs.entries()), list(blobs.trashed())) == ([], [])
    assert not blobs.restore(key), "nothing is left to bring back"
