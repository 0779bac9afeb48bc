"""A process that drives one run through a slow step (run as a script, by the ownership
tests):

    python ownership_worker.py STORE_URL SIDE_FILE FLAG_FILE

The step appends "slow" to SIDE_FILE (its side effect), then waits while FLAG_FILE
exists; a second step follows.
"""

from __future__ import annotations

import sys
from pathlib import Path

from loom_kernel import Engine, open_store
from ownership_flow import slow_then_after


def main() -> int:
    url, side, flag = sys.argv[1:4]
    engine = Engine(open_store(url), [slow_then_after(Path(side), Path(flag))])
    print(engine.worker_id, flush=True)
    done = engine.start("slow_then_after", key="own")
    return 0 if done.status.value == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
