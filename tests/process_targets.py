"""Where the process tests run their `loom worker` processes: a SQLite file, a bucket
on the Ceph RGW the session started (the `rgw_server` fixture), or a schema of the
session's PostgreSQL cluster (`postgres_server`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from loom_kernel import open_store
from loom_store_postgres.testing import PostgresServer
from loom_store_s3.testing import S3Server


@attrs.frozen
class Target:
    """A store the test and its worker processes share: its URL, and the environment
    a process needs to reach it."""

    kind: str
    url: str
    environment: dict[str, str]


def make_target(request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> Target:
    """The target `request.param` names ("sqlite", "rgw" or "postgres"), fresh for the test."""
    if request.param == "sqlite":
        db = tmp_path / "loom.db"
        open_store(f"sqlite://{db}").close()
        return Target("sqlite", f"sqlite://{db}?timeout=30", {})
    if request.param == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        url = server.store_url()
        open_store(url).close()  # the schema made before any race
        return Target("postgres", url, {})
    s3: S3Server = request.getfixturevalue("rgw_server")
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/{prefix}?endpoint_url={s3.endpoint_url}"
    return Target("rgw", url, s3.environment())


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


def python_path(folder: Path) -> str:
    """A child process's PYTHONPATH: `folder` (its flows), then this process's own, so
    a child runs the source this process runs (the mutation sampler's copy of it)."""
    return os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
