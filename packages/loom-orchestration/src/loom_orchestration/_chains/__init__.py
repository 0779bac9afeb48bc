"""Run chains and routing by logical name: ADR 0052's userland approximation (see
docs/chains.md)."""

from loom_orchestration._chains._api import (
    ROTATE_STEP,
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
from loom_orchestration._chains._listener import on_run_settled

__all__ = [
    "ROTATED",
    "ROTATE_STEP",
    "ChainEndedError",
    "ChainNotFoundError",
    "Suspension",
    "chain_runs",
    "current_run",
    "on_run_settled",
    "reestablish",
    "resume_chain",
    "rotate",
    "send_to_chain",
    "start_chain",
]
