"""The ``weed`` process of a :class:`s3dcp.testing.SeaweedServer`, seen from outside: the ports
and unix sockets it takes (:func:`pick_ports`, :func:`socket_paths`), and its life
(:class:`WeedProcess`): started under the *reaper* shell, stopped and cleaned up on every path —
``stop()``, garbage collection, interpreter exit, and the death of the process that started it
(SIGKILL, a crash), when nobody in Python is left to clean up.

Must not know what the server is for: no S3, no buckets, no credentials, no weed flags but the
ports and sockets it takes. Those, and when to start and stop, are :mod:`s3dcp.testing`'s.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
from contextlib import ExitStack, suppress

from .errors import ConfigError

# weed mini's servers that take ports: flags -<name>.port and -<name>.port.grpc.
_SERVERS = ("master", "volume", "filer", "s3", "admin")
# The embedded maintenance worker dials the admin server at admin.port + 10000 whatever
# -admin.port.grpc says (weed 4.48), so the admin gRPC port is always pinned to that.
_GRPC_OFFSET = 10000
_STOP_GRACE_S = 10.0
MAX_UNIX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux

# The reaper: `sh -c _REAPER reaper GRACE_S OWNED_DIR SOCKET... -- WEED ARGS...`. It starts weed,
# prints weed's pid on its stdout (then closes it), and forwards SIGTERM (a stop) to weed. On
# SIGHUP (the starter died: see _die_with_this_thread; trappable even under nohup: see
# reaper_command) it stops weed too, SIGKILLs it if it is
# still running GRACE_S (whole) seconds later (nobody else will: weed's volume server waits ~30 s
# for the connections of a killed client, and a SIGTERM that reaches weed before its exec is
# lost), and deletes OWNED_DIR (empty: none). Once weed has
# exited it removes the sockets and exits with weed's status. Signals may come before weed is
# started: the traps are set first and checked after.
_REAPER = r"""
grace=$1; owned=$2; shift 2
sockets=
while [ "$#" -gt 0 ] && [ "$1" != -- ]; do sockets="$sockets $1"; shift; done
shift
weed=; stopping=; orphaned=; timer=
stop() {
    stopping=1
    if [ -z "$weed" ]; then return; fi
    kill -TERM "$weed" 2>/dev/null
    if [ -n "$orphaned" ] && [ -z "$timer" ]; then
        # Polls rather than waits to be killed: a signal that reaches a subshell before it has
        # reset the traps it forked with is lost. Ends by itself within 1 s of weed's end.
        (i=0
         while kill -0 "$weed"; do
             if [ "$i" -ge "$grace" ]; then kill -KILL "$weed"; break; fi
             sleep 1
             i=$((i + 1))
         done) >/dev/null 2>&1 &
        timer=$!
    fi
}
trap stop TERM
trap 'orphaned=1; stop' HUP
"$@" >&2 &
weed=$!
echo "$weed"
exec >&-
if [ -n "$stopping" ]; then stop; fi
while :; do
    wait "$weed"
    status=$?
    kill -0 "$weed" 2>/dev/null || break  # wait returns early when a trap runs
