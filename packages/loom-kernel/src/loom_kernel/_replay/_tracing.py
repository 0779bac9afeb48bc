"""What a drive tells a tracer (the `otel` extra's, `loom_kernel.otel`): each drive of a
run, and each attempt of a step that runs (a replayed step runs nothing and tells
nothing). The kernel knows only these protocols; with no tracer, a drive costs one
`None` check a step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

__all__ = ["DriveSpan", "Tracing"]


class DriveSpan(Protocol):
    """One drive of one run, open until `end`."""

    def step(self, index: int, name: str, attempt: int) -> AbstractContextManager[object]:
        """Around one attempt of a step that runs: an exception leaving it is the
        attempt's failure (and goes on out)."""

    def end(self, status: str, error: BaseException | None = None) -> None:
        """The drive is over: the run's status then, and the error that ended the drive
        itself, if one did (a conflict, a divergence)."""


class Tracing(Protocol):
    """Makes the spans of an engine's drives."""

    def current(self) -> str | None:
        """The caller's trace context (a W3C `traceparent`), journaled with a start so
        that whichever worker drives the run continues the caller's trace."""

    def drive(self, execution_id: str, flow: str, parent: str | None) -> DriveSpan:
        """A drive of a run begins; `parent` is the trace context its start journaled."""
