"""Fault injection through botocore's event hooks: every failure ends exactly once or not at all.

Each case checks three things: what the caller got (success, ConflictError or
StoreUnavailableError), that the journal holds the batch once or not at all, and
that a later append at the right head works.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError
from loom_kernel.spi import ConflictError, NewRecord, StoreUnavailableError
from loom_store_s3 import S3Store
from loom_store_s3.testing import S3Server


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any) -> Any:
        yield self._body


def _error(status: int, code: str) -> AWSResponse:
    body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
    return AWSResponse("http://injected", status, {"Content-Type": "application/xml"}, _Raw(body))


def _records(tag: str, count: int = 1) -> list[NewRecord]:
    return [
        NewRecord("test.fault", f"{tag}{index}".encode(), 1.0 + index) for index in range(count)
    ]


class _Injector:
    """Hooks on one client: fail the next `times` conditional PUTs in the given way."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.before: Callable[[], AWSResponse | None] | None = None
        self.after: Callable[[], None] | None = None
        self.times = 0
        self.seen = 0
        client.meta.events.register("before-send.s3.PutObject", self._before_send)
        client.meta.events.register("after-call.s3.PutObject", self._after_call)

    def _active(self, request: Any) -> bool:
        return self.times > 0 and "If-None-Match" in request.headers

    def _before_send(self, request: Any, **_: Any) -> AWSResponse | None:
        self.seen += 1
        if self.before is not None and self._active(request):
            self.times -= 1
            return self.before()
        return None

    def _after_call(self, http_response: Any, **_: Any) -> None:
        if self.after is not None and self.times > 0 and http_response.status_code == 200:
            self.times -= 1
            self.after()


@pytest.fixture
def faulty(s3_server: S3Server) -> tuple[S3Store, _Injector, S3Server]:
    client = s3_server.client()
    store = s3_server.store(client=client)
    store.append("s", 0, _records("base", 2))
    return store, _Injector(client), s3_server


def _journal(store: S3Store) -> list[bytes]:
    return [record.payload for record in store.read("s")]


#: Refusals that do not say whether the write landed: the store must find out.
AMBIGUOUS_REFUSALS = [
    (409, "ConditionalRequestConflict"),
    (500, "InternalError"),
    (503, "SlowDown"),
]


def _raise_read_timeout() -> None:
    raise ReadTimeoutError(endpoint_url="http://injected")


@pytest.mark.parametrize(("status", "code"), AMBIGUOUS_REFUSALS)
def test_an_ambiguous_refusal_that_did_not_land_is_sent_again(
    faulty: tuple[S3Store, _Injector, S3Server], status: int, code: str
) -> None:
    store, injector, _ = faulty
    injector.before, injector.times = (lambda: _error(status, code)), 1
    assert store.append("s", 2, _records("new")) == 3
    assert _journal(store) == [b"base0", b"base1", b"new0"]


@pytest.mark.parametrize(("status", "code"), AMBIGUOUS_REFUSALS)
def test_a_lasting_outage_is_unavailable_and_writes_nothing(
    faulty: tuple[S3Store, _Injector, S3Server], status: int, code: str
) -> None:
    store, injector, _ = faulty
    injector.before, injector.times = (lambda: _error(status, code)), 100
    with pytest.raises(StoreUnavailableError):
        store.append("s", 2, _records("lost"))
    injector.times = 0
    assert _journal(store) == [b"base0", b"base1"]
    assert store.append("s", 2, _records("retry")) == 3


def test_a_timeout_before_sending_is_sent_again(
    faulty: tuple[S3Store, _Injector, S3Server],
) -> None:
    store, injector, _ = faulty

    def refuse() -> AWSResponse:
        raise ConnectTimeoutError(endpoint_url="http://injected")

    injector.before, injector.times = refuse, 1
    assert store.append("s", 2, _records("new", 3)) == 5
    assert _journal(store) == [b"base0", b"base1", b"new0", b"new1", b"new2"]


@pytest.mark.parametrize("times", [1, 2])
def test_a_timeout_after_the_write_landed_is_success_not_a_duplicate(
    faulty: tuple[S3Store, _Injector, S3Server], times: int
) -> None:
    store, injector, _ = faulty
    injector.after, injector.times = _raise_read_timeout, times
    assert store.append("s", 2, _records("new", 2)) == 4
    assert _journal(store) == [b"base0", b"base1", b"new0", b"new1"]
    assert store.append("s", 4, _records("next")) == 5


def test_a_409_after_the_write_landed_is_success(
    faulty: tuple[S3Store, _Injector, S3Server],
) -> None:
    store, injector, _ = faulty

    def conflict_after_landing() -> None:
        from botocore.exceptions import ClientError

        raise ClientError(
            {
                "Error": {"Code": "ConditionalRequestConflict", "Message": "injected"},
                "ResponseMetadata": {"HTTPStatusCode": 409},
            },
            "PutObject",
        )

    injector.after, injector.times = conflict_after_landing, 1
    assert store.append("s", 2, _records("new")) == 3
    assert _journal(store) == [b"base0", b"base1", b"new0"]