done
if [ -n "$timer" ]; then kill "$timer" 2>/dev/null; fi  # usually ends it at once (see stop)
rm -f $sockets
if [ -n "$orphaned" ] && [ -n "$owned" ]; then rm -rf "$owned"; fi
exit "$status"
"""


# Runs the reaper with SIGHUP and SIGTERM at their default dispositions, whatever it inherited.
# A POSIX shell cannot trap a signal that was ignored when it started, and jobs are often
# started with SIGHUP ignored (`nohup python -m pytest ...`, some schedulers): the reaper would
# then never learn of its starter's death and weed would outlive it with its data dir. Also
# undoes what Python itself ignores at startup (SIGPIPE, SIGXFSZ), which an exec would pass on.
_DEFAULT_DISPOSITIONS = (
    "import os, signal, sys\n"
    "for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE, signal.SIGXFSZ):\n"
    "    signal.signal(s, signal.SIG_DFL)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


def reaper_command(grace_s: float, owned_dir: str | None, sockets: list[str]) -> list[str]:
    """The reaper's command line, to be followed by weed's (see :data:`_REAPER`), its signal
    dispositions reset first (see :data:`_DEFAULT_DISPOSITIONS`)."""
    return [sys.executable, "-I", "-S", "-c", _DEFAULT_DISPOSITIONS,
            "/bin/sh", "-c", _REAPER, "s3dcp-weed-reaper", f"{grace_s:g}", owned_dir or "", *sockets, "--"]


def pick_ports(s3_port: int | None = None) -> dict[str, int]:
    """Distinct free loopback ports for every server weed mini opens, keyed by flag name.

    All sockets stay bound until every port is chosen, so no two picks collide.
    """
    ports: dict[str, int] = {}
    with ExitStack() as stack:

        def grab(port: int = 0) -> int | None:
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return None
            return s.getsockname()[1]

        for server in _SERVERS:
            if server == "admin":  # needs port and port + 10000 (see _GRPC_OFFSET)
                while True:
                    port = grab()
                    if port + _GRPC_OFFSET <= 65535 and grab(port + _GRPC_OFFSET):
                        break
                ports["admin.port"], ports["admin.port.grpc"] = port, port + _GRPC_OFFSET
            elif server == "s3" and s3_port:
                if grab(s3_port) is None:
                    raise ConfigError(f"S3 port {s3_port} on 127.0.0.1 is in use")
                ports["s3.port"] = s3_port
                ports["s3.port.grpc"] = grab()
            else:
                ports[f"{server}.port"] = grab()
                ports[f"{server}.port.grpc"] = grab()
    return ports


def socket_paths(ports: dict[str, int], data_dir: str) -> list[str]:
    """The unix sockets weed mini creates outside its data dir (paths hard-coded in weed 4.x)."""
    paths = [f"/tmp/seaweedfs-{server}-grpc-{ports[server + '.port.grpc']}.sock"
             for server in _SERVERS]
    if len(os.path.join(data_dir, "filer.sock")) > MAX_UNIX_SOCKET_PATH:  # see SeaweedServer._command
        paths += [f"/tmp/seaweedfs-filer-{ports['filer.port']}.sock",
                  f"/tmp/seaweedfs-s3-{ports['s3.port']}.sock"]
    return paths


def _die_with_this_thread() -> list[str]:
    """A command prefix that sends the reaper SIGHUP if the process that started the server dies
    without stopping it (SIGKILL, a crash): `setpriv --pdeathsig` (util-linux); the reaper then
    stops weed and removes what it left. The signal follows the *thread* that started it, so
    only the main thread asks for it; elsewhere, or without setpriv, nothing (stop() and the
    exit hook still apply)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return []
    return [setpriv, "--pdeathsig", "HUP", "--"]


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM to the reaper (which passes it on to weed), wait up to 10 s (weed takes a few
    to close its listeners), then SIGKILL to both (they are a process group of their own)."""
    if proc.poll() is None:
        try:
            proc.terminate()
            proc.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class WeedProcess:
    """The process and temporary dir of one server: what its finalizer must clean up. Holds no
    reference to the server, so that the server's finalizer may hold this."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None  # the reaper (weed's parent)
        self.weed_pid: int | None = None
        self.owned_dir: str | None = None  # a data dir we created, so ours to delete
        self.sockets: list[str] = []  # unix sockets weed leaves in /tmp

    def start(self, command: list[str], *, cwd: str, env: dict[str, str], log_path: str) -> None:
        """Run ``command`` (weed) under the reaper, its output appended to ``log_path``, and
        learn weed's pid. Set :attr:`owned_dir` and :attr:`sockets` first: the reaper removes
        them."""
        reaper = reaper_command(_STOP_GRACE_S, self.owned_dir, self.sockets)
        with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            self.proc = subprocess.Popen(
                _die_with_this_thread() + reaper + command,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,  # the reaper prints weed's pid, then closes it
                stderr=log,
                start_new_session=True,  # Ctrl-C in a terminal must not kill it before cleanup
                umask=0o077,  # what weed makes (data, sockets, logs) is its user's alone
            )
        with self.proc.stdout as out:
            line = out.readline().strip()
        self.weed_pid = int(line) if line.isdigit() else None

    def stop(self) -> None:
        """Stop weed (see :func:`_terminate`) and remove the sockets it left; idempotent."""
        if self.proc is not None:
            _terminate(self.proc)
            self.proc = None
            self.weed_pid = None
        # The reaper removed these, unless it was killed; then they are ours to remove.
        for path in self.sockets:
            with suppress(OSError):
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
        self.sockets = []

    def cleanup(self) -> None:
        """:meth:`stop`, then delete the data dir if it is ours (the server's finalizer)."""
        self.stop()
        if self.owned_dir:
            shutil.rmtree(self.owned_dir, ignore_errors=True)
            self.owned_dir = None
