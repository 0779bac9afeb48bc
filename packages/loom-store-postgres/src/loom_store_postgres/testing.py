"""A throwaway PostgreSQL cluster for tests: `initdb` into a temporary directory and
`pg_ctl start` on 127.0.0.1 at a free port, stopped and removed by `stop()`.

Run as root (a CI container), the cluster's programs run as the `postgres` user,
which Debian's package makes (`initdb` refuses root). scripts/install-postgres
installs the server.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

from loom_store_postgres._store import PostgresStore

__all__ = ["PostgresServer", "find_programs"]

_PROGRAMS = ("initdb", "pg_ctl")


def find_programs() -> Path | None:
    """The folder holding PostgreSQL's `initdb` and `pg_ctl`: on the PATH, or the newest
    of Debian's /usr/lib/postgresql/<version>/bin; None when neither has them."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda path: (
            int(Path(path).parent.parent.name) if Path(path).parent.parent.name.isdigit() else 0
        ),
    )
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class PostgresServer:
    """A PostgreSQL cluster of its own, for tests and benchmarks.

    Args:
        fsync: whether the server syncs its WAL (off for tests: a killed server
            process loses nothing the kernel's page cache holds; on for benchmarks).
        max_connections: the server's connection limit.
    """

    def __init__(self, *, fsync: bool = False, max_connections: int = 400) -> None:
        bin_dir = find_programs()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL is not installed: run scripts/install-postgres")
        self._bin = bin_dir
        self._user: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError(
                    "running as root, the cluster needs the 'postgres' user (Debian's "
                    "package makes it): run scripts/install-postgres"
                ) from None
            self._user = "postgres"
        self.port = _free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="loom-pg-"))
        self.data = self.directory / "data"
        self.log = self.directory / "server.log"
        self._settings = (
            f"-h 127.0.0.1 -p {self.port} -k {self.directory} "
            f"-c fsync={'on' if fsync else 'off'} -c max_connections={max_connections} "
            "-c shared_buffers=64MB"
        )
        if self._user is not None:
            shutil.chown(self.directory, self._user)
        try:
            self._run(
                "initdb", "-D", str(self.data), "-U", "loom", "--auth=trust",
                "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions",
            )  # fmt: skip
            self.start()
        except BaseException:
            self._remove()
            raise

    def _run(self, program: str, *args: str, check: bool = True) -> None:
        result = subprocess.run(  # noqa: S603 - PostgreSQL's own programs
            [str(self._bin / program), *args],
            capture_output=True,
            user=self._user,
            cwd=self.directory,
            check=False,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{program} failed ({result.returncode}): {result.stderr.decode(errors='replace')}"
                f"\n{self._log_tail()}"
            )

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return ""

    @property
    def url(self) -> str:
        """The `postgresql:` URL of the cluster's `postgres` database (no schema)."""
        return f"postgresql://loom@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        """Start the server (again, after `stop_immediately`) and wait until it serves."""
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", self._settings,
            "-w", "-t", "60", "start",
        )  # fmt: skip

    def stop_immediately(self) -> None:
        """`pg_ctl stop -m immediate`: the server quits without a checkpoint, as a crash
        would; it recovers from its WAL at the next `start`."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def store_url(self, schema: str | None = None, **options: Any) -> str:
        """A store URL in a fresh schema (or `schema`), with more store `options`."""
        schema = schema or f"t_{uuid.uuid4().hex[:16]}"
        query = "&".join([f"schema={schema}", *(f"{k}={v}" for k, v in options.items())])
        return f"{self.url}?{query}"

    def store(self, schema: str | None = None, **options: Any) -> PostgresStore:
        """A store in a fresh, empty schema (or in `schema`)."""
        from loom_store_postgres import open_postgres_store  # noqa: PLC0415 - a cycle

        return open_postgres_store(self.store_url(schema, **options))

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        self._remove()

    def _remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
