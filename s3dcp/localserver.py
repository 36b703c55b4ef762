"""``s3dcp server``: a local S3 server to try s3dcp with, and how any shell finds it.

    s3dcp server                          run here until Ctrl-C; creates s3://demo, prints its env
    eval "$(s3dcp server --print-env)"    in any shell: that server's AWS_* variables (when none
                                          runs, one is started in the background first; the
                                          buckets asked for, s3://demo by default, are created
                                          on it when missing)
    s3dcp server --stop                   stop it

The server is :class:`s3dcp.testing.SeaweedServer` (SeaweedFS ``weed mini`` on 127.0.0.1). A
running ``s3dcp server`` records its pid, endpoint and keys in a state file that only its
user can read (``$S3DCP_STATE_DIR``, else ``$XDG_RUNTIME_DIR/s3dcp``, else ``~/.cache/s3dcp``;
``server.json``), which ``--print-env`` and ``--stop`` read; it removes the file when it
stops. The keys are those of this throwaway server only: printing them is the point.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from contextlib import suppress
from typing import Any, Sequence

__all__ = ["DEFAULT_BUCKET", "state_path", "running_server", "run", "print_env", "stop"]

DEFAULT_BUCKET = "demo"
_DETACH_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 30.0
_POLL_S = 0.5


def state_path() -> str:
    """Where a running ``s3dcp server`` records how to reach it."""
    base = os.environ.get("S3DCP_STATE_DIR") or os.path.join(
        os.environ.get("XDG_RUNTIME_DIR") or os.path.expanduser("~/.cache"), "s3dcp")
    return os.path.join(base, "server.json")


def running_server() -> dict[str, Any] | None:
    """The state of the ``s3dcp server`` that runs now (``pid``, ``env``, ``buckets``...), or None.

    A state file whose process is gone (killed with SIGKILL) is removed.
    """
    path = state_path()
    try:
        with open(path) as f:
            state = json.load(f)
        pid = int(state["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not _alive(pid):
        with suppress(OSError):
            os.unlink(path)
        return None
    return state


def run(*, buckets: Sequence[str], data_dir: str | None, port: int | None, access_key: str,
        secret_key: str | None) -> int:
    """Run a server in the foreground until Ctrl-C or SIGTERM; exit status 0, or 1 if weed failed."""
    from .errors import ConfigError
    from .testing import SeaweedServer, SeaweedStartError

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a normal exit: the finally stops weed
    server = SeaweedServer(data_dir=data_dir, access_key=access_key, secret_key=secret_key, s3_port=port)
    path = state_path()
    other = running_server()
    try:
        server.start()
        _create_buckets(server, buckets)  # a kept --dir may hold them already
        _write_state(path, {"pid": os.getpid(), "weed_pid": server.pid, "endpoint_url": server.endpoint_url,
                            "buckets": list(buckets), "data_dir": server.data_dir, "env": server.env()})
        kept = "kept" if data_dir else "deleted on exit"
        print(f"# SeaweedFS S3 on {server.endpoint_url} (pid {os.getpid()}), data in {server.data_dir} ({kept})")
        if other is not None:
            print(f"# note: another s3dcp server (pid {other['pid']}) runs on {other['endpoint_url']}; "
                  "--print-env now names this one")
        print('# In another shell: eval "$(s3dcp server --print-env)"   or paste:')
        for key, value in server.env().items():
            print(f"export {key}={shlex.quote(value)}")
        for name in buckets:
            print(f"# bucket: s3://{name}")
        print("# Ctrl-C to stop.", flush=True)
        while server.pid is not None:  # None once weed has exited
            time.sleep(_POLL_S)
        print(f"s3dcp: error: the server (weed) exited unexpectedly; its log ends:\n{_tail(server.log_path)}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except (SeaweedStartError, ConfigError) as e:
        print(f"s3dcp: error: {e}", file=sys.stderr)
        return 1
    finally:
        _forget_state(path, os.getpid())
        server.stop()


def print_env(*, buckets: Sequence[str], data_dir: str | None, port: int | None, access_key: str,
              secret_key: str | None) -> int:
    """Print ``export`` lines for the running server, starting one in the background if none runs.

    ``buckets`` are made sure of: a server that runs already gets those it lacks (created
    there and recorded in its state file), so ``--print-env --bucket X`` always leaves
    ``s3://X`` in place, or fails saying why (exit status 1).
    """
    state = running_server()
    created: list[str] = []
    if state is None:
        state = _start_detached(buckets=buckets, data_dir=data_dir, port=port, access_key=access_key,
                                secret_key=secret_key)
        started = "started"
    else:
        started = "running"
        try:
            created = _create_missing_buckets(state, buckets)
        except Exception as e:  # noqa: BLE001 - botocore's errors: say which server and bucket
            print(f"s3dcp: error: could not create bucket(s) {', '.join(f's3://{b}' for b in buckets)} on the "
                  f"running s3dcp server (pid {state['pid']}, {state['endpoint_url']}): {type(e).__name__}: {e}; "
                  "stop it (s3dcp server --stop) and start it again", file=sys.stderr)
            return 1
    for key, value in state["env"].items():
        print(f"export {key}={shlex.quote(value)}")
    sys.stdout.flush()
    names = ", ".join(f"s3://{b}" for b in state.get("buckets", [])) or "none (s3dcp mb s3://NAME)"
    made = f" (created now: {', '.join(f's3://{b}' for b in created)})" if created else ""
    print(f"# s3dcp server {started}: pid {state['pid']}, {state['endpoint_url']}, bucket(s) {names}{made}; "
          "stop it with: s3dcp server --stop", file=sys.stderr)
    return 0


def stop() -> int:
    """Stop the running server (SIGTERM to its pid, then wait for it to clean up)."""
    state = running_server()
    if state is None:
        print("s3dcp: no s3dcp server is running", file=sys.stderr)
        return 0
    pid = int(state["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    while _alive(pid):
        if time.monotonic() > deadline:
            print(f"s3dcp: error: server pid {pid} did not stop within {_STOP_TIMEOUT_S:g} s", file=sys.stderr)
            return 1
        time.sleep(0.1)
    print(f"stopped s3dcp server pid {pid} ({state['endpoint_url']})", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------- internals
def _start_detached(*, buckets, data_dir, port, access_key, secret_key) -> dict[str, Any]:
    """Start ``s3dcp server`` in its own session, logging to server.log; wait for its state file."""
    from .errors import S3DCPError

    argv = [sys.executable, "-m", "s3dcp.cli", "server", "--access-key", access_key]
    for name in buckets:
        argv += ["--bucket", name]
    if not buckets:
        argv += ["--no-bucket"]
    for flag, value in (("--dir", data_dir), ("--port", port), ("--secret-key", secret_key)):
        if value is not None:
            argv += [flag, str(value)]
    path = state_path()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    log_path = os.path.join(os.path.dirname(path), "server.log")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # outlives this command and its terminal
    deadline = time.monotonic() + _DETACH_TIMEOUT_S
    while True:
        state = running_server()
        if state is not None and int(state["pid"]) == proc.pid:
            return state
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.terminate()
            raise S3DCPError(f"the background s3dcp server did not start; see its log {log_path}")
        time.sleep(0.1)


def _create_missing_buckets(state: dict[str, Any], buckets: Sequence[str]) -> list[str]:
    """Create on the running server (``state``) those of ``buckets`` it lacks; record every one
    in ``state`` and its file. Returns the names created."""
    if not buckets:
        return []
    import boto3
    from botocore.config import Config

    env = state["env"]
    client = boto3.session.Session().client(
        "s3", endpoint_url=state["endpoint_url"], region_name=env.get("AWS_REGION", "us-east-1"),
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}, proxies={}, retries={"max_attempts": 2}))
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    created = [name for name in buckets if name not in existing]
    for name in created:
        client.create_bucket(Bucket=name)
    known = list(state.get("buckets", []))
    if any(name not in known for name in buckets):
        state["buckets"] = known + [name for name in buckets if name not in known]
        current = running_server()
        if current is not None and current["pid"] == state["pid"]:  # its file lists what --print-env names
            _write_state(state_path(), state)
    return created


def _create_buckets(server, buckets: Sequence[str]) -> None:
    if not buckets:
        return
    client = server.boto3_client()
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    for name in buckets:
        if name not in existing:
            client.create_bucket(Bucket=name)


def _tail(path: str | None, lines: int = 40) -> str:
    try:
        with open(path or "", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def _write_state(path: str, state: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    partial = f"{path}.{os.getpid()}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    os.replace(partial, path)


def _forget_state(path: str, pid: int) -> None:
    """Remove the state file if it is still ours (a newer server may have replaced it)."""
    with suppress(OSError, ValueError, KeyError, TypeError):
        with open(path) as f:
            if int(json.load(f)["pid"]) == pid:
                os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True  # no /proc (macOS): kill(0) is all we know
