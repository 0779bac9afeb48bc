"""Schedules over bounded runs (T1): each tick of a cron expression starts a fresh run
with a deterministic id, exactly once however many workers fire it (docs/schedules.md).

The layers, each importing only those above it: `_spec` (what a schedule is; its
ticks, ids and jitter), `_state` (a schedule's state, one record of its stream),
`_decide` (the next decision, pure), `_book` (the streams), `_firing` (deciding and
doing what a decision owes), then `_api`, `_poller` and `_cli`.
"""

from loom_orchestration._schedules._api import (
    ScheduleExistsError,
    ScheduleInfo,
    ScheduleNotFoundError,
    backfill_schedule,
    create_schedule,
    delete_schedule,
    get_schedule,
    list_schedules,
    pause_schedule,
    trigger_schedule,
    unpause_schedule,
    update_schedule,
)
from loom_orchestration._schedules._firing import fire_due_schedules, on_run_settled
from loom_orchestration._schedules._poller import SchedulePoller, schedule_poller
from loom_orchestration._schedules._spec import DEFAULT_CATCHUP_WINDOW, OVERLAP_POLICIES, Overlap
from loom_orchestration._schedules._state import Action, Counts

__all__ = [
    "DEFAULT_CATCHUP_WINDOW",
    "OVERLAP_POLICIES",
    "Action",
    "Counts",
    "Overlap",
    "ScheduleExistsError",
    "ScheduleInfo",
    "ScheduleNotFoundError",
    "SchedulePoller",
    "backfill_schedule",
    "create_schedule",
    "delete_schedule",
    "fire_due_schedules",
    "get_schedule",
    "list_schedules",
    "on_run_settled",
    "pause_schedule",
    "schedule_poller",
    "trigger_schedule",
    "unpause_schedule",
    "update_schedule",
]
