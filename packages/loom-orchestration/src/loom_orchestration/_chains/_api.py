"""Run chains: one logical name over a run after a run. `start_chain` starts
`<chain>@1`; a chain's run ends with `return rotate(ctx, carry)`, which starts
`<chain>@<n+1>` with `carry` (a K9 start, made in a step before this run's terminal
record); `send_to_chain` and `resume_chain` address the chain by its name and reach
the run current when it reads them (see `_routing`); `reestablish` parks a successor
at the gates its predecessor carried; `chain_runs` and `current_run` are the lineage,
read from the journals.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any, Final

import attrs
from loom_kernel import (
    AsyncContext,
    Context,
    Engine,
    Execution,
    ExecutionNotFoundError,
    Flow,
    InvalidArgumentError,
    LoomError,
    NotFoundError,
    Woken,
)
from loom_kernel.spi import MAX_ID_LENGTH

from loom_orchestration._chains import _inbox
from loom_orchestration._chains._names import check_chain, number_of, run_id
from loom_orchestration._chains._routing import (
    Ledger,
    chain_input,
    current,
    deliver,
    exists,
    ledger_of,
    next_ledger,
    received_by,
)

__all__ = [
    "ROTATED",
    "ROTATE_STEP",
    "ChainEndedError",
    "ChainNotFoundError",
    "Suspension",
    "chain_runs",
    "current_run",
    "reestablish",
    "resume_chain",
    "rotate",
    "send_to_chain",
    "start_chain",
]

#: The step a rotation journals (it starts the successor), and the key of the result
#: a rotated run ends with: `{"loom.rotated_to": "<chain>@<n+1>"}`.
ROTATE_STEP: Final = "loom.chain.rotate"
ROTATED: Final = "loom.rotated_to"
#: How often the newest run is looked for again while each found has just rotated.
_LOOKS: Final = 64


class ChainNotFoundError(NotFoundError):
    """No chain of that name has been started (its first run does not exist)."""


class ChainEndedError(LoomError):
    """The chain's last run ended without rotating: nothing will read what was sent.

    Attributes:
        chain: the chain.
        execution_id: its last run.
        status: how that run ended.
        position: the item's place in the chain's inbox, when it was appended before
            the run was seen to end (kept there, undelivered); None when nothing was.
    """

    def __init__(
        self, chain: str, execution_id: str, status: str, position: int | None = None
    ) -> None:
        kept = "" if position is None else f"; item {position} stays undelivered in its inbox"
        super().__init__(f"chain {chain!r} ended: its last run {execution_id} is {status}{kept}")
        self.chain, self.execution_id, self.status, self.position = (
            chain,
            execution_id,
            status,
            position,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.chain, self.execution_id, self.status, self.position))


@attrs.frozen
class Suspension:
    """A gate a run hands to its successor: its name and absolute deadline (Unix
    seconds by the engine's clock; None for none). The successor parks at the same
    gate with the same deadline (`reestablish`): nothing is transferred with its
    identity (ADR 0052 D3)."""

    gate: str
    deadline: float | None = None


def _suspensions(suspensions: Iterable[Suspension]) -> list[dict[str, Any]]:
    made = []
    for suspension in suspensions:
        if not isinstance(suspension, Suspension):
            raise InvalidArgumentError(
                f"suspensions are Suspension(gate, deadline), not {suspension!r}"
            )
        if not isinstance(suspension.gate, str) or not suspension.gate:
            raise InvalidArgumentError(
                f"a suspension's gate is a non-empty str, not {suspension.gate!r}"
            )
        deadline = suspension.deadline
        if deadline is not None and (
            isinstance(deadline, bool)
            or not isinstance(deadline, int | float)
            or not math.isfinite(deadline)
        ):
            raise InvalidArgumentError(
                f"a suspension's deadline is Unix seconds or None, not {deadline!r}"
            )
        made.append({"gate": suspension.gate, "deadline": deadline})
    return made


def _flow_name(flow: str | Flow) -> str:
    return flow.name if isinstance(flow, Flow) else flow


def start_chain(engine: Engine, chain: str, flow: str | Flow, carry: Any = None) -> Execution:
    """Start a chain: its first run, `<chain>@1`, of `flow` (driven until it parks or
    ends, as `Engine.start`; by an engine without the flow's code, started by name for
    a worker that has it). A K9 start: the same call again returns the run (and starts
    nothing), whatever the chain has become since.

    The run receives `{"chain": chain, "n": 1, "carry": carry, "suspensions": [],
    "inbox": {...}}` (the last is the chain's bookkeeping).

    Raises:
        InvalidIdError: the chain's name is not valid (no '@', an id segment).
        UnknownFlowError: the engine has no such flow.
        InvalidArgumentError: `carry` is not JSON.
    """
    chain = check_chain(chain)
    name, first = _flow_name(flow), run_id(chain, 1)
    data = chain_input(chain, 1, carry, [], Ledger())
    if exists(engine, chain, 1):
        try:
            return engine.get(first)
        except ExecutionNotFoundError:  # the first run of the id ended, and was deleted
            raise InvalidArgumentError(
                f"chain {chain!r} was started before, and its first run was deleted since "
                "(retention): a chain is started once (current_run finds where it is)"
            ) from None
    if isinstance(flow, Flow) or engine.hosts(name):
        return engine.start(flow, data, key=first)
    engine.dispatch(name, data, key=first)  # no code here: a worker that has it drives it
    return engine.get(first)


def _chain_run(ctx: Context | AsyncContext) -> tuple[str, int]:
    parsed = number_of(ctx.execution_id)
    if parsed is None:
        raise InvalidArgumentError(
            f"rotate is for a chain's run (<chain>@<n>), not {ctx.execution_id!r}"
        )
    return parsed


def rotate(
    ctx: Context | AsyncContext, carry: Any = None, *, suspensions: Sequence[Suspension] = ()
) -> Any:
    """End this chain run with a successor: `return rotate(ctx, carry)` as the last
    thing the flow does (in an async flow, `return await rotate(ctx, carry)`).

    A step starts `<chain>@<n+1>` (the same flow's newest version: a rotation is a
    clean point to deploy new code) with `carry` and the `suspensions` to re-establish
    (`reestablish`), and hands it the chain's items this run has not received; then
    this run ends with `{"loom.rotated_to": "<chain>@<n+1>"}`. The start is a K9 start
    made before this run's terminal record, so a crash at any point, and any number of
    engines replaying the rotation, give one successor. Nothing may follow it: what the
    run received is final once the step runs.

    Raises:
        InvalidArgumentError: this run is not a chain's run, or `carry` is not JSON, or
            a suspension is not valid.
    """
    chain, number = _chain_run(ctx)
    kept = _suspensions(suspensions)
    engine = ctx.engine
    me = ctx.execution_id

    def handoff() -> str:
        execution = engine.get(me)
        ledger = ledger_of(chain, number, execution)
        if ledger is None:
            raise InvalidArgumentError(f"{me} was not started as run {number} of chain {chain!r}")
        successor = run_id(chain, number + 1)
        if exists(engine, chain, number + 1):
            return successor  # started before a crash redid this step (maybe deleted since)
        made = next_ledger(engine, chain, execution, ledger)
        # Started, not driven here: a worker of this engine takes it at once; with
        # none, the listener of this run's end drives it (after this run, never inside
        # it: a chain of a thousand rotations is not a thousand frames deep).
        engine.enqueue(
            execution.flow, chain_input(chain, number + 1, carry, kept, made), key=successor
        )
        deliver(engine, chain)
        return successor

    here = ctx.position
    if any(
        frame.name == ROTATE_STEP and index < here for index, frame in engine.frames(me).items()
    ):
        raise InvalidArgumentError(
            f"{me} rotated already: rotate is the last thing a run does (return rotate(...))"
        )

    if isinstance(ctx, AsyncContext):
        return _rotated_async(ctx, handoff)
    return {ROTATED: ctx.step(ROTATE_STEP, handoff)}


async def _rotated_async(ctx: AsyncContext, handoff: Any) -> dict[str, str]:
    async def off_the_loop() -> str:
        return str(await asyncio.to_thread(handoff))

    return {ROTATED: await ctx.step(ROTATE_STEP, off_the_loop)}


def reestablish(ctx: Context | AsyncContext, run: Any) -> Woken | Awaitable[Woken | None] | None:
    """Park at the gates the predecessor carried (`rotate(..., suspensions=...)`), by
    name, until the earliest of their deadlines: what came first, as
    `ctx.wait_first` says it; None when nothing was carried. The deadlines are
    absolute, so the successor waits what was left of them (awaitable in async flows).

    Args:
        ctx: the successor's context.
        run: the run's input (as the flow received it).
    """
    carried = run.get("suspensions") if isinstance(run, dict) else None
    if not carried:
        return None
    gates = [entry["gate"] for entry in carried]
    deadlines = [entry["deadline"] for entry in carried if entry.get("deadline") is not None]
    if not deadlines:
        return ctx.wait_first(gates=gates)
    if isinstance(ctx, AsyncContext):

        async def waited() -> Woken:
            left = max(0.0, min(deadlines) - ctx.now())
            return await ctx.wait_first(gates=gates, timeout=left)

        return waited()
    left = max(0.0, min(deadlines) - ctx.now())
    return ctx.wait_first(gates=gates, timeout=left)


def _check_key(key: object) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not key or len(key) > MAX_ID_LENGTH:
        raise InvalidArgumentError(
            f"a key is a non-empty str of at most {MAX_ID_LENGTH} characters, not {key!r}"
        )
    return key


def _check_name(name: object, what: str) -> str | None:
    """A topic (None: the default one) or a gate's name, as the kernel takes them: a
    non-empty str of at most 200 characters that has a UTF-8 form."""
    if name is None and what == "topic":
        return None
    if isinstance(name, str) and 0 < len(name) <= MAX_ID_LENGTH:
        try:
            name.encode()
        except UnicodeEncodeError:
            pass
        else:
            return name
    raise InvalidArgumentError(
        f"a {what} is a non-empty str of at most {MAX_ID_LENGTH} characters (UTF-8, so no "
        f"lone surrogate), not {name!r}"
    )


def _newest(engine: Engine, chain: str) -> Execution:
    """The chain's newest run, looked for again while the one found has rotated (it
    rotated between the look for it and its read).

    Raises:
        ChainNotFoundError: the chain has not been started.
    """
    for _ in range(_LOOKS):
        number = current(engine, chain)
        if number is None:
            raise ChainNotFoundError(f"no chain {chain!r}: start it with start_chain")
        execution = _run(engine, chain, number)
        if not _rotated(execution):
            return execution
    return execution


def _run(engine: Engine, chain: str, number: int) -> Execution:
    """Run `number` of a chain, its newest.

    Raises:
        ChainEndedError: retention deleted it: it ended without rotating (a run that
            rotated has a successor, newer), and so did the chain.
    """
    execution_id = run_id(chain, number)
    try:
        return engine.get(execution_id)
    except ExecutionNotFoundError:
        raise ChainEndedError(chain, execution_id, "deleted (by retention)") from None


def _rotated(execution: Execution) -> bool:
    result = execution.result
    return execution.status.finished and isinstance(result, dict) and ROTATED in result


def _live_run(engine: Engine, chain: str) -> Execution:
    execution = _newest(engine, chain)
    if execution.status.finished:
        raise ChainEndedError(chain, execution.id, execution.status.value)
    return execution


def _post(
    engine: Engine, chain: str, *, kind: Any, name: str | None, key: str | None, value: Any
) -> int:
    if key is not None:  # a resend is a no-op, even once the chain has ended
        for item in _inbox.items(engine.store, chain):
            if item.key == key:
                return item.position
    _live_run(engine, chain)
    position = _inbox.append(
        engine.store, chain, kind=kind, name=name, key=key, value=value, at=engine.clock()
    )
    deliver(engine, chain)
    _check_delivered(engine, chain, position)
    return position


def _check_delivered(engine: Engine, chain: str, position: int) -> None:
    """Raise if the chain ended with the item unread (it ended as it was sent)."""
    execution = _newest(engine, chain)
    if not execution.status.finished:
        return
    parsed = number_of(execution.id)
    if parsed is None:
        return
    ledger = ledger_of(chain, parsed[1], execution)
    if ledger is None or not ledger.owns(position):
        return  # an earlier run received it
    if position in received_by(engine, execution.id):
        return
    raise ChainEndedError(chain, execution.id, execution.status.value, position)


def send_to_chain(
    engine: Engine,
    chain: str,
    message: Any = None,
    topic: str | None = None,
    key: str | None = None,
) -> int:
    """Send a message to a chain by its name: the run current when it reads it gets it,
    once (`ctx.receive(topic)`), in send order per topic, whichever run was current when
    it was sent; one sent to a run that has just rotated reaches its successor. A
    message sent again with the same `key` is never delivered twice, across the whole
    chain (a resend returns the first one's position).

    Returns:
        Its position in the chain's inbox.

    Raises:
        ChainNotFoundError: the chain has not been started.
        ChainEndedError: its last run ended without rotating (nothing sent), or ended
            as this was sent, without reading it.
        InvalidArgumentError: the message is not JSON, or the topic or key is not a
            non-empty str.
    """
    chain = check_chain(chain)
    return _post(
        engine,
        chain,
        kind="message",
        name=_check_name(topic, "topic"),
        key=_check_key(key),
        value=message,
    )


def resume_chain(
    engine: Engine, chain: str, payload: Any = None, *, on: str, key: str | None = None
) -> int:
    """Resume the gate `on` of a chain by its name: the first run of the chain that is
    parked at that gate gets `payload`, once (a run that rotated before parking there
    hands it to its successor, which parks there again through `reestablish`).

    Returns:
        Its position in the chain's inbox.

    Raises:
        ChainNotFoundError, ChainEndedError, InvalidArgumentError: as `send_to_chain`.
    """
    chain = check_chain(chain)
    return _post(
        engine,
        chain,
        kind="resume",
        name=_check_name(on, "gate"),
        key=_check_key(key),
        value=payload,
    )


def chain_runs(engine: Engine, chain: str) -> list[Execution]:
    """A chain's runs, first to current (a run deleted by retention left out).

    Raises:
        InvalidIdError: the chain's name is not valid.
    """
    chain = check_chain(chain)
    newest = current(engine, chain) or 0
    runs = []
    for number in range(1, newest + 1):
        try:
            runs.append(engine.get(run_id(chain, number)))
        except ExecutionNotFoundError:
            continue
    return runs


def current_run(engine: Engine, chain: str) -> Execution:
    """A chain's newest run: the one that receives what is sent to the chain now (or,
    once it has ended without rotating, its last).

    Raises:
        ChainNotFoundError: the chain has not been started.
        ChainEndedError: its last run ended and retention deleted it.
    """
    chain = check_chain(chain)
    number = current(engine, chain)
    if number is None:
        raise ChainNotFoundError(f"no chain {chain!r}: start it with start_chain")
    return _run(engine, chain, number)
