"""A journal as a person reads it: one line per record, time relative to the start."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from loom_kernel._core import (
    ExecutionCancelled,
    ExecutionClaimed,
    ExecutionCompleted,
    ExecutionDeleted,
    ExecutionFailed,
    ExecutionMigrated,
    ExecutionResumed,
    ExecutionStarted,
    ExecutionSuspended,
    StepCompleted,
    StepFailed,
)
from loom_kernel._engine import HistoryEntry
from loom_kernel._replay import TIMER_GATE

__all__ = ["format_timeline"]

#: The name of the step a `ctx.set_event(key, ...)` journals, before its key.
_PUBLISHED: Final = "loom.event:"


def _short(value: Any, width: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    return text if len(text) <= width else text[: width - 1] + "…"


def _offset(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"+{seconds:.0f}s"
    if seconds < 3600:
        return f"+{seconds / 60:.0f}m"
    if seconds < 86400:
        return f"+{seconds / 3600:.1f}h"
    return f"+{seconds / 86400:.1f}d"


def _describe(
    entry: HistoryEntry, start: float, published: Mapping[str, Any] | None
) -> tuple[str, str]:
    event = entry.event
    if isinstance(event, StepCompleted) and event.name.startswith(_PUBLISHED):
        key = event.name.removeprefix(_PUBLISHED)
        if published is None or key not in published:
            return f"step {event.index}", f"published {key}"
        return f"step {event.index}", f"published {key} (now {_short(published[key])})"
    if isinstance(event, ExecutionStarted):
        key = f" key={event.key}" if event.key else ""
        return "started", f"{event.flow}({_short(event.input)}){key}"
    if isinstance(event, StepCompleted):
        retries = f" after {event.attempts} attempts" if event.attempts > 1 else ""
        return f"step {event.index}", f"{event.name} → {_short(event.result)}{retries}"
    if isinstance(event, StepFailed):
        return (
            f"step {event.index}",
            f"{event.name} FAILED: {event.error.type}: {event.error.message}",
        )
    if isinstance(event, ExecutionSuspended):
        if event.on == TIMER_GATE and event.wake_at is not None:
            return f"gate {event.gate}", f"sleeping until {_offset(event.wake_at - start)}"
        return f"gate {event.gate}", f"waiting on {event.on!r}"
    if isinstance(event, ExecutionResumed):
        if event.key is not None and event.key.startswith("timer:"):
            return "resumed", "timer fired"
        key = f" (key {event.key})" if event.key else ""
        return "resumed", f"with {_short(event.payload)}{key}"
    if isinstance(event, ExecutionCompleted):
        return "completed", f"→ {_short(event.result)}"
    if isinstance(event, ExecutionFailed):
        return "failed", f"{event.error.type}: {event.error.message}"
    if isinstance(event, ExecutionCancelled):
        return "cancelled", event.reason or ""
    if isinstance(event, ExecutionMigrated):
        return "migrated", f"{event.from_hash} → {event.to_hash}"
    if isinstance(event, ExecutionClaimed):
        return "claimed", f"by {event.by} (from {event.previous or 'no owner'})"
    if isinstance(event, ExecutionDeleted):
        return (
            "deleted",
            f"by {event.reason or 'hand'}; a start with its id is run {event.generation}",
        )
    return type(event).__name__, ""  # pragma: no cover - every kind is handled above


def format_timeline(
    history: Sequence[HistoryEntry], published: Mapping[str, Any] | None = None
) -> str:
    """Render an execution's history as text, one line per journal record.

    Args:
        history: the records, as `Engine.history` gives them.
        published: the run's published values now (`Engine.get_events`), to show
            beside each `set_event` (whose step records no value of its own).
    """
    if not history:
        return "(empty journal)"
    start = history[0].timestamp
    lines = []
    for entry in history:
        what, detail = _describe(entry, start, published)
        lines.append(
            f"  #{entry.position:<3} {_offset(entry.timestamp - start):>6}  {what:<10} {detail}"
        )
    return "\n".join(lines)
