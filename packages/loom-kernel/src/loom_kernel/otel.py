"""OpenTelemetry traces and metrics of Loom's drives and steps (the `otel` extra:
opentelemetry-api).

    from loom_kernel.otel import instrument, instrument_metrics

    instrument(engine)  # the global tracer provider, or pass tracer_provider=
    instrument_metrics(engine, worker)  # the global meter provider, or meter_provider=

From then on every drive of a run is a span (`drive <flow>`: `loom.execution.id`,
`loom.flow`, `loom.execution.status` when it parks or ends), and every attempt of a
step that runs is a span under it (`step <name>`: `loom.step.index`,
`loom.step.name`, `loom.step.attempt`, `loom.step.outcome`; the exception of a failed
attempt recorded). A replayed step runs nothing and makes no span. A start journals
the caller's trace context (`traceparent`), and every drive of the run, by whichever
worker, takeovers included, is a span of that trace.

`instrument_metrics` reports, at each collection: `loom.steps` (step attempts run by
the engine's drives), `loom.takeovers` (runs it claimed from a worker that stopped
renewing), and with a worker `loom.worker.visits`, `loom.worker.drives`,
`loom.worker.timers_fired`, `loom.worker.failures` (counters) and
`loom.worker.in_flight` (its busy slots); and `loom.queue.waiting` and
`loom.queue.active` for each of the engine's queues (gauges, attribute `loom.queue`:
a collection reads each queue's partitions once). Every instrument has the attribute
`loom.worker.id`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
from opentelemetry.trace import Span, Status, StatusCode, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from loom_kernel._core import LoomError
from loom_kernel._engine import Engine, parts_of
from loom_kernel._hosting._worker import Worker

__all__ = ["instrument", "instrument_metrics", "uninstrument"]

_PROPAGATOR = TraceContextTextMapPropagator()


def instrument(engine: Engine, tracer_provider: TracerProvider | None = None) -> None:
    """Trace the engine's drives and steps from now on (see the module's docstring).

    Args:
        engine: the engine.
        tracer_provider: where the spans go (default: OpenTelemetry's global one).
    """
    tracer = trace.get_tracer("loom_kernel", tracer_provider=tracer_provider)
    parts_of(engine).driver.trace_with(_Tracing(tracer))


def uninstrument(engine: Engine) -> None:
    """Stop tracing the engine's drives (those that begin from now on)."""
    parts_of(engine).driver.trace_with(None)


def instrument_metrics(
    engine: Engine, worker: Worker | None = None, meter_provider: MeterProvider | None = None
) -> None:
    """Report the engine's (and its worker's) counts as metrics (see the module's
    docstring). Observable instruments: the counts are read at each collection, so
    nothing is done per step but a counter bump the engine makes anyway.

    Args:
        engine: the engine.
        worker: its worker, if one runs here (its visits, drives, timers, failures).
        meter_provider: where the metrics go (default: OpenTelemetry's global one).
    """
    meter = metrics.get_meter("loom_kernel", meter_provider=meter_provider)
    counters = parts_of(engine).driver.counters
    labels = {"loom.worker.id": engine.worker_id}

    def reading(read: Callable[[], float]) -> Callable[[CallbackOptions], list[Observation]]:
        return lambda _options: [Observation(read(), labels)]

    meter.create_observable_counter(
        "loom.steps",
        [reading(lambda: counters.steps)],
        unit="{step}",
        description="step attempts run (replayed steps are not)",
    )
    meter.create_observable_counter(
        "loom.takeovers",
        [reading(lambda: counters.takeovers)],
        unit="{run}",
        description="runs claimed from a worker that stopped renewing its lease",
    )
    if worker is not None:
        stats = worker.stats
        for name, read, what in (
            ("loom.worker.visits", lambda: stats.visited, "runs looked at"),
            ("loom.worker.drives", lambda: stats.driven, "drives made, counted as they end"),
            ("loom.worker.timers_fired", lambda: stats.timers, "timers fired"),
            (
                "loom.worker.failures",
                lambda: stats.failures,
                "polls, visits and firings that raised",
            ),
        ):
            meter.create_observable_counter(name, [reading(read)], description=what)
        meter.create_observable_gauge(
            "loom.worker.in_flight",
            [reading(lambda: stats.in_flight)],
            description="slots busy now",
        )
    queues = sorted(parts_of(engine).enqueueing.book.queues)
    if queues:
        meter.create_observable_gauge(
            "loom.queue.waiting",
            [_queue_reading(engine, queues, "waiting", labels)],
            unit="{run}",
            description="runs waiting on the queue",
        )
        meter.create_observable_gauge(
            "loom.queue.active",
            [_queue_reading(engine, queues, "active", labels)],
            unit="{run}",
            description="runs of the queue being driven",
        )


def _queue_reading(
    engine: Engine, queues: list[str], which: str, labels: dict[str, str]
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def read(_options: CallbackOptions) -> Iterable[Observation]:
        for name in queues:
            try:
                view = engine.queue(name)
            except LoomError:
                continue  # unreadable now: no observation this time, never a wrong one
            yield Observation(len(getattr(view, which)), {**labels, "loom.queue": name})

    return read


class _Tracing:
    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def current(self) -> str | None:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return carrier.get("traceparent")

    def drive(self, execution_id: str, flow: str, parent: str | None) -> _Drive:
        context = None if parent is None else _PROPAGATOR.extract({"traceparent": parent})
        span = self._tracer.start_span(
            f"drive {flow}",
            context=context,
            attributes={"loom.execution.id": execution_id, "loom.flow": flow},
        )
        return _Drive(self._tracer, span, execution_id, flow)


class _Drive:
    def __init__(self, tracer: trace.Tracer, span: Span, execution_id: str, flow: str) -> None:
        self._tracer, self._span = tracer, span
        self._execution_id, self._flow = execution_id, flow

    @contextmanager
    def step(self, index: int, name: str, attempt: int) -> Iterator[Any]:
        attributes: dict[str, str | int] = {
            "loom.execution.id": self._execution_id,
            "loom.flow": self._flow,
            "loom.step.index": index,
            "loom.step.name": name,
            "loom.step.attempt": attempt,
        }
        span = self._tracer.start_span(
            f"step {name}", context=trace.set_span_in_context(self._span), attributes=attributes
        )
        with trace.use_span(span, end_on_exit=True, record_exception=False):
            try:
                yield span
            except BaseException as exc:
                span.set_attribute("loom.step.outcome", "error")
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
                raise
            span.set_attribute("loom.step.outcome", "ok")

    def end(self, status: str, error: BaseException | None = None) -> None:
        self._span.set_attribute("loom.execution.status", status)
        if error is not None:
            self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self._span.end()
