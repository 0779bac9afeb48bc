"""Where the process tests run their `loom worker` processes: a SQLite file, or a
bucket on the Ceph RGW the session started (the `rgw_server` fixture)."""

from __future__ import annotations

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
