"""Where the process tests run their `loom worker` processes: a SQLite file, or a
bucket on the Ceph RGW the session started (the `rgw_server` fixture)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from loom_kernel import open_store
from loom_store_s3.testing import S3Server


@attrs.frozen
class Target:
    """A store the test and its worker processes share: its URL, and the environment
    a process needs to reach it."""

    kind: str
    url: str
    environment: dict[str, str]


def make_target(request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> Target:
    """The target `request.param` names ("sqlite" or "rgw"), fresh for the test."""
    if request.param == "sqlite":
        db = tmp_path / "loom.db"
        open_store(f"sqlite://{db}").close()
        return Target("sqlite", f"sqlite://{db}?timeout=30", {})
    server: S3Server = request.getfixturevalue("rgw_server")
    bucket = server.new_bucket()
    url = f"s3://{bucket}/{prefix}?endpoint_url={server.endpoint_url}"
    return Target("rgw", url, server.environment())


def loom_worker(
    target: Target,
    environment: dict[str, str],
    log: Path,
    flows: str,
    *,
    concurrency: int = 8,
    lease: float = 2.0,
    grace: float = 5.0,
    queues: str | None = None,
) -> subprocess.Popen[bytes]:
    """A `loom worker` process on the target, its stderr appended to `log`."""
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "loom_kernel", "worker", "--store", target.url),
            *("--flows", flows, *(("--queues", queues) if queues else ())),
            *("--concurrency", str(concurrency), "--lease", str(lease)),
            *("--idle-poll", "0.1", "--grace", str(grace)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("ab"),
        env=environment,
    )
