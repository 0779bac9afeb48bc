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
    await_any,
    await_child,
    await_children,
    install,
    start_child,
)

__all__ = [
    "ChildCancelledError",
    "ChildFailedError",
    "await_any",
    "await_child",
    "await_children",
    "install",
    "start_child",
]
