"""Local S3 servers for tests: moto's server mode and a one-node Ceph RADOS Gateway.

Both bind 127.0.0.1 on free ports and stop with the object (use them as context
managers). `RadosGateway` needs Ceph's Debian packages (radosgw, ceph-mon,
ceph-osd): `scripts/install-rgw` installs them; `RadosGateway.missing()` says what
is absent so a test can skip with a reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from loom_store_s3._options import S3Options
from loom_store_s3._store import S3Store

__all__ = [
    "MotoServer",
    "RadosGateway",
    "RequestCounter",
    "S3Server",
    "free_port",
    "strip_expect_header",
]

_RGW_PROGRAMS = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def strip_expect_header(request: Any, **_: Any) -> None:
    """botocore before-send hook: drop `Expect: 100-continue` (it costs moto ~12 ms a PUT)."""
    request.headers.pop("Expect", None)


class RequestCounter:
    """Counts the requests a boto3 S3 client sends, by operation (for tests and benchmarks)."""

    def __init__(self, client: Any) -> None:
        self.calls: Counter[str] = Counter()
        client.meta.events.register("before-call.s3", self._count)

    def _count(self, model: Any, **_: Any) -> None:
        self.calls[model.name] += 1

    def take(self) -> dict[str, int]:
        """The counts since the last take(), by operation name; then start again."""
        calls = dict(self.calls)
        self.calls.clear()
        return calls


def _wait_http(url: str, deadline: float) -> None:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):  # noqa: S310 - a local test server
                return
        except urllib.error.HTTPError:
            return  # it answered
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class S3Server:
    """A running local S3 endpoint with credentials that it accepts."""

    endpoint_url: str
    access_key = "loomtest"
    secret_key = "loomtestsecret"  # noqa: S105 - a throwaway local server
    name = "s3"
    #: moto lists a prefix by scanning the whole bucket, so give each store its own.
    bucket_per_store = False

    def client(self, **config: Any) -> Any:
        """A boto3 client for this server with botocore's retries off (as the store needs)."""
        settings: dict[str, Any] = {
            "retries": {"total_max_attempts": 1},
            "s3": {"addressing_style": "path"},
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
            "connect_timeout": 5,
            "read_timeout": 10,
            "max_pool_connections": 32,
        }
        settings.update(config)
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(**settings),
        )
        client.meta.events.register("before-send.s3", strip_expect_header)
        return client

    def store(self, client: Any = None, **options: Any) -> Any:
        """A new, empty S3Store under a fresh prefix of this server's shared bucket.

        Args:
            client: the store's boto3 client (a shared one by default).
            **options: S3Options fields.
        """
        if getattr(self, "_shared", None) is None:
            self._shared = (self.new_bucket(), self.client())
        bucket, shared_client = self._shared
        if self.bucket_per_store:
            bucket = self.new_bucket()
        defaults: dict[str, Any] = {"shards": 2, "endpoint_url": self.endpoint_url}
        defaults.update(options)
        prefix = f"t/{uuid.uuid4().hex[:12]}"
        return S3Store(bucket, prefix, S3Options(**defaults), client=client or shared_client)

    def reopen(self, store: Any) -> Any:
        """A new S3Store instance over the same bucket and prefix as `store`."""
        store.close()
        return S3Store(store.bucket, store.prefix, store.options, client=self._shared[1])

    def twin(self, store: Any, client: Any = None) -> Any:
        """Another S3Store over the same data as `store` (another process, say)."""
        return S3Store(store.bucket, store.prefix, store.options, client=client or self._shared[1])

    def new_bucket(self) -> str:
        """Create a bucket with a fresh name and return the name."""
        name = f"loom-{uuid.uuid4().hex[:20]}"
        client = self._shared[1] if getattr(self, "_shared", None) else self.client()
        client.create_bucket(Bucket=name)
        return name

    def environment(self) -> dict[str, str]:
        """Environment variables that point boto3 in a child process at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class MotoServer(S3Server):
    """moto's S3 server in a thread of this process.

    moto's If-None-Match is check-then-act without a lock, so it is not a fair judge
    of races: run race tests against RadosGateway too.
    """

    name = "moto"
    bucket_per_store = True

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer  # noqa: PLC0415 - the optional 'testing' extra

        port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        self.endpoint_url = f"http://127.0.0.1:{port}"
        _wait_http(self.endpoint_url, time.monotonic() + 15)

    def stop(self) -> None:
        self._server.stop()


class RadosGateway(S3Server):
    """A one-node Ceph cluster (one monitor, one in-memory OSD) and radosgw, auth off.

    Started from scratch in a temporary directory in about ten seconds; stop()
    kills the daemons and removes the directory.
    """

    name = "rgw"

    @staticmethod
    def missing() -> list[str]:
        """The Ceph programs this machine lacks (empty when RadosGateway can start)."""
        return [program for program in _RGW_PROGRAMS if shutil.which(program) is None]

    def __init__(self, startup_timeout: float = 45.0, tries: int = 5) -> None:
        absent = self.missing()
        if absent:
            raise RuntimeError(
                f"Ceph RGW is not installed (missing {', '.join(absent)}): run scripts/install-rgw"
            )
        # A fresh one-node cluster now and then fails to register its OSD ("wrong
        # fsid" in the OSD log); starting over from scratch is the cure.
        for attempt in range(tries):
            try:
                self._boot(startup_timeout)
                return
            except RuntimeError:
                if attempt + 1 == tries:
                    raise

    def _boot(self, startup_timeout: float) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="loom-rgw-"))
        self._processes: list[subprocess.Popen[bytes]] = []
        self._deadline = time.monotonic() + startup_timeout
        try:
            self._start()
        except BaseException as exc:
            logs = self._log_tails()
            self.stop()
            raise RuntimeError(f"Ceph RGW did not start: {exc}\n{logs}") from exc

    def _log_tails(self) -> str:
        tails = []
        for log in sorted((self._dir / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            tails.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(tails)

    def _conf(self, mon_port: int, rgw_port: int, fsid: str) -> Path:
        d = self._dir
        conf = d / "ceph.conf"
        conf.write_text(
            f"""[global]
