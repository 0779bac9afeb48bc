"""Loom orchestration: child executions, supervisors, schedules and run chains, built
from kernel machinery.

from loom_orchestration import await_child, start_child

@flow
def order(ctx, order):
    receipt = await_child(ctx, payment, {"amount": order["total"]})  # parks until it ends
    start_child(ctx, shipping, order)                                # fire and forget
    return receipt
"""

from loom_orchestration._chains import (
    ROTATED,
    ChainEndedError,
    ChainNotFoundError,
    Suspension,
    chain_runs,
    current_run,
    reestablish,
    resume_chain,
    rotate,
    send_to_chain,
    start_chain,
)
from loom_orchestration._children import (
    ChildCancelledError,
    ChildFailedError,
    ChildIdTakenError,
    await_any,
    await_child,
    await_children,
    child_gate,
    install,
    start_child,
)
from loom_orchestration._schedules import (
    DEFAULT_CATCHUP_WINDOW,
    OVERLAP_POLICIES,
    ScheduleExistsError,
    ScheduleInfo,
    ScheduleNotFoundError,
    backfill_schedule,
    create_schedule,
    delete_schedule,
    fire_due_schedules,
    get_schedule,
    list_schedules,
    pause_schedule,
    trigger_schedule,
    unpause_schedule,
    update_schedule,
)
from loom_orchestration._schedules import Action as ScheduleAction
from loom_orchestration._schedules import Counts as ScheduleCounts
from loom_orchestration._supervisor import (
    ChildId,
    ChildSpec,
    ChildView,
    SupervisorEscalationError,
    format_supervision,
    supervise_children,
    supervision,
)

__all__ = [
    "DEFAULT_CATCHUP_WINDOW",
    "OVERLAP_POLICIES",
    "ROTATED",
    "ChainEndedError",
    "ChainNotFoundError",
    "ChildCancelledError",
    "ChildFailedError",
    "ChildId",
    "ChildIdTakenError",
    "ChildSpec",
    "ChildView",
    "ScheduleAction",
    "ScheduleCounts",
    "ScheduleExistsError",
    "ScheduleInfo",
    "ScheduleNotFoundError",
    "SupervisorEscalationError",
    "Suspension",
    "await_any",
    "await_child",
    "await_children",
    "backfill_schedule",
    "chain_runs",
    "child_gate",
    "create_schedule",
    "current_run",
    "delete_schedule",
    "fire_due_schedules",
    "format_supervision",
    "get_schedule",
    "install",
    "list_schedules",
    "pause_schedule",
    "reestablish",
    "resume_chain",
    "rotate",
    "send_to_chain",
    "start_chain",
    "start_child",
    "supervise_children",
    "supervision",
    "trigger_schedule",
    "unpause_schedule",
    "update_schedule",
]

# Shown as loom_orchestration.ChildFailedError (tracebacks, reprs, journal error records).
for _error in (
    ChainEndedError,
    ChainNotFoundError,
    ChildCancelledError,
    ChildFailedError,
    ChildIdTakenError,
    ScheduleExistsError,
    ScheduleNotFoundError,
    SupervisorEscalationError,
):
    _error.__module__ = __name__
del _error
