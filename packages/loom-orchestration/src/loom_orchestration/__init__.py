"""Loom orchestration: child executions and supervisors, built from kernel machinery.

from loom_orchestration import await_child, start_child

@flow
def order(ctx, order):
    receipt = await_child(ctx, payment, {"amount": order["total"]})  # parks until it ends
    start_child(ctx, shipping, order)                                # fire and forget
    return receipt
"""

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
    "ChildCancelledError",
    "ChildFailedError",
    "ChildId",
    "ChildIdTakenError",
    "ChildSpec",
    "ChildView",
    "SupervisorEscalationError",
    "await_any",
    "await_child",
    "await_children",
    "child_gate",
    "format_supervision",
    "install",
    "start_child",
    "supervise_children",
    "supervision",
]

# Shown as loom_orchestration.ChildFailedError (tracebacks, reprs, journal error records).
for _error in (ChildCancelledError, ChildFailedError, ChildIdTakenError, SupervisorEscalationError):
    _error.__module__ = __name__
del _error
