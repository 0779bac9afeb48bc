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
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import attrs
from loom_kernel import (
    ConflictError,
    Engine,
    Execution,
    ExecutionNotFoundError,
    InvalidArgumentError,
    LoomError,
    NotSuspendedError,
    RunFinishedError,
    Status,
    StreamDeletedError,
)
from loom_kernel.spi import JournalStore

from loom_orchestration._chains._inbox import Item, items
from loom_orchestration._chains._names import run_id

__all__ = [
    "FORWARD_KEY",
    "Ledger",
    "chain_input",
    "current",
    "deliver",
    "drive_successor",
    "exists",
    "ledger_of",
    "next_ledger",
    "received_by",
]

logger = logging.getLogger("loom")

#: The kernel dedupe key of an item forwarded to a run: `chain:<position>`.
FORWARD_KEY: Final = "chain:"
#: The most passes one delivery makes (each forwards something, or it stops): a
#: backlog of a million rotations is left to the next delivery.
_MOST_PASSES: Final = 1_000_000
#: The last run number seen of each chain, by store (gone with it): where the next
#: look starts.
_hints: weakref.WeakKeyDictionary[JournalStore, dict[str, int]] = weakref.WeakKeyDictionary()
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
        for key, sent in engine.inbox_keys(execution_id).items()
        if sent.received and (position := _forwarded(key)) is not None
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


def exists(engine: Engine, chain: str, number: int) -> bool:
    """Whether run `number` of a chain was started (it may have been deleted since)."""
    try:
        return engine.store.head(engine.stream_of(run_id(chain, number))) > 0
    except StreamDeletedError:  # it ran, and retention deleted it
        return True


def current(engine: Engine, chain: str) -> int | None:
    """The number of a chain's newest run (the runs 1..n exist: each is made by the
    one before it), or None when it has none."""
    with _hints_lock:
        hint = _hints.setdefault(engine.store, {}).get(chain, 1)
    if not exists(engine, chain, hint):
        low, high = 0, hint  # the newest is below the hint (or there is none)
    else:
        low, step = hint, 1
        while exists(engine, chain, low + step):
            low, step = low + step, step * 2
        high = low + step
    while high - low > 1:  # low exists (or is 0), high does not
        middle = (low + high) // 2
        if exists(engine, chain, middle):
            low = middle
        else:
            high = middle
    if low == 0:
        return None
    if low != hint and not _is_chain_run(engine, chain, low):
        low = _walk(engine, chain)  # a run named like the chain's, started by hand: no gaps
        if low == 0:
            return None
    with _hints_lock:
        _hints.setdefault(engine.store, {})[chain] = low
    return low


def _is_chain_run(engine: Engine, chain: str, number: int) -> bool:
    try:
        return ledger_of(chain, number, engine.get(run_id(chain, number))) is not None
    except ExecutionNotFoundError:
        return True  # deleted by retention: it was one


def _walk(engine: Engine, chain: str) -> int:
    """The newest run of an unbroken line of the chain's runs from 1, one by one."""
    number = 0
    while exists(engine, chain, number + 1) and _is_chain_run(engine, chain, number + 1):
        number += 1
    return number


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
        for _ in range(_MOST_PASSES):
            number = current(engine, chain)
            if number is None:
                return
            passed, forwarded = _forward_once(engine, chain, number)
            # A forward may have driven the run inline: to a gate an earlier resume of
            # the pass was refused at, or to its rotation (its successor owns what is
            # left). Pass again until a pass forwards nothing.
            if passed and not forwarded:
                return
        logger.warning(
            "loom: chain %s: a delivery made %d passes; the rest at the next", chain, _MOST_PASSES
        )


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
    # Every forward the run's inbox had, those its run read and compacted away too.
    held = {p for key in engine.inbox_keys(execution_id) if (p := _forwarded(key)) is not None}
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
    except InvalidArgumentError as exc:  # refused at its send: here only if written by hand
        logger.error(
            "loom: %s: chain item %d can never be delivered: %s", execution_id, item.position, exc
        )
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


#: The successors waiting to be driven by the outermost drive of this flow of control
#: (a chain whose runs rotate without parking drives one run after another here,
#: never one inside another).
_SUCCESSORS: contextvars.ContextVar[list[tuple[Engine, str]] | None] = contextvars.ContextVar(
    "loom_chain_successors", default=None
)


def drive_successor(engine: Engine, execution_id: str) -> None:
    """Drive a rotation's successor that no worker took (one started with no worker
    here): at once, or after the drive this call is made inside of, by it."""
    waiting = _SUCCESSORS.get()
    if waiting is not None:
        waiting.append((engine, execution_id))
        return
    waiting = [(engine, execution_id)]
    token = _SUCCESSORS.set(waiting)
    try:
        while waiting:
            driver, successor = waiting.pop(0)
            try:
                execution = driver.get(successor)
                if execution.status is Status.RUNNING and execution.owner is None:
                    driver.recover(successor)
            except LoomError as exc:  # a worker's sweep, or recover(), drives it
                logger.warning("loom: chain successor %s not driven here: %s", successor, exc)
    finally:
        _SUCCESSORS.reset(token)
