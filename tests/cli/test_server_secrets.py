"""``s3dcp server`` keeps its secret to its user: never on a command line, a private log, a state
directory only its user may write, and ``--print-env`` prints nothing but the variables a
server records."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time

import psutil
import pytest

from s3dcp.localserver import _start_mark

from cli_run import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "s3dcp.cli"]  # this checkout's CLI


def _cli_env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.pop("S3DCP_SERVER_SECRET_KEY", None)
    env.update(extra)
    return env


def _stop_all(env) -> None:
    subprocess.run([*CLI, "server", "--stop", "--all"], capture_output=True, text=True, env=env, timeout=120)


def _command_lines(pid: int) -> list[bytes]:
    """The command line of ``pid`` and of every process under it (the reaper and weed), as
    /proc/PID/cmdline shows them to every local user."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    lines = []
    for proc in procs:
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            lines.append(f.read())
    return lines


@pytest.mark.parametrize("how", ["--secret-key", "S3DCP_SERVER_SECRET_KEY"])
def test_the_background_servers_secret_is_on_no_command_line_and_its_log_is_private(tmp_path, how):
    """Before: the background server ran as ``python -m s3dcp.cli server ... --secret-key S``,
    readable by every user for its whole life; server.log (its export lines, the secret among
    them) had the umask's mode, 0644 here, and one left 0644 stayed so."""
    secret = f"not-on-argv-{os.getpid()}-{how[-3:]}"
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / "server.log").write_text("an earlier version's log\n")
    (state_dir / "server.log").chmod(0o644)
    if how == "--secret-key":
        env, argv = _cli_env(S3DCP_STATE_DIR=str(state_dir)), ["--secret-key", secret]
    else:
        env, argv = _cli_env(S3DCP_STATE_DIR=str(state_dir), S3DCP_SERVER_SECRET_KEY=secret), []
    try:
        done = subprocess.run([*CLI, "server", "--print-env", "--no-bucket", *argv], capture_output=True, text=True,
                              env=env, timeout=180)
        assert done.returncode == 0, done.stderr + (state_dir / "server.log").read_text()
        assert f"export AWS_SECRET_ACCESS_KEY={secret}" in done.stdout.splitlines()
        (state_file,) = state_dir.glob("server-*.json")
        state = json.loads(state_file.read_text())
        lines = _command_lines(state["pid"])
        assert len(lines) >= 3 and any(b"weed" in line for line in lines)  # the server, the reaper, weed
        assert not any(secret.encode() in line for line in lines), lines
        with open(f"/proc/{state['weed_pid']}/environ", "rb") as f:  # where it goes instead (this user's to read)
            weed_env = f.read().split(b"\0")
        assert f"AWS_SECRET_ACCESS_KEY={secret}".encode() in weed_env  # once: taken out of the server's own
        assert not any(v.startswith(b"S3DCP_SERVER_SECRET_KEY=") for v in weed_env)
        listed = subprocess.run([*CLI, "server", "--list", "--json"], capture_output=True, text=True, env=env,
                                timeout=60)
        assert listed.returncode == 0 and secret not in listed.stdout + listed.stderr
        assert oct((state_dir / "server.log").stat().st_mode & 0o777) == "0o600"
        assert oct(state_dir.stat().st_mode & 0o777) == "0o700"
    finally:
        _stop_all(env)


@pytest.mark.parametrize("case", ["others may write", "group may write", "another user's"])
def test_a_state_directory_another_user_could_write_is_refused(tmp_path, capsys, monkeypatch, case):
    """Before: used whoever owned it and whoever could write it; its files decide what
    ``--print-env`` prints for ``eval`` and which pid ``--stop`` signals."""
    state_dir = tmp_path / "shared"
    state_dir.mkdir()
    if case == "others may write":
        state_dir.chmod(0o1777)
    elif case == "group may write":
        state_dir.chmod(0o770)
    elif os.geteuid() == 0:
        state_dir.chmod(0o755)
        os.chown(state_dir, pwd.getpwnam("nobody").pw_uid, -1)
    else:
        state_dir = "/"  # root's: refused before anything is read or written
    monkeypatch.setenv("S3DCP_STATE_DIR", str(state_dir))
    try:
        for command in (["--list"], ["--stop", "--all"], ["--print-env", "--no-bucket"]):
            code, out, err = run_cli(capsys, "server", *command)
            reason = "belongs to uid" if case == "another user's" else "may be written by"
            assert code == 2 and out == "" and f"the s3dcp server state directory {state_dir} {reason}" in err, \
                (command, err)
        if str(state_dir) != "/":
            assert list(os.listdir(state_dir)) == []  # no server started, no log written
    finally:
        if str(state_dir) != "/":
            _stop_all(_cli_env(S3DCP_STATE_DIR=str(state_dir)))


@pytest.mark.parametrize("env", [
    {"AWS_REGION": "us-east-1", "X=1; touch PLANTED; Y": "v"},
    {"AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": ["not", "text"]},
    {},
])
def test_print_env_prints_nothing_but_the_variables_a_server_records(tmp_path, env):
    """Before: every name of the state file's ``env`` was printed as it was, so
    ``eval "$(s3dcp server --print-env)"`` ran what a planted name said."""
    marker = tmp_path / "PLANTED"
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    sleeper = subprocess.Popen(["sleep", "120"])  # a live process the state file names
    try:
        (state_dir / f"server-{sleeper.pid}.json").write_text(json.dumps(
            {"pid": sleeper.pid, "start_mark": _start_mark(sleeper.pid), "endpoint_url": "http://127.0.0.1:9",
             "buckets": [], "env": env, "started_at": time.time()}))
        shell = subprocess.run(["bash", "-c", 'cd "$1" && shift && eval "$("$@" server --print-env --no-bucket)"',
                                "_", str(tmp_path), *CLI], capture_output=True, text=True, timeout=60,
                               env=_cli_env(S3DCP_STATE_DIR=str(state_dir)))
        assert not marker.exists()
        assert "records variables other than AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID" in shell.stderr, shell.stderr
        done = subprocess.run([*CLI, "server", "--print-env", "--no-bucket"], capture_output=True, text=True,
                              timeout=60, env=_cli_env(S3DCP_STATE_DIR=str(state_dir)))
        assert done.returncode == 1 and done.stdout == ""
    finally:
        sleeper.kill()
        sleeper.wait()


def test_print_env_quotes_every_value(tmp_path):
    """The values a server records are printed quoted for the shell (the names are fixed)."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        (state_dir / f"server-{sleeper.pid}.json").write_text(json.dumps(
            {"pid": sleeper.pid, "start_mark": _start_mark(sleeper.pid), "endpoint_url": "http://127.0.0.1:9",
             "buckets": [], "started_at": time.time(),
             "env": {"AWS_REGION": "us-east-1", "AWS_SECRET_ACCESS_KEY": "a b'$(touch PLANTED)"}}))
        shell = subprocess.run(["bash", "-c", 'cd "$1" && shift && eval "$("$@" server --print-env --no-bucket)" '
                                '&& printf %s "$AWS_SECRET_ACCESS_KEY"', "_", str(tmp_path), *CLI],
                               capture_output=True, text=True, timeout=60, env=_cli_env(S3DCP_STATE_DIR=str(state_dir)))
        assert shell.returncode == 0 and shell.stdout == "a b'$(touch PLANTED)", shell.stderr
        assert not (tmp_path / "PLANTED").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
