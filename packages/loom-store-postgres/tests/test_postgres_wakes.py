"""LISTEN/NOTIFY: a worker parked with nothing to do wakes as work lands from another
process's engine, long before its next poll; a lost notification (the listening
connection killed) costs nothing but the poll it falls back to."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from loom_kernel import Context, Engine, Worker, flow
from loom_kernel.spi import NewRecord, SupportsWakeups
from loom_store_postgres import PostgresStore
from loom_store_postgres.testing import PostgresServer

IDLE_POLL = 60.0


@flow(name="wakes.wait_for_word")
def wait_for_word(ctx: Context, _input: Any) -> Any:
    return ctx.receive("word")


@flow(name="wakes.hello")
def hello(ctx: Context, name: str) -> Any:
    return f"hello {name}"


def _counting(store: PostgresStore) -> tuple[threading.Event, Any]:
    woken = threading.Event()
    return woken, store.subscribe_wakes(woken.set)


def test_an_append_under_a_wake_prefix_wakes_a_subscriber_of_another_instance(
    postgres_server: PostgresServer,
) -> None:
    listening = postgres_server.store()
    assert isinstance(listening, SupportsWakeups)
    writer = PostgresStore(listening.conninfo, listening.options)
    woken, unsubscribe = _counting(listening)
    writer.append("ex/quiet", 0, [NewRecord("k", b"{}", 1.0)])  # no work for a worker
    assert not woken.wait(1.0)
    writer.append("runs/open/07", 0, [NewRecord("k", b"{}", 1.0)])
    assert woken.wait(5.0)
    unsubscribe()
    woken.clear()
    writer.append("queues/q/0", 0, [NewRecord("k", b"{}", 1.0)])
    assert not woken.wait(1.0), "woken after unsubscribing"
    writer.close()
    listening.close()


def test_a_store_with_notify_off_sends_and_hears_nothing(postgres_server: PostgresServer) -> None:
    store = postgres_server.store(notify="off")
    woken, _unsubscribe = _counting(store)
    store.append("runs/open/01", 0, [NewRecord("k", b"{}", 1.0)])
    assert not woken.wait(1.0)
    store.close()


def test_a_killed_listening_connection_listens_again_and_wakes_for_what_it_missed(
    postgres_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    store = postgres_server.store()
    woken, _unsubscribe = _counting(store)
    with caplog.at_level("WARNING", logger="loom"):
        with psycopg.connect(store.conninfo, autocommit=True) as admin:
            killed = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN%%'"
            ).fetchall()
        assert killed, "no listening connection found"
        assert woken.wait(10.0), "no wake after listening again"
    assert "failed (" in caplog.text
    assert "polling until it listens again" in caplog.text
    woken.clear()
    store.append("timers/000000000001", 0, [NewRecord("k", b"{}", 1.0)])
    assert woken.wait(5.0)
    store.close()


class PollTimes:
    """A poller that notes when each of the worker's polls began."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.polled = threading.Event()

    def __call__(self, _engine: Engine) -> Any:
        def poll() -> None:
            self.times.append(time.monotonic())
            self.polled.set()

        return poll

    def idle_for(self, interval: float) -> None:
        """Wait until the worker polls no more often than every `interval` seconds (an
        idle worker's pause doubles, up to its idle_poll), and for the poll just after."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.polled.clear()
            assert self.polled.wait(30)
            if len(self.times) >= 2 and self.times[-1] - self.times[-2] >= interval:
                return
        raise AssertionError("the worker never idled")

    def first_after(self, moment: float) -> float:
        """When the first poll after `moment` began (waiting for it to be noted: the
        run it drove may end before the worker calls its pollers)."""
        deadline = time.monotonic() + 30
        while not (later := [t for t in self.times if t > moment]):
            assert time.monotonic() < deadline, "no poll after the wake"
            self.polled.clear()
            self.polled.wait(0.1)
        return later[0]


def test_a_parked_receive_wakes_on_a_send_from_another_process_without_a_poll(
    postgres_server: PostgresServer,
) -> None:
    """The send, from a second engine on another store instance (another process, as
    far as the server knows), comes just after one of an idle worker's polls; its
    nudge's NOTIFY has the worker poll again long before its pause ends (a pause at
    least as long as the last: it doubles while idle)."""
    url = postgres_server.store_url()
    worker_store = PostgresStore(*_opened(url))
    sender_store = PostgresStore(*_opened(url))
    flows = [wait_for_word, hello]
    sender = Engine(sender_store, flows, listeners=[])
    polls = PollTimes()
    worker = Worker(Engine(worker_store, flows, listeners=[]), idle_poll=IDLE_POLL, pollers=[polls])
    with worker:
        sender.start("wakes.wait_for_word", None, key="parked")
        polls.idle_for(1.6)
        last, pause = polls.times[-1], polls.times[-1] - polls.times[-2]
        sender.send("parked", "now", topic="word", drive=False)
        assert sender.handle("parked").result(timeout=30) == "now"
        woke = polls.first_after(last)
        assert woke - last < pause / 2, (woke - last, pause)
        # A run enqueued by the other engine (no worker of its own) is taken so too.
        polls.idle_for(1.6)
        last, pause = polls.times[-1], polls.times[-1] - polls.times[-2]
        assert sender.enqueue("wakes.hello", "there", key="h").result(timeout=30) == ("hello there")
        woke = polls.first_after(last)
        assert woke - last < pause / 2, (woke - last, pause)
    sender_store.close()
    worker_store.close()


def _opened(url: str) -> tuple[str, Any]:
    from loom_store_postgres._options import parse_postgres_url

    return parse_postgres_url(url)


def test_closing_a_store_stops_its_listening_thread_and_connection(
    postgres_server: PostgresServer,
) -> None:
    store = postgres_server.store()
    store.subscribe_wakes(lambda: None)
    name = f"loom-listen-{store._channel}"
    assert any(thread.name == name for thread in threading.enumerate())
    store.close()
    assert not any(thread.name == name for thread in threading.enumerate())
    with psycopg.connect(postgres_server.url) as admin:
        listening = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query = %s",
            (f'LISTEN "{store._channel}"',),
        ).fetchone()
    assert listening == (0,)
