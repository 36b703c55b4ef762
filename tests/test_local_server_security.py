"""The local server (``SeaweedServer``, and so ``s3dcp server``) is reached through S3 and its
keys only: every other port weed opens refuses a local user without the secrets of this start,
and its files are its user's alone.

The other user is ``nobody`` when the tests run as root (as CI does); otherwise the probe runs
as this user, without the secrets, and the checks only another user can make (files,
/proc/PID/environ) are skipped, saying so.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest

from s3dcp.errors import ConfigError
from s3dcp.testing import SeaweedServer

from anonymous_probe import field, grpc_checks

PROBE = (Path(__file__).parent / "anonymous_probe.py").read_text()
ROOT = os.geteuid() == 0
# What answers anyone, by design (docs/security.md): status pages that name buckets, never objects.
STATUS_PAGES = ("master status page", "volume /status")


def _other_user() -> dict:
    """subprocess arguments that run a command as ``nobody`` (as root), else as this user."""
    if not ROOT:
        return {}
    nobody = pwd.getpwnam("nobody")
    return {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}


def _python_of_other_user() -> str:
    """A Python that user may run: this one, unless it lies where they cannot go (under /root)."""
    for python in (sys.executable, getattr(sys, "_base_executable", None), "/usr/bin/python3",
                   shutil.which("python3")):
        try:
            if python and subprocess.run([python, "-c", "pass"], cwd="/", timeout=60, **_other_user()).returncode == 0:
                return python
        except OSError:
            continue
    pytest.fail("no Python that uid nobody may run (needed to act as another local user)")


def _probe(server: SeaweedServer, bucket: str, key: str, paths=()) -> dict:
    """HTTP requests and file access, made by another user (see anonymous_probe.py)."""
    args = {"ports": server.ports, "bucket": bucket, "key": key, "paths": list(paths)}
    done = subprocess.run([_python_of_other_user(), "-I", "-c", PROBE, json.dumps(args)], capture_output=True,
                          text=True, timeout=300, cwd="/",
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/"}, **_other_user())
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def open_parent():
    """A directory every user may enter (as /tmp is), for a data dir whose own mode is what counts."""
    parent = tempfile.mkdtemp(prefix="s3dcp-open-")
    os.chmod(parent, 0o755)
    yield Path(parent)
    shutil.rmtree(parent, ignore_errors=True)


def test_only_the_s3_port_serves_a_user_without_the_servers_secrets(open_parent):
    """Before: the filer's HTTP port gave another user the object (GET 200), took a planted one
    (PUT 201) and deleted it (DELETE 204); the master's deleted a bucket's volumes
    (/col/delete 204); every gRPC port listed and deleted without credentials; a given --dir
    was 0755 with its files 0644. Now every one is refused, and the object is as it was."""
    key, data = "run/step-1/__0_0.distcp", os.urandom(100_000)
    with SeaweedServer(data_dir=str(open_parent / "data"), buckets=["guarded"]) as server:
        client = server.boto3_client()
        client.put_object(Bucket="guarded", Key=key, Body=data)
        tls_dir = Path(server.data_dir, "grpc-tls")
        sockets = [str(p) for p in Path(server.data_dir).glob("*.sock")] + [
            f"/tmp/seaweedfs-{name}-grpc-{server.ports[name + '.port.grpc']}.sock" for name in ("filer", "master")]
        files = [server.data_dir, str(tls_dir / "key.pem"), server.log_path, *sockets, f"/proc/{server.pid}/environ"]
        seen = _probe(server, "guarded", key, files)
        seen["grpc"] = grpc_checks(server.ports, "guarded", key)  # mutual TLS asks for a key, not a uid

        for label, (status, body) in seen["http"].items():
            if label in STATUS_PAGES:
                assert status == 200 and "step-1" not in body, (label, status, body[:200])
            else:
                assert status is None or status >= 400, (label, status, body[:200])
        for label, (code, details) in seen["grpc"].items():
            assert code == "UNAVAILABLE", (label, code, details)  # refused before any method is reached
        if ROOT:
            assert seen["uid"] != 0
            assert seen["files"] == {path: "PermissionError" for path in files}, seen["files"]
        else:
            print(f"not root: the probe ran as this user (uid {seen['uid']}); the file checks need another user")

        # The owner's view: nothing changed, nothing planted, and the gRPC refusal above was for want of the key.
        assert client.get_object(Bucket="guarded", Key=key)["Body"].read() == data
        assert [o["Key"] for o in client.list_objects_v2(Bucket="guarded")["Contents"]] == [key]
        credentials = grpc.ssl_channel_credentials((tls_dir / "cert.pem").read_bytes(),
                                                   (tls_dir / "key.pem").read_bytes(),
                                                   (tls_dir / "cert.pem").read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{server.ports['filer.port.grpc']}", credentials) as channel:
            listing = channel.unary_stream("/filer_pb.SeaweedFiler/ListEntries")(
                field(1, "/buckets/guarded/run/step-1"), timeout=30)
            assert b"__0_0.distcp" in b"".join(listing)
        # and none of the secrets is on a command line that every user can read
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{server.pid}/environ", "rb") as f:
            secrets = [v.partition(b"=")[2] for v in f.read().split(b"\0") if v.startswith((b"WEED_JWT", b"AWS_SECRET"))]
        assert len(secrets) == 5 and not any(s in cmdline for s in secrets)


def test_a_given_data_dir_is_made_private(tmp_path):
    """Before: a new --dir was made with the umask's mode (0755) and an old one left as it was."""
    new, old = tmp_path / "new", tmp_path / "old"
    old.mkdir(mode=0o755)
    old.chmod(0o755)
    for directory in (new, old):
        with SeaweedServer(data_dir=str(directory)) as server:
            assert stat.S_IMODE(os.stat(server.data_dir).st_mode) == 0o700
            assert stat.S_IMODE(os.stat(server.log_path).st_mode) == 0o600
        assert directory.is_dir()  # kept


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_data_dir_others_may_write_is_refused(tmp_path, mode):
    """Before: used as it was; whoever could write it could plant a security.toml or data files."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(ConfigError, match=r"may be written by (others|its group).*chmod go-w"):
        SeaweedServer(data_dir=str(shared)).start()
    assert stat.S_IMODE(shared.stat().st_mode) == mode and list(shared.iterdir()) == []


def test_a_data_dir_of_another_user_is_refused(tmp_path):
    """Before: used (and written into) whoever owned it."""
    if ROOT:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, pwd.getpwnam("nobody").pw_uid, -1)
    else:
        theirs = Path("/")  # root's: refused before anything is written
    with pytest.raises(ConfigError, match=r"belongs to uid \d+, not to you"):
        SeaweedServer(data_dir=str(theirs)).start()
    if ROOT:
        assert list(theirs.iterdir()) == []