def test_a_412_from_a_real_race_is_a_conflict_naming_the_winners_head(
    faulty: tuple[S3Store, _Injector, S3Server],
) -> None:
    store, injector, server = faulty
    rival = server.twin(store)

    def rival_wins_first() -> AWSResponse | None:
        rival.append("s", 2, _records("rival", 2))
        return None  # then our request goes out and meets the rival's object

    injector.before, injector.times = rival_wins_first, 1
    with pytest.raises(ConflictError) as caught:
        store.append("s", 2, _records("ours"))
    assert caught.value.actual == 4
    assert _journal(store) == [b"base0", b"base1", b"rival0", b"rival1"]


def test_a_timeout_after_landing_with_the_check_failing_too_is_unavailable_and_lands_once(
    faulty: tuple[S3Store, _Injector, S3Server],
) -> None:
    store, injector, _ = faulty
    client = injector.client
    outage = {"on": False}

    def fail_reads(**_: Any) -> AWSResponse | None:
        return _error(503, "SlowDown") if outage["on"] else None

    client.meta.events.register("before-send.s3.HeadObject", fail_reads)
    client.meta.events.register("before-send.s3.PutObject", fail_reads)

    def land_then_lose() -> None:
        outage["on"] = True
        _raise_read_timeout()

    injector.after, injector.times = land_then_lose, 1
    with pytest.raises(StoreUnavailableError):
        store.append("s", 2, _records("maybe"))
    outage["on"] = False
    # "may have landed": the caller re-reads and finds it exactly once.
    assert _journal(store) == [b"base0", b"base1", b"maybe0"]
    with pytest.raises(ConflictError):
        store.append("s", 2, _records("again"))


@pytest.mark.parametrize("call", ["append", "read"])
def test_a_lasting_outage_backs_off_longer_between_attempts(
    faulty: tuple[S3Store, _Injector, S3Server], monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    import types

    from loom_store_s3 import _transport

    store, injector, _ = faulty
    cold = S3Store(store.bucket, store.prefix, store.options, client=store._transport.client)
    pauses: list[float] = []
    monkeypatch.setattr(_transport, "time", types.SimpleNamespace(sleep=pauses.append))
    if call == "append":
        injector.before, injector.times = (lambda: _error(503, "SlowDown")), 100
        with pytest.raises(StoreUnavailableError):
            store.append("s", 2, _records("lost"))
    else:  # a GET or a LIST, each retried on its own
        events = store._transport.client.meta.events
        events.register_first("before-send.s3", lambda **_: _error(503, "SlowDown"))
        with pytest.raises(StoreUnavailableError):
            cold.read("s")
    attempts = store._transport.attempts
    assert len(pauses) >= attempts - 1, "a pause between each two attempts"
    for attempt, pause in enumerate(pauses[: attempts - 1]):
        cap = min(1.0, 0.02 * 2**attempt)
        assert cap * 0.5 <= pause <= cap * 1.5, f"attempt {attempt} paused {pause}"


def test_a_layout_descriptor_the_server_lost_is_unavailable_not_read(s3_server: S3Server) -> None:
    """The write that creates a new store's descriptor is acknowledged but not there to
    read back (a server losing writes): opening says so, and reads nothing into it."""
    client = s3_server.client()

    def lose_the_descriptor(request: Any, **_: Any) -> AWSResponse | None:
        if "layout.json" in request.url:
            return AWSResponse("http://injected", 200, {}, _Raw(b""))
        return None

    client.meta.events.register("before-send.s3.PutObject", lose_the_descriptor)
    with pytest.raises(StoreUnavailableError, match="cannot create the layout descriptor"):
        s3_server.store(client=client)


def test_an_injected_lost_reply_really_takes_the_confirmation_path(
    faulty: tuple[S3Store, _Injector, S3Server], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Fault.LOST_REPLY`: the write lands, its reply is dropped, and the store learns
    the outcome by reading the commit id back, as for a real lost reply."""
    from loom_kernel.spi import Fault

    store, _, _ = faulty
    transport = store._transport
    commit_of = transport.commit_of
    confirmations: list[str] = []

    def counted(key: str) -> Any:
        confirmations.append(key)
        return commit_of(key)

    monkeypatch.setattr(transport, "commit_of", counted)
    store.inject_fault(Fault.LOST_REPLY)
    assert store.append("s", 2, _records("new")) == 3
    assert len(confirmations) == 1, "the landed write was confirmed by its commit id"
    assert _journal(store) == [b"base0", b"base1", b"new0"]
