"""Routing by logical name: which run of a chain an item of its inbox belongs to, and
getting it there.

Each run carries a ledger in its input: `upto`, how far the chain's inbox had been
read when the run was made the successor, and `left`, the items up to there that
no earlier run received. A run owns the items in `left` and every item past `upto`;
an item belongs to the first run that owns it and receives it. A rotation makes the
successor's ledger from its own at its rotate step, after which the run receives
nothing (its code returns the rotation), so what it received then is final.

Items reach a run by forwarding: a message becomes a `send` to the run with the key
`chain:<position>`, a gate resume a `resume` with that key, so the kernel's own
dedupe makes every forward idempotent, and the run's journal records what it
received. Whoever forwards (a sender, the rotate step, the listener of a run that
parked or ended) forwards the items the current run owns, in inbox order, skipping
the ones it has already: so the run's inbox holds them in the chain's order however
many forward at once.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import attrs
from loom_kernel import (
    ConflictError,
    Engine,
    Execution,
    ExecutionNotFoundError,
    LoomError,
    NotSuspendedError,
    RunFinishedError,
    StreamDeletedError,
)

from loom_orchestration._chains._inbox import Item, items
from loom_orchestration._chains._names import run_id

__all__ = [
    "FORWARD_KEY",
    "Ledger",
    "chain_input",
    "current",
    "deliver",
    "ledger_of",
    "next_ledger",
    "received_by",
]

logger = logging.getLogger("loom")

#: The kernel dedupe key of an item forwarded to a run: `chain:<position>`.
FORWARD_KEY: Final = "chain:"
#: How often a delivery looks for the current run again when the one it forwarded
#: to ended meanwhile (each rotation moves it on once).
_ATTEMPTS: Final = 64
#: The last run number seen of each (store, chain): where the next look starts.
_hints: dict[tuple[int, str], int] = {}
_hints_lock = threading.Lock()
#: The chains whose delivery runs in this flow of control (a forward that drives the
#: run inline, which parks, calls the listener again: the outer delivery goes on).
_DELIVERING: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "loom_chains_delivering", default=frozenset()
)


@attrs.frozen
class Ledger:
    """Which items of the chain's inbox a run owns (see the module's docstring)."""

    upto: int = 0
    left: tuple[int, ...] = ()

    def owns(self, position: int) -> bool:
        return position > self.upto or position in self.left


def chain_input(
    chain: str, number: int, carry: Any, suspensions: list[dict[str, Any]], ledger: Ledger
) -> dict[str, Any]:
    """What a chain's run receives as its input."""
    return {
        "chain": chain,
        "n": number,
        "carry": carry,
        "suspensions": suspensions,
        "inbox": {"upto": ledger.upto, "left": list(ledger.left)},
    }


def ledger_of(chain: str, number: int, execution: Execution) -> Ledger | None:
    """A chain run's ledger, from its input; None for a run that is not that chain's
    run `number` (a run whose id only looks like one)."""
    data = execution.input
    if not isinstance(data, dict) or data.get("chain") != chain or data.get("n") != number:
        return None
    inbox = data.get("inbox")
    if not isinstance(inbox, dict):
        return None
    upto, left = inbox.get("upto"), inbox.get("left")
    if not isinstance(upto, int) or not isinstance(left, list):
        return None
    return Ledger(upto, tuple(p for p in left if isinstance(p, int)))


def _forwarded(key: str | None) -> int | None:
    if key is None or not key.startswith(FORWARD_KEY):
        return None
    digits = key[len(FORWARD_KEY) :]
    return int(digits) if digits.isdigit() else None


def received_by(engine: Engine, execution_id: str) -> set[int]:
    """The chain inbox positions a run received: the forwarded messages it read, and
    the forwarded resumes its gates took."""
    got = {
        position
        for message in engine.inbox(execution_id)
        if message.received and (position := _forwarded(message.key)) is not None
    }
    for key in engine.state(execution_id).resume_keys:
        position = _forwarded(key)
        if position is not None:
            got.add(position)
    return got


