"""What the chain tests share: flows that receive and rotate, and the reading of which
chain items each run received, in the order it received them."""

from __future__ import annotations

from typing import Any

from loom_kernel import Context, Engine, Woken, flow
from loom_orchestration import Suspension, chain_runs, reestablish, rotate
from loom_orchestration._chains._routing import FORWARD_KEY


@flow(name="chain.pairs", version="1")
def pairs(ctx: Context, run: dict[str, Any]) -> Any:
    """Receives two messages on "a", then rotates with them added to its carry; ends
    once the carry holds `limit` (the first run's carry is `{"limit": L, "got": []}`)."""
    carry = run["carry"]
    got = [*carry["got"], *(ctx.receive("a") for _ in range(2))]
    if len(got) >= carry["limit"]:
        return got
    return rotate(ctx, {"limit": carry["limit"], "got": got})


@flow(name="chain.mixed", version="1")
def mixed(ctx: Context, run: dict[str, Any]) -> Any:
    """Receives `per_run` messages on topics "a" or "b" (whichever comes first), then
    rotates; never ends (the chain goes on as long as messages come)."""
    for _ in range(run["carry"]["per_run"]):
        ctx.wait_first(topics=["a", "b"])
    return rotate(ctx, run["carry"])


@flow(name="chain.relay", version="1")
def relay(ctx: Context, run: dict[str, Any]) -> Any:
    """Run 1 waits for "go" and rotates; the successor receives "sig", publishes it,
    and parks for ever at "more" (a live successor)."""
    if run["n"] == 1:
        ctx.receive("go")
        return rotate(ctx, {"from": 1})
    ctx.set_event("sig", ctx.receive("sig"))
    return ctx.receive("more")


@flow(name="chain.gated", version="1")
def gated(ctx: Context, run: dict[str, Any]) -> Any:
    """Run 1 rotates at once, handing on the gate "approve" with the deadline in its
    carry; its successor parks there again and returns what came first."""
    if run["n"] == 1:
        deadline = run["carry"]["deadline"]
        return rotate(ctx, run["carry"], suspensions=[Suspension("approve", deadline)])
    woken: Woken | None = reestablish(ctx, run)  # type: ignore[assignment]
    assert woken is not None
    return {"kind": woken.kind, "name": woken.name, "value": woken.value}


FLOWS = [pairs, mixed, relay, gated]


def receipts(engine: Engine, chain: str) -> list[tuple[str, int]]:
    """The chain items each run received, as (run id, chain position), in receipt
    order: run by run, each run's in the order its journal took them."""
    found = []
    for run in chain_runs(engine, chain):
        # Through the keys: a message the run read may be compacted out of its inbox.
        keys = {sent.position: key for key, sent in engine.inbox_keys(run.id).items()}
        for resume_key in engine.state(run.id).resume_keys:
            if resume_key.startswith("loom.inbox:"):
                key = keys.get(int(resume_key.removeprefix("loom.inbox:")))
            else:
                key = resume_key
            if key is not None and key.startswith(FORWARD_KEY):
                found.append((run.id, int(key.removeprefix(FORWARD_KEY))))
    return found
