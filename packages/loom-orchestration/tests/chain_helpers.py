"""What the chain tests share: flows that receive and rotate, and the reading of which
chain items each run received, in the order it received them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from loom_kernel import Context, Engine, Woken, flow
from loom_kernel.spi import JournalStore, NewRecord, Record
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
        keys = {m.position: m.key for m in engine.inbox(run.id)}
        for resume_key in engine.state(run.id).resume_keys:
            if resume_key.startswith("loom.inbox:"):
                key = keys.get(int(resume_key.removeprefix("loom.inbox:")))
            else:
                key = resume_key
            if key is not None and key.startswith(FORWARD_KEY):
                found.append((run.id, int(key.removeprefix(FORWARD_KEY))))
    return found


class Crash(BaseException):
    """The victim's process dies here."""


class DyingStore(JournalStore):
    """`inner` until call `at`, which dies before it reaches the store or after it
    landed (`after`); every call after a death dies too."""

    def __init__(
        self, inner: JournalStore, at: int, *, after: bool, as_it_dies: Callable[[], None]
    ) -> None:
        self.inner, self.at, self.after, self.as_it_dies = inner, at, after, as_it_dies
        self.head_is_cheap = inner.head_is_cheap  # type: ignore[misc]
        self.max_record_bytes = inner.max_record_bytes
        self.calls = 0
        self.dead = False
        self._lock = threading.Lock()

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            if self.dead:
                raise Crash
            self.calls += 1
            dies = self.calls == self.at
        if dies and not self.after:
            self._die()
        result = method(*args)
        if dies:
            self._die()
        return result

    def _die(self) -> None:
        with self._lock:
            self.dead = True
        self.as_it_dies()
        raise Crash

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        return int(self._call(self.inner.append, stream, expected, list(records)))

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        found: list[Record] = self._call(self.inner.read, stream, after, limit)
        return found

    def _head(self, stream: str) -> int:
        return int(self._call(self.inner.head, stream))

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        found: list[str] = self._call(self.inner.streams, prefix, after, limit)
        return found

    def _trim(self, stream: str, before: int) -> None:
        self._call(self.inner.trim, stream, before)

    def _delete(self, stream: str) -> None:
        self._call(self.inner.delete, stream)