def next_ledger(engine: Engine, chain: str, execution: Execution, ledger: Ledger) -> Ledger:
    """The ledger of a run's successor: the chain's inbox as read now, less what the
    run received (final: it is at its rotate step)."""
    present = items(engine.store, chain)
    upto = max((item.position for item in present), default=ledger.upto)
    upto = max(upto, ledger.upto)
    received = received_by(engine, execution.id)
    left = tuple(
        item.position
        for item in present
        if item.position <= upto and ledger.owns(item.position) and item.position not in received
    )
    return Ledger(upto, left)


def _exists(engine: Engine, chain: str, number: int) -> bool:
    try:
        return engine.store.head(engine.stream_of(run_id(chain, number))) > 0
    except StreamDeletedError:  # it ran, and retention deleted it
        return True


def current(engine: Engine, chain: str) -> int | None:
    """The number of a chain's newest run (the runs 1..n exist: each is made by the
    one before it), or None when it has none."""
    slot = (id(engine.store), chain)
    with _hints_lock:
        hint = _hints.get(slot, 1)
    if not _exists(engine, chain, hint):
        low, high = 0, hint  # the newest is below the hint (or there is none)
    else:
        low, step = hint, 1
        while _exists(engine, chain, low + step):
            low, step = low + step, step * 2
        high = low + step
    while high - low > 1:  # low exists (or is 0), high does not
        middle = (low + high) // 2
        if _exists(engine, chain, middle):
            low = middle
        else:
            high = middle
    if low == 0:
        return None
    with _hints_lock:
        _hints[slot] = low
    return low


@contextmanager
def _delivering(chain: str) -> Iterator[bool]:
    """Whether this flow of control should deliver for `chain` (not when a delivery
    of it is already under way here)."""
    running = _DELIVERING.get()
    if chain in running:
        yield False
        return
    token = _DELIVERING.set(running | {chain})
    try:
        yield True
    finally:
        _DELIVERING.reset(token)


def deliver(engine: Engine, chain: str) -> None:
    """Forward to the chain's current run the items it owns and lacks, in order.

    Raises:
        LoomError: the store failed (what was forwarded stays forwarded; the next
            delivery, a send's or a listener's, goes on).
    """
    with _delivering(chain) as mine:
        if not mine:
            return
        for _ in range(_ATTEMPTS):
            number = current(engine, chain)
            if number is None:
                return
            passed, forwarded = _forward_once(engine, chain, number)
            # A forward may have driven the run inline to its rotation: then its
            # successor owns what is left, and gets it in this same call.
            if passed and (not forwarded or current(engine, chain) == number):
                return
        logger.warning("loom: chain %s: its current run kept ending during a delivery", chain)


def _forward_once(engine: Engine, chain: str, number: int) -> tuple[bool, bool]:
    """One pass over run `number`: whether it went through (False when the run ended
    during it: look for its successor), and whether it forwarded anything."""
    execution_id = run_id(chain, number)
    try:
        execution = engine.get(execution_id)
    except ExecutionNotFoundError:
        return True, False
    ledger = ledger_of(chain, number, execution)
    if ledger is None or execution.status.finished:
        return True, False  # not a chain's run, or the chain ended: nothing to deliver to
    owned = [item for item in items(engine.store, chain) if ledger.owns(item.position)]
    if not owned:
        return True, False
    held = {p for m in engine.inbox(execution_id) if (p := _forwarded(m.key)) is not None}
    resumed = {p for key in engine.state(execution_id).resume_keys if (p := _forwarded(key))}
    forwarded = False
    for item in owned:
        if item.kind == "message":
            if item.position not in held:
                if not _send(engine, execution_id, item):
                    return False, True
                forwarded = True
        elif item.position not in resumed:
            forwarded = _resume(engine, execution_id, item) or forwarded
    return True, forwarded


def _send(engine: Engine, execution_id: str, item: Item) -> bool:
    try:
        engine.send(execution_id, item.value, topic=item.name, key=f"{FORWARD_KEY}{item.position}")
    except RunFinishedError:
        return False
    return True


def _resume(engine: Engine, execution_id: str, item: Item) -> bool:
    """Whether the resume was delivered."""
    try:
        engine.resume(execution_id, item.value, key=f"{FORWARD_KEY}{item.position}", on=item.name)
    except (NotSuspendedError, ConflictError):
        return False  # not parked at that gate now: its listener delivers it when it parks
    except LoomError as exc:
        logger.warning("loom: %s: chain resume %s not delivered: %s", execution_id, item, exc)
        return False
    return True
