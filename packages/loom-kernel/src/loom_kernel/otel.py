"""OpenTelemetry traces of Loom's drives and steps (the `otel` extra: opentelemetry-api).

    from loom_kernel.otel import instrument

    instrument(engine)  # the global tracer provider, or pass tracer_provider=

From then on every drive of a run is a span (`drive <flow>`: `loom.execution.id`,
`loom.flow`, `loom.execution.status` when it parks or ends), and every attempt of a
step that runs is a span under it (`step <name>`: `loom.step.index`,
`loom.step.name`, `loom.step.attempt`, `loom.step.outcome`; the exception of a failed
attempt recorded). A replayed step runs nothing and makes no span. A start journals
the caller's trace context (`traceparent`), and every drive of the run, by whichever
worker, takeovers included, is a span of that trace.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from loom_kernel._engine import Engine, parts_of

__all__ = ["instrument", "uninstrument"]

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
