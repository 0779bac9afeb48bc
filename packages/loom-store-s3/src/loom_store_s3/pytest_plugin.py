"""pytest fixtures for local S3 servers: `moto_server`, `rgw_server` and `s3_server`.

Enable with ``pytest_plugins = ["loom_store_s3.pytest_plugin"]`` in a conftest.py
(needs the `testing` extra). moto runs in a thread of each test process. Ceph RGW
is one cluster per process that needs it; with pytest-xdist's ``--dist loadgroup``
every test that uses it goes to one worker (xdist_group "rgw"). Where Ceph is not
installed (scripts/install-rgw installs it), those tests skip and say why.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from loom_store_s3.testing import MotoServer, RadosGateway, S3Server

__all__ = ["moto_server", "pytest_collection_modifyitems", "rgw_server", "s3_server"]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Send every test that uses Ceph RGW to one worker, so one cluster serves them all."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        parameters = callspec.params if callspec is not None else {}
        if "rgw" in (
            parameters.get("s3_server"),
            parameters.get("target"),
        ) or "rgw_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("rgw"))


@pytest.fixture(scope="session")
def moto_server() -> Iterator[S3Server]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="session")
def rgw_server() -> Iterator[S3Server]:
    missing = RadosGateway.missing()
    if missing:
        pytest.skip(
            f"SKIPPED LOUDLY: Ceph RGW is not installed (missing {', '.join(missing)}); "
            "run scripts/install-rgw (as root) to test the S3 store on a real S3 server"
        )
    with RadosGateway() as server:
        yield server


@pytest.fixture(params=["moto", "rgw"])
def s3_server(request: pytest.FixtureRequest) -> S3Server:
    """Each S3 test runs twice: on moto and on Ceph RGW."""
    server: S3Server = request.getfixturevalue(f"{request.param}_server")
    return server
