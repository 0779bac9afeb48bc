"""An idle worker on S3: the requests a real `Worker` (default settings, real clock)
makes per minute with nothing to do, by operation and by what it reads or writes
(the run index, the timer minutes, its own heartbeat, ...), and what a month of it
costs at AWS prices.

Run:

    python3 -m uv run python bench/bench_idle_worker.py                # 3 minutes, moto
    python3 -m uv run python bench/bench_idle_worker.py --minutes 10 --rgw

The store holds one finished run (so it is indexed) and nothing else. The first 30 s
of the worker (its start-up reads) are left out; then every request is counted, by
the stream its key names (its first path segment: `runs`, `timers`, `workers`, ...).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from typing import Any

from loom_kernel import Context, Engine, Worker, flow

#: AWS S3 Standard, us-east-1, per 1,000 requests: PUT, COPY, POST, LIST; GET.
COSTLY, CHEAP = 0.005, 0.0004
_CHEAP_OPERATIONS = {"GetObject", "HeadObject", "DeleteObject", "DeleteObjects"}


@flow(name="bench.idle")
def idle(ctx: Context, _input: Any) -> Any:
    return ctx.step("only", lambda: 1)


def _component(key: str) -> str:
    """What a key (or a listing's prefix) is about: its stream's first path segment."""
    if "!" not in key:
        return "(bucket)"
    rest = key.split("!", 1)[1]  # after the store prefix: SS/j/STREAM!..., or layout.json
    parts = rest.split("/", 2)
    if len(parts) < 3:
        return rest or "(store listing)"
    stream = parts[2].split("!", 1)[0]
    return (stream.split("/", 1)[0] or "(all streams)") + ("" if parts[1] == "j" else " (deleted)")


class _Counter:
    def __init__(self, client: Any) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        self.counting = False
        # Before the parameters are built: `params` are the call's own (Key, Prefix).
        client.meta.events.register("before-parameter-build.s3", self._count)

    def _count(self, model: Any, params: dict[str, Any], **_: Any) -> None:
        if self.counting:
            key = str(params.get("Key") or params.get("Prefix") or "")
            self.calls[(model.name, _component(key))] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--rgw", action="store_true", help="Ceph RGW instead of moto")
    args = parser.parse_args()
    from loom_store_s3.testing import MotoServer, RadosGateway

    server_class = RadosGateway if args.rgw else MotoServer
    with server_class() as server:
        client = server.client()
        store = server.store(client=client)
        counter = _Counter(client)
        engine = Engine(store, [idle], listeners=[])
        engine.start("bench.idle")
        worker = Worker(engine)
        worker.start()
        try:
            time.sleep(30)  # its start-up reads
            counter.counting = True
            began = time.monotonic()
            time.sleep(args.minutes * 60)
            counter.counting = False
            spent = (time.monotonic() - began) / 60
        finally:
            worker.stop()
        store.close()
    per_minute = {what: count / spent for what, count in counter.calls.items()}
    total = sum(per_minute.values())
    poll = worker.idle_poll
    print(f"## An idle worker on {server.name}, {spent:.1f} minutes (idle_poll {poll:g} s)")
    print("| operation | about | requests a minute |")
    print("| --- | --- | --- |")
    for (operation, component), rate in sorted(per_minute.items(), key=lambda item: -item[1]):
        print(f"| {operation} | {component} | {rate:.1f} |")
    cost = sum(
        rate * (CHEAP if operation in _CHEAP_OPERATIONS else COSTLY)
        for (operation, _component_name), rate in per_minute.items()
    )
    month = 30 * 24 * 60
    print(f"total: {total:.1f} requests a minute; ${cost * month / 1000:.2f} for 30 days")


if __name__ == "__main__":
    main()
