"""What a schedule is: its flow, its cron expression in its time zone, what a tick
does while the last run still runs (the overlap policy), how far back missed ticks
are caught up, and its jitter; and the ticks, ids and jittered due times they give.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Literal, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import attrs
from cronsim import CronSim, CronSimError
from loom_kernel import InvalidArgumentError, InvalidIdError
from loom_kernel.spi import MAX_ID_LENGTH, validate_stream_id

__all__ = [
    "DEFAULT_CATCHUP_WINDOW",
    "MAX_SECONDS",
    "MIN_CATCHUP_WINDOW",
    "OVERLAP_POLICIES",
    "Overlap",
    "ScheduleSpec",
    "check_name",
    "run_id",
    "seconds",
    "tick_text",
]

Overlap = Literal[
    "skip", "buffer_one", "buffer_all", "cancel_other", "terminate_other", "allow_all"
]
#: The overlap policies, named as Temporal names them.
OVERLAP_POLICIES: Final[tuple[str, ...]] = get_args(Overlap)
#: Temporal's default: ticks missed for up to a year are caught up.
DEFAULT_CATCHUP_WINDOW: Final = timedelta(days=365)
#: A tick fired this late is still on time: less would count a poll's delay as missed.
MIN_CATCHUP_WINDOW: Final = 1.0
#: The longest duration (a catch-up window, a jitter) and the farthest instant from
#: 1970 (a backfill's bounds) a schedule takes: a century.
MAX_SECONDS: Final = 100 * 365.25 * 86400
#: The longest a tick's id may be: `sched/<name>@2026-12-07T03:04:05.123Z`.
_ID_PREFIX: Final = "sched/"
_TICK_LENGTH: Final = len("2026-12-07T03:04:05.123Z")
#: The longest run id the kernel takes (its `events/` stream is named by it too).
_MAX_RUN_ID: Final = MAX_ID_LENGTH - len("events/")
MAX_NAME_LENGTH: Final = _MAX_RUN_ID - len(_ID_PREFIX) - 1 - _TICK_LENGTH


def check_name(name: object) -> str:
    """A schedule's name: a valid id segment (no '/', no '@'), short enough that its
    runs' ids are valid ids too.

    Raises:
        InvalidIdError: it is not.
    """
    if not isinstance(name, str):
        raise InvalidIdError(name, "a schedule name is a str")
    if "/" in name or "@" in name:
        raise InvalidIdError(
            name, "a schedule name has no '/' or '@' (its runs are sched/<name>@<tick>)"
        )
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidIdError(name, f"a schedule name has at most {MAX_NAME_LENGTH} characters")
    validate_stream_id(name)
    return name


def seconds(value: object, what: str, *, least: float = 0.0) -> float:
    """A duration given as a timedelta or a number of seconds, as seconds.

    Raises:
        InvalidArgumentError: not a finite duration of at least `least` seconds.
    """
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentError(f"{what} is a timedelta or a number of seconds, not {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or abs(number) > MAX_SECONDS:
        raise InvalidArgumentError(
            f"{what} is at most {MAX_SECONDS:g} s (a century), not {value!r}"
        )
    if number < least:
        raise InvalidArgumentError(f"{what} is at least {least:g} s, not {value!r}")
    return number


def tick_text(tick: float, *, millis: bool = False) -> str:
    """A tick as ISO 8601 in UTC: whole seconds for a cron tick, milliseconds always
    for a trigger's (`2026-12-07T03:00:00Z`, `2026-12-07T03:04:05.000Z`), so a trigger
    never takes a cron tick's id. A cron tick that is not a whole second (none is)
    would show its milliseconds too."""
    whole, fraction = divmod(round(tick * 1000), 1000)
    moment = datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{moment}.{fraction:03d}Z" if millis or fraction else f"{moment}Z"


def run_id(name: str, tick: float, *, trigger: bool = False) -> str:
    """The id of the run a schedule starts for a tick: the same in every process, so
    however many workers fire the tick, one run starts (K9). A trigger's tick always
    has milliseconds."""
    return f"{_ID_PREFIX}{name}@{tick_text(tick, millis=trigger)}"


def schedule_of(execution_id: str) -> str | None:
    """The schedule a run was started by, from its id; None for other runs."""
    if not execution_id.startswith(_ID_PREFIX) or "@" not in execution_id:
        return None
    return execution_id[len(_ID_PREFIX) : execution_id.rindex("@")]


def _check_cron(_spec: ScheduleSpec, _attribute: Any, cron: Any) -> None:
    if not isinstance(cron, str):
        raise InvalidArgumentError(f"cron is a str, not {cron!r}")
    try:
        CronSim(cron, datetime(2000, 1, 1, tzinfo=UTC))
    except (CronSimError, ValueError) as exc:
        raise InvalidArgumentError(
            f"cron {cron!r} is not a cron expression: {exc} (five fields, minute hour "
            "day month weekday, or six with seconds first; L and # as Debian cron)"
        ) from None


def _check_zone(_spec: ScheduleSpec, _attribute: Any, zone: Any) -> None:
    if not isinstance(zone, str):
        raise InvalidArgumentError(f"timezone is a str, not {zone!r}")
    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidArgumentError(f"timezone {zone!r} is not an IANA time zone: {exc}") from None


def _check_overlap(_spec: ScheduleSpec, _attribute: Any, overlap: Any) -> None:
    if overlap not in OVERLAP_POLICIES:
        raise InvalidArgumentError(
            f"overlap is one of {', '.join(OVERLAP_POLICIES)}, not {overlap!r}"
        )


def _check_flow(_spec: ScheduleSpec, _attribute: Any, flow: Any) -> None:
    if not isinstance(flow, str) or not flow:
        raise InvalidArgumentError(f"a schedule's flow is a flow name, not {flow!r}")


@attrs.frozen
class ScheduleSpec:
    """What a schedule starts, and when.

    Attributes:
        flow: the name of the flow each tick starts.
        cron: the cron expression, read in `timezone`.
        input: what the flow receives as `input["input"]` (beside the tick).
        overlap: what a tick does while the schedule's last run still runs.
        catchup_window: seconds; a tick due longer ago than this when it is fired is
            missed (counted), not started.
        jitter: seconds; each tick is due up to this much after its time (never past
            the next tick), the same delay in every process.
        timezone: the IANA zone the cron expression is read in.
    """

    flow: str = attrs.field(validator=_check_flow)
    cron: str = attrs.field(validator=_check_cron)
    input: Any = None
    overlap: str = attrs.field(default="skip", validator=_check_overlap)
    catchup_window: float = DEFAULT_CATCHUP_WINDOW.total_seconds()
    jitter: float = 0.0
    timezone: str = attrs.field(default="UTC", validator=_check_zone)

    def ticks_after(self, after: float) -> Iterator[float]:
        """The ticks strictly after `after` (Unix seconds), in order, as Unix seconds;
        a time zone's shifts as Debian cron takes them (a time skipped in spring
        fires at the first time after it, one repeated in autumn fires once)."""
        zone = ZoneInfo(self.timezone)
        start = datetime.fromtimestamp(math.floor(after), UTC).astimezone(zone)
        for moment in CronSim(self.cron, start):
            tick = moment.timestamp()
            if tick > after:
                yield tick

    def due_at(self, name: str, tick: float, following: float) -> float:
        """When a tick is due: its time plus its jitter, a fraction of `jitter` (never
        more than the time to the `following` tick) drawn from the schedule's name and
        the tick, so every process waits the same."""
        if self.jitter <= 0:
            return tick
        digest = hashlib.sha256(f"{name}@{tick_text(tick)}".encode()).digest()
        fraction = int.from_bytes(digest[:8], "big") / 2**64
        return tick + fraction * min(self.jitter, max(following - tick, 0.0))
