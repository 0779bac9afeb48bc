"""A process that sends messages to the run `inbox` (run as a script by the message
process tests):

    python message_process.py MODE STORE_URL SIDE_FILE [ARG]

Modes:
- `send-then-die MESSAGE`: send MESSAGE, then SIGKILL itself after the inbox append
  landed and before the run was woken.
- `send-and-drive-die-on MESSAGE`: send "m1", "m2", "m3" (each wakes and drives the
  run), dying inside the step after MESSAGE is received.
- `sender NAME COUNT`: send COUNT keyed messages "NAME-i" (each twice, as a
  notifier retrying would), waiting on a start file first so two senders race.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from loom_kernel import Engine, open_store
from loom_kernel._engine import parts_of
from message_flow import consume


def main() -> int:
    mode, url, side = sys.argv[1:4]
    store = open_store(url)
    if mode == "send-then-die":
        engine = Engine(store, [consume(Path(side))], listeners=[])
        parts_of(engine).delivery.deliver = lambda _id: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign,assignment,misc]
        engine.send("inbox", sys.argv[4], key=sys.argv[4])
        return 1  # never reached
    if mode == "send-and-drive-die-on":
        engine = Engine(store, [consume(Path(side), die_on=sys.argv[4])], listeners=[])
        for message in ("m1", "m2", "m3"):
            engine.send("inbox", message, key=message)
        return 0
    if mode == "sender":
        name, count = sys.argv[4], int(sys.argv[5])
        engine = Engine(store, [consume(Path(side))], listeners=[])
        start = Path(side + ".go")
        deadline = time.monotonic() + 60
        while not start.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        for index in range(count):
            for _ in range(2):
                engine.send("inbox", f"{name}-{index}", key=f"{name}-{index}")
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main())
