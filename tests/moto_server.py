"""moto's S3 server (``moto[server]``) in a child process on 127.0.0.1: the suite's second,
independent S3 implementation beside SeaweedFS.

    with MotoServer() as server:
        config = server.s3_config(part_size_bytes=5 * MiB)
        server.create_bucket("b")

The child is started with a parent-death signal (SIGTERM when the test process dies without
stopping it, e.g. killed), in a session of its own, and stopped by its pid. moto accepts any
credentials: the keys here only make every request SigV4-signed as it would be for AWS.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from s3dcp.config import S3Config

_PR_SET_PDEATHSIG = 1
_START_TIMEOUT_S = 60.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """moto's standalone server, stopped by :meth:`stop` (or at the test process's death)."""

    access_key_id = "moto-test-key"
    secret_access_key = "moto-test-secret"
    region = "us-east-1"

    def __init__(self) -> None:
        self.port = 0
        self._process: subprocess.Popen | None = None
        self._log = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "MotoServer":
        for _ in range(3):  # a port taken between picking and binding: pick another
            self.port = _free_port()
            self._log = tempfile.TemporaryFile(prefix="moto-")
            self._process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent, start_new_session=True)
            if self._wait_ready():
                return self
            why = self.log_tail()
            self.stop()
        raise RuntimeError(f"moto's server did not start on 127.0.0.1 (is moto[server] installed?): {why}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=2):
                    return True
            except OSError:
                time.sleep(0.1)
        return False

    def log_tail(self, lines: int = 30) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return "\n".join(self._log.read().decode(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def s3_config(self, **changes) -> S3Config:
        return S3Config(endpoint_url=self.endpoint_url, region=self.region, access_key_id=self.access_key_id,
                        secret_access_key=self.secret_access_key, **changes)

    def boto3_client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=self.region,
                            aws_access_key_id=self.access_key_id, aws_secret_access_key=self.secret_access_key,
                            config=Config(s3={"addressing_style": "path"}))

    def create_bucket(self, name: str) -> None:
        self.boto3_client().create_bucket(Bucket=name)

    def __enter__(self) -> "MotoServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
