"""The listener (the `loom.listeners` entry point): a chain's run that parked or ended
gets (or hands its successor) the chain's items that wait for it. Called again at
every worker's sweep and by `recover()` for a parked run, so an item whose sender
stopped before forwarding it is delivered there."""

from __future__ import annotations

import logging

from loom_kernel import Engine, Execution, LoomError, Status

from loom_orchestration._chains._api import ROTATE_STEP, ROTATED
from loom_orchestration._chains._names import number_of
from loom_orchestration._chains._routing import deliver, drive_successor, ledger_of

__all__ = ["on_run_settled"]

logger = logging.getLogger("loom")


def on_run_settled(engine: Engine, execution: Execution) -> None:
    """Deliver what waits for a chain's run that parked, or for the successor of one
    that ended."""
    if execution.status is Status.RUNNING:
        return
    parsed = number_of(execution.id)
    if parsed is None:
        return
    chain, number = parsed
    if ledger_of(chain, number, execution) is None:
        return  # a run whose id only looks like a chain's
    result = execution.result
    successor = result.get(ROTATED) if isinstance(result, dict) else None
    if execution.status.finished and isinstance(successor, str):
        drive_successor(engine, successor)
    elif execution.status.finished and _rotated_without_returning(engine, execution.id):
        logger.error(
            "loom: %s called rotate but ended without returning its rotation: its successor "
            "runs beside a run that went on (return rotate(...) as the last thing)",
            execution.id,
        )
    try:
        deliver(engine, chain)
    except LoomError as exc:  # the next settle or sweep delivers it
        logger.warning("loom: chain %s: delivery after %s failed: %s", chain, execution.id, exc)


def _rotated_without_returning(engine: Engine, execution_id: str) -> bool:
    try:
        frames = engine.frames(execution_id)
    except LoomError:
        return False
    return any(frame.name == ROTATE_STEP for frame in frames.values())
