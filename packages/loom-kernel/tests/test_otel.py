"""`loom_kernel.otel` (the `otel` extra), with the SDK's in-memory exporter: a span per
drive and per step attempt that runs, with the run's id, flow, step index, attempt
and outcome; replayed steps make none; a run's drives, by any engine, continue the
trace of the caller that started it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from loom_kernel import Context, Engine, MemoryStore, RetryPolicy, StoreUnavailableError, flow
from loom_kernel.otel import instrument, uninstrument
from loom_kernel.spi import NewRecord
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

tries = {"flaky": 0}


def _flaky() -> str:
    tries["flaky"] += 1
    if tries["flaky"] == 1:
        raise ConnectionError("try again")
    return "ok"


@flow(name="otel.order", version="1")
def order(ctx: Context, _input: Any) -> Any:
    ctx.step("quote", lambda: 42)
    ctx.step("charge", _flaky, retry=RetryPolicy(attempts=3, backoff=0))
    approved = ctx.suspend("approve")
    return ctx.step("ship", lambda: approved)


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    tries["flaky"] = 0
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _named(finished: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return [span for span in finished if span.name.startswith(prefix)]


def test_a_drive_and_each_step_attempt_that_runs_is_a_span(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    engine = Engine(MemoryStore(), [order], listeners=[])
    instrument(engine, provider)
    engine.start("otel.order", key="o-1")
    finished = exporter.get_finished_spans()
    [drive] = _named(finished, "drive ")
    assert drive.name == "drive otel.order"
    assert drive.attributes is not None
    assert drive.attributes["loom.execution.id"] == "o-1"
    assert drive.attributes["loom.execution.status"] == "suspended"
    steps = _named(finished, "step ")
    seen = [
        (
            s.attributes["loom.step.name"],
            s.attributes["loom.step.attempt"],
            s.attributes["loom.step.outcome"],
        )
        for s in steps
        if s.attributes is not None
    ]
    assert seen == [("quote", 1, "ok"), ("charge", 1, "error"), ("charge", 2, "ok")]
    assert all(s.parent is not None and s.parent.span_id == drive.context.span_id for s in steps)
    failed = steps[1]
    assert [event.name for event in failed.events] == ["exception"]

    exporter.clear()
    engine.resume("o-1", "yes")
    finished = exporter.get_finished_spans()
    assert len(_named(finished, "drive ")) == 1
    assert [s.name for s in _named(finished, "step ")] == ["step ship"], "replayed: no span"


def test_every_drive_of_a_run_continues_its_starters_trace(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    store = MemoryStore()
    web = Engine(store, [order], listeners=[])
    instrument(web, provider)
    with provider.get_tracer("app").start_as_current_span("POST /orders") as request:
        web.start("otel.order", key="o-2")
    worker = Engine(store, [order], listeners=[])  # another process, later
    instrument(worker, provider)
    worker.resume("o-2", "yes")
    drives = _named(exporter.get_finished_spans(), "drive ")
    assert len(drives) == 2
    trace_id = request.get_span_context().trace_id
    assert all(span.context.trace_id == trace_id for span in drives), "one trace"
    assert all(span.parent is not None for span in drives)
    assert b'"trace":"00-' in store.read("ex/o-2")[0].payload, "journaled with the start"
    assert worker.state("o-2").trace is not None


def test_an_engine_not_instrumented_or_no_longer_makes_no_span(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    engine = Engine(MemoryStore(), [order], listeners=[])
    engine.start("otel.order", key="plain")
    instrument(engine, provider)
    uninstrument(engine)
    engine.start("otel.order", key="after")
    assert exporter.get_finished_spans() == ()
    assert engine.state("plain").trace is None


def _points(reader: Any) -> dict[str, list[tuple[dict[str, Any], float]]]:
    found: dict[str, list[tuple[dict[str, Any], float]]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    found.setdefault(metric.name, []).append((dict(point.attributes), point.value))
    return found


def test_the_engine_and_its_worker_report_their_counts_as_metrics() -> None:
    from loom_kernel import Queue, Worker
    from loom_kernel.otel import instrument_metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    attempts = {"n": 0}

    def once_flaky() -> int:
        attempts["n"] += 1
        if attempts["n"] == 1:
            raise ConnectionError("try again")
        return 1

    @flow(name="otel.counted")
    def counted(ctx: Context, _input: Any) -> Any:
        ctx.step("first", once_flaky, retry=RetryPolicy(attempts=3, backoff=0))
        return ctx.step("second", lambda: 2)

    engine = Engine(MemoryStore(), [counted], listeners=[], queues=[Queue("bulk", concurrency=1)])
    worker = Worker(engine, idle_poll=0.02)
    instrument_metrics(engine, worker, meter_provider=provider)
    engine.start("otel.counted", None, key="m1")
    engine.get("m1")  # a read replays nothing and runs no step
    engine.enqueue("otel.counted", None, key="queued", queue="bulk")  # no worker yet: it waits
    found = _points(reader)
    me = {"loom.worker.id": engine.worker_id}
    assert found["loom.steps"] == [(me, 3)], "two attempts of the flaky step, one other"
    assert found["loom.takeovers"] == [(me, 0)]
    assert found["loom.worker.drives"] == [(me, 0)]
    assert found["loom.queue.waiting"] == [({**me, "loom.queue": "bulk"}, 1)]
    with worker:
        assert engine.handle("queued").result(timeout=10) == 2
    found = _points(reader)
    assert found["loom.worker.drives"][0][1] >= 1
    assert found["loom.queue.waiting"] == [({**me, "loom.queue": "bulk"}, 0)]
    assert found["loom.steps"] == [(me, 5)]
    assert found["loom.takeovers"] == [(me, 0)], "a queued run has no owner to take from"


def test_a_drive_that_raises_ends_its_span_with_the_error(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    class StepsFail(MemoryStore):
        def append(
            self, stream: str, expected: int, records: Sequence[NewRecord], *, sync: bool = True
        ) -> int:
            if any(record.kind == "STEP_COMPLETED" for record in records):
                raise StoreUnavailableError("the disk is gone")
            return super().append(stream, expected, records, sync=sync)

    provider, exporter = spans
    engine = Engine(StepsFail(), [order], listeners=[])
    instrument(engine, provider)
    with pytest.raises(StoreUnavailableError):
        engine.start("otel.order", key="o-3")
    [drive] = _named(exporter.get_finished_spans(), "drive ")
    assert [event.name for event in drive.events] == ["exception"]
    assert drive.status.status_code is StatusCode.ERROR
    assert drive.status.description == "StoreUnavailableError: the disk is gone"