fsid = {fsid}
mon host = v1:127.0.0.1:{mon_port}
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = true
run dir = {d}/run
admin socket = {d}/run/$name.$pid.asok
log file = {d}/log/$name.log
pid file = {d}/run/$name.pid
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon max pg per osd = 1000
mon allow pool size one = true
mon warn on pool no redundancy = false
osd objectstore = memstore
memstore device bytes = 2147483648
ms bind ipv6 = false
ms bind msgr2 = false
keyring = {d}/keyring
[mon.a]
mon data = {d}/mon.a
[osd.0]
osd data = {d}/osd.0
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
rgw data = {d}/rgw
rgw dns name = 127.0.0.1
"""
        )
        return conf

    def _run(self, *command: str) -> str:
        remaining = max(5.0, self._deadline - time.monotonic())
        result = subprocess.run(  # noqa: S603 - fixed Ceph programs, our own arguments
            command, capture_output=True, timeout=remaining, check=False, cwd=self._dir
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} failed ({result.returncode}): "
                f"{result.stderr.decode(errors='replace')[-2000:]}"
            )
        return result.stdout.decode()

    def _spawn(self, *command: str) -> None:
        process = subprocess.Popen(  # noqa: S603 - fixed Ceph programs, our own arguments
            [*command, "-f"],
            cwd=self._dir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._processes.append(process)

    def _start(self) -> None:
        d = self._dir
        for sub in ("run", "log", "mon.a", "osd.0", "rgw"):
            (d / sub).mkdir()
        fsid = str(uuid.uuid4())
        mon_port, rgw_port = free_port(), free_port()
        conf = str(self._conf(mon_port, rgw_port, fsid))
        self._run(
            "monmaptool",
            "--create",
            "--addv",
            "a",
            f"[v1:127.0.0.1:{mon_port}]",
            "--fsid",
            fsid,
            str(d / "monmap"),
        )
        self._run("ceph-mon", "-c", conf, "--mkfs", "-i", "a", "--monmap", str(d / "monmap"))
        self._spawn("ceph-mon", "-c", conf, "-i", "a")
        ceph = ("ceph", "-c", conf, "--connect-timeout", "20")
        osd_uuid = str(uuid.uuid4())
        osd_id = self._run(*ceph, "osd", "new", osd_uuid).strip()
        self._run("ceph-osd", "-c", conf, "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid)
        self._spawn("ceph-osd", "-c", conf, "-i", osd_id)
        self._wait_osd_up(ceph)
        self._spawn("radosgw", "-c", conf, "-n", "client.rgw")
        self.endpoint_url = f"http://127.0.0.1:{rgw_port}"
        _wait_http(self.endpoint_url, self._deadline)
        self._run(
            "radosgw-admin",
            "-c",
            conf,
            "-n",
            "client.rgw",
            "user",
            "create",
            "--uid=loom",
            "--display-name=loom",
            f"--access-key={self.access_key}",
            f"--secret={self.secret_key}",
        )
        self._wait_ready()

    def _wait_osd_up(self, ceph: tuple[str, ...]) -> None:
        """Until the OSD reports up; an OSD that failed to register never will, so a
        short deadline lets the caller start over instead of waiting for radosgw."""
        deadline = min(self._deadline, time.monotonic() + 20)
        last = "no answer yet"
        while time.monotonic() < deadline:
            try:
                dump = json.loads(self._run(*ceph, "osd", "dump", "--format", "json"))
            except RuntimeError as exc:  # a monitor just started can refuse a command
                last = str(exc)
            else:
                if any(osd.get("up") == 1 for osd in dump.get("osds", [])):
                    return
            time.sleep(0.3)
        raise RuntimeError(f"the OSD did not come up ({last})")

    def _wait_ready(self) -> None:
        """Until a bucket can be created and written (the OSD may still be peering)."""
        while True:
            try:
                client = self.client()
                bucket = self.new_bucket()
                client.put_object(Bucket=bucket, Key="probe", Body=b"x")
                return
            except Exception:
                if time.monotonic() > self._deadline:
                    raise
                time.sleep(0.3)

    def stop(self) -> None:
        for process in self._processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        self._processes.clear()
        shutil.rmtree(self._dir, ignore_errors=True)
