"""``s3dcp server``: a local S3 server to try s3dcp with, and how any shell finds it.

    s3dcp server                          run here until Ctrl-C; creates s3://demo, prints its env
    eval "$(s3dcp server --print-env)"    in any shell: that server's AWS_* variables (when none
                                          runs, one is started in the background first; the
                                          buckets asked for, s3://demo by default, are created
                                          on it when missing)
    s3dcp server --list                   every server that runs, the buckets it has (asked with
                                          ListBuckets), and which one the others name
    s3dcp server --stop                   stop it (--pid P: that one; --all: every one)

The server is :class:`s3dcp.testing.SeaweedServer` (SeaweedFS ``weed mini`` on 127.0.0.1). Every
running ``s3dcp server`` records its pid, endpoint and keys in a state file of its own that only
its user can read (``$S3DCP_STATE_DIR``, else ``$XDG_RUNTIME_DIR/s3dcp``, else ``~/.cache/s3dcp``;
``server-PID.json``) and removes it when it stops. ``--print-env`` and ``--stop`` name the newest
server that runs (or the one ``--pid`` names); when it stops, they name the one started before it
again, so a second server never hides the first. A state file whose process is gone is removed,
and so is one whose pid now names another process (after a reboot, or once pids wrap): each
file records its server's start (the boot's id and ``/proc/PID/stat``'s start time; ``ps``'s
start time where there is no ``/proc``), and a process that started otherwise is never signalled.
The keys are those of these throwaway servers only: printing them is the point. ``--print-env``
prints what the state files say as shell commands, so a state directory another user owns or
others may write is refused, and only :data:`ENV_NAMES` are printed (values quoted). The
directory is 0700, the background server's ``server.log`` (its ``export`` lines) 0600, and a
``--secret-key`` reaches that server through its environment (:data:`SECRET_KEY_ENV`), never its
command line, which every local user can read.

The background server (``--print-env`` when none runs) runs the very ``s3dcp`` package of the
command that starts it, from the state directory and with Python's ``-P`` where it exists: a
folder named ``s3dcp`` in the current directory (a clone) cannot shadow it.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from contextlib import suppress
from typing import Any, Sequence

from ._private_dir import private_dir

__all__ = ["DEFAULT_BUCKET", "ENV_NAMES", "SECRET_KEY_ENV", "state_dir", "servers", "running_server", "run",
           "print_env", "list_servers", "stop"]

DEFAULT_BUCKET = "demo"
ENV_NAMES = ("AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")  # SeaweedServer.env()
SECRET_KEY_ENV = "S3DCP_SERVER_SECRET_KEY"  # the secret, kept off command lines
_DETACH_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 30.0
_POLL_S = 0.5
_LEGACY_NAME = "server.json"  # the single state file of earlier versions: still read, never written


def state_dir() -> str:
    """The directory where every running ``s3dcp server`` records how to reach it."""
    return os.environ.get("S3DCP_STATE_DIR") or os.path.join(
        os.environ.get("XDG_RUNTIME_DIR") or os.path.expanduser("~/.cache"), "s3dcp")


def _state_path(pid: int) -> str:
    return os.path.join(state_dir(), f"server-{pid}.json")


def _private_state_dir(*, create: bool) -> str | None:
    """:func:`state_dir`, made 0700 if missing and ``create`` (else None when missing); refused
    (ConfigError) when another user owns it or others may write it."""
    return private_dir(state_dir(), what="the s3dcp server state directory", create=create)


def servers() -> list[dict[str, Any]]:
    """The state of every ``s3dcp server`` that runs now, oldest first (``pid``, ``env``,
    ``endpoint_url``, ``buckets``, ``data_dir``, ``started_at``...). State files whose process is
    gone (killed with SIGKILL) are removed."""
    found = []
    directory = _private_state_dir(create=False)
    if directory is None:
        return []
    paths = glob.glob(os.path.join(glob.escape(directory), "server-*.json"))
    paths.append(os.path.join(directory, _LEGACY_NAME))
    for path in paths:
        try:
            with open(path) as f:
                state = json.load(f)
            pid = int(state["pid"])
            state.setdefault("started_at", os.stat(path).st_mtime)
            state["state_file"] = path
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if not _alive(pid) or not _same_process(pid, state):
            with suppress(OSError):
                os.unlink(path)
            continue
        found.append(state)
    return sorted(found, key=lambda s: (float(s["started_at"]), int(s["pid"])))


def running_server(pid: int | None = None) -> dict[str, Any] | None:
    """The server that ``--print-env`` and ``--stop`` name: the one with ``pid``, else the newest
    that runs; None when there is none."""
    running = servers()
    if pid is not None:
        return next((s for s in running if int(s["pid"]) == pid), None)
    return running[-1] if running else None


def run(*, buckets: Sequence[str], data_dir: str | None, port: int | None, access_key: str,
        secret_key: str | None) -> int:
    """Run a server in the foreground until Ctrl-C or SIGTERM; exit status 0, or 1 if weed failed."""
    from .errors import ConfigError
    from .testing import SeaweedServer, SeaweedStartError

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a normal exit: the finally stops weed
    server = SeaweedServer(data_dir=data_dir, access_key=access_key, secret_key=secret_key, s3_port=port)
    path = _state_path(os.getpid())
    others = servers()
    try:
        server.start()
        _create_buckets(server, buckets)  # a kept --dir may hold them already
        _write_state(path, {"pid": os.getpid(), "weed_pid": server.pid, "endpoint_url": server.endpoint_url,
                            "buckets": list(buckets), "data_dir": server.data_dir, "env": server.env(),
                            "started_at": time.time(), "start_mark": _start_mark(os.getpid())})
        kept = "kept" if data_dir else "deleted on exit"
        print(f"# SeaweedFS S3 on {server.endpoint_url} (pid {os.getpid()}), data in {server.data_dir} ({kept})")
        if others:
            listed = ", ".join(f"pid {s['pid']} on {s['endpoint_url']}" for s in others)
            print(f"# note: {len(others)} other s3dcp server(s) run ({listed}); --print-env and --stop now name "
                  f"this one, and pid {others[-1]['pid']} again once this one stops (s3dcp server --list)")
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
        with suppress(OSError):
            os.unlink(path)
        server.stop()


def print_env(*, buckets: Sequence[str], data_dir: str | None, port: int | None, access_key: str,
              secret_key: str | None, pid: int | None = None) -> int:
    """Print ``export`` lines for the newest running server (or the one with ``pid``), starting
    one in the background if none runs.

    ``buckets`` are made sure of: a server that runs already gets those it lacks (created
    there and recorded in its state file), so ``--print-env --bucket X`` always leaves
    ``s3://X`` in place, or fails saying why (exit status 1).
    """
    state = running_server(pid)
    created: list[str] = []
    if state is None and pid is not None:
        print(f"s3dcp: error: no s3dcp server with pid {pid} runs ({_running_pids()}; s3dcp server --list)",
              file=sys.stderr)
        return 1
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
    exports = _exports(state)
    if exports is None:
        print(f"s3dcp: error: the state file {state.get('state_file')} records variables other than "
              f"{', '.join(ENV_NAMES)} (or values that are not text), which no s3dcp server writes; nothing "
              "printed. Remove the file (or stop that server with s3dcp server --stop) and run this again",
              file=sys.stderr)
        return 1
    print(exports)
    sys.stdout.flush()
    names = ", ".join(f"s3://{b}" for b in state.get("buckets", [])) or "none (s3dcp mb s3://NAME)"
    made = f" (created now: {', '.join(f's3://{b}' for b in created)})" if created else ""
    count = len(servers())
    which = f"; {count} servers run, this is the newest (s3dcp server --list)" if count > 1 and pid is None else ""
    print(f"# s3dcp server {started}: pid {state['pid']}, {state['endpoint_url']}, bucket(s) {names}{made}{which}; "
          f"stop it with: s3dcp server --stop{' --pid ' + str(state['pid']) if pid is not None else ''}",
          file=sys.stderr)
    return 0


def list_servers(*, as_json: bool = False) -> int:
    """Print every running server, oldest first; the newest is the one ``--print-env`` names.
    The buckets are the server's own (ListBuckets: those made with ``s3dcp mb`` or any client
    too); a server that does not answer shows those its state file recorded, marked so."""
    running = servers()
    for state in running:
        live = _live_buckets(state)
        state["buckets_from"] = "recorded" if live is None else "server"
        state["buckets"] = list(state.get("buckets", [])) if live is None else live
    if as_json:
        json.dump([{key: s.get(key) for key in ("pid", "endpoint_url", "buckets", "buckets_from", "data_dir",
                                                "started_at")}
                   | {"named": i == len(running) - 1} for i, s in enumerate(running)], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if not running:
        print("s3dcp: no s3dcp server is running", file=sys.stderr)
        return 0
    rows = [["*" if i == len(running) - 1 else "", str(s["pid"]), s["endpoint_url"],
             (",".join(s["buckets"]) or "-") + (" (recorded; no answer)" if s["buckets_from"] == "recorded" else ""),
             s.get("data_dir") or "-", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(s["started_at"])))]
            for i, s in enumerate(running)]
    header = ["", "PID", "ENDPOINT", "BUCKETS", "DATA", "STARTED"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print("# *: the one --print-env and --stop name (the newest)", file=sys.stderr)
    return 0


def _live_buckets(state: dict[str, Any]) -> list[str] | None:
    """The buckets the server of ``state`` has (ListBuckets), or None when it does not answer."""
    try:
        return sorted(b["Name"] for b in _client(state, timeout_s=5).list_buckets().get("Buckets", []))
    except Exception:  # noqa: BLE001 - botocore's errors, a dead server: the recorded list is shown instead
        return None


def stop(*, pid: int | None = None, all_servers: bool = False) -> int:
    """Stop the server ``--print-env`` names (or the one with ``pid``, or every one): SIGTERM to
    its pid, then wait for it to clean up. Says which stopped and which still run."""
    running = servers()
    if all_servers:
        targets = running[::-1]
    else:
        one = running_server(pid)
        targets = [one] if one is not None else []
    if not targets:
        if pid is not None:
            print(f"s3dcp: error: no s3dcp server with pid {pid} runs ({_running_pids()})", file=sys.stderr)
            return 1
        print("s3dcp: no s3dcp server is running", file=sys.stderr)
        return 0
    code = 0
    for state in targets:
        target = int(state["pid"])
        with suppress(ProcessLookupError):
            os.kill(target, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        while _alive(target) and time.monotonic() <= deadline:
            time.sleep(0.1)
        if _alive(target):
            print(f"s3dcp: error: server pid {target} did not stop within {_STOP_TIMEOUT_S:g} s", file=sys.stderr)
            code = 1
        else:
            print(f"stopped s3dcp server pid {target} ({state['endpoint_url']})", file=sys.stderr)
    left = servers()
    if left:
        print(f"# still running: {_running_pids(left)}; --print-env and --stop now name pid {left[-1]['pid']}",
              file=sys.stderr)
    return code


# ---------------------------------------------------------------------- internals
def _exports(state: dict[str, Any]) -> str | None:
    """The ``export`` lines of ``state``'s variables, or None when it records a name that is
    not one of :data:`ENV_NAMES` or a value that is not a string (printed for ``eval``, so
    nothing else may pass; values quoted for the shell)."""
    env = state.get("env")
    if type(env) is not dict or not env or any(k not in ENV_NAMES or type(v) is not str for k, v in env.items()):
        return None
    return "\n".join(f"export {key}={shlex.quote(value)}" for key, value in env.items())


def _running_pids(running: list[dict[str, Any]] | None = None) -> str:
    running = servers() if running is None else running
    return ", ".join(f"pid {s['pid']} on {s['endpoint_url']}" for s in running) or "none runs"


def _start_detached(*, buckets, data_dir, port, access_key, secret_key) -> dict[str, Any]:
    """Start ``s3dcp server`` in its own session, logging to server.log; wait for its state file.

    It runs this very s3dcp package: its parent directory leads PYTHONPATH, the current directory
    is the state directory and Python's ``-P`` (3.11+) keeps the working directory off sys.path,
    so a folder named ``s3dcp`` where the user stands (a clone) cannot shadow it.
    """
    from .errors import S3DCPError

    isolate = ["-P"] if sys.version_info >= (3, 11) else []
    argv = [sys.executable, *isolate, "-m", "s3dcp.cli", "server", "--access-key", access_key]
    for name in buckets:
        argv += ["--bucket", name]
    if not buckets:
        argv += ["--no-bucket"]
    if data_dir is not None:
        data_dir = os.path.abspath(data_dir)  # it runs from the state directory
    for flag, value in (("--dir", data_dir), ("--port", port)):
        if value is not None:
            argv += [flag, str(value)]
    directory = _private_state_dir(create=True)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != SECRET_KEY_ENV}
    if secret_key is not None:
        env[SECRET_KEY_ENV] = secret_key  # its environment, which only this user can read; never argv
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    log_path = os.path.join(directory, "server.log")
    # It holds the server's export lines, the secret among them: this user's alone, whatever the
    # umask, also when an earlier version left it 0644.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o600)
    os.fchmod(fd, 0o600)
    with open(fd, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=directory, start_new_session=True)  # outlives this command and its terminal
    deadline = time.monotonic() + _DETACH_TIMEOUT_S
    while True:
        state = running_server(proc.pid)
        if state is not None:
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
    client = _client(state)
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    created = [name for name in buckets if name not in existing]
    for name in created:
        client.create_bucket(Bucket=name)
    known = list(state.get("buckets", []))
    if any(name not in known for name in buckets):
        state["buckets"] = known + [name for name in buckets if name not in known]
        if running_server(int(state["pid"])) is not None and state.get("state_file"):
            _write_state(state["state_file"], state)  # its file lists what --print-env names
    return created


def _client(state: dict[str, Any], *, timeout_s: float | None = None):
    """A boto3 client for the running server of ``state`` (its endpoint and keys, path-style)."""
    import boto3
    from botocore.config import Config

    env = state["env"]
    timeouts = {} if timeout_s is None else {"connect_timeout": timeout_s, "read_timeout": timeout_s}
    return boto3.session.Session().client(
        "s3", endpoint_url=state["endpoint_url"], region_name=env.get("AWS_REGION", "us-east-1"),
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}, proxies={}, retries={"max_attempts": 2}, **timeouts))


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
    state = {key: value for key, value in state.items() if key != "state_file"}
    _private_state_dir(create=True)
    partial = f"{path}.{os.getpid()}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    os.replace(partial, path)


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


def _start_mark(pid: int) -> str | None:
    """What tells process ``pid`` from a later one given the same pid: the boot's id and the
    process's start in clock ticks since boot (``/proc/PID/stat`` field 22); where there is no
    ``/proc`` (macOS), ``ps``'s start time (to the second); None when neither can say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        with open(f"/proc/{pid}/stat") as f:
            return f"{boot}:{f.read().rpartition(')')[2].split()[19]}"  # fields from the 3rd on, after the name
    except (OSError, IndexError):
        pass
    if os.path.isdir("/proc/self"):
        return None
    try:
        done = subprocess.run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return f"ps:{done.stdout.strip()}" if done.returncode == 0 and done.stdout.strip() else None


def _same_process(pid: int, state: dict[str, Any]) -> bool:
    """Whether live process ``pid`` is the server that wrote ``state``: the same start, or,
    in a state file of an earlier version (no start recorded), a command line naming s3dcp.
    Where neither can be read, only the pid is known: it is trusted."""
    recorded = state.get("start_mark")
    if recorded is not None:
        now = _start_mark(pid)
        return now is None or now == recorded
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"s3dcp" in f.read()
    except OSError:
        return True
