"""S3Client.put_file: the CRT sends the first bytes of a shared-memory file, read by path, and
the request keeps the file until it ends."""

import dataclasses
import os

import pytest
import torch

from s3dcp.config import MiB
from s3dcp.memory.slabs import Slab
from s3dcp.s3.client import S3Client

from fault_proxy import Rule


@pytest.fixture
def config(s3_server):
    return s3_server.s3_config(part_size_bytes=5 * MiB)


def test_put_file_sends_the_first_bytes_of_a_longer_file(bucket, config, boto3_client):
    slab = Slab(16 * MiB, pinned=False)
    slab.buffer.copy_(torch.randint(0, 256, (16 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4)))
    client = S3Client(config)
    try:
        for key, n in [("multipart", 11 * MiB + 5), ("single", 3 * MiB + 1), ("empty", 0)]:
            assert client.put_file(bucket, key, slab.path, n, keep=slab).result().size == n
            body = boto3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
            assert body == slab.buffer[:n].numpy().tobytes(), key
    finally:
        client.close()


def test_an_upload_keeps_its_file_until_it_ends_whoever_lets_go_of_it(bucket, config, boto3_client, proxy):
    """The request holds the slab: the pool (and everyone else) dropping it mid-upload neither
    fails the upload nor lets the descriptor be reused; once it ends, the file is gone."""
    proxy.add_rule(Rule("delay", method="PUT", delay_s=1.5, times=3))
    cfg = dataclasses.replace(config, endpoint_url=proxy.endpoint_url)
    slab = Slab(12 * MiB, pinned=False)
    expected = torch.randint(0, 256, (12 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    slab.buffer.copy_(expected)
    path = slab.path
    client = S3Client(cfg)
    try:
        future = client.put_file(bucket, "held", path, 12 * MiB, keep=slab.storage)
        del slab  # nothing but the request holds the file now
        other = os.open("/dev/null", os.O_RDONLY)  # a descriptor opened meanwhile gets another number
        try:
            assert f"/proc/self/fd/{other}" != path
            future.result(timeout=60)
        finally:
            os.close(other)
    finally:
        client.close()
    assert boto3_client.get_object(Bucket=bucket, Key="held")["Body"].read() == expected.numpy().tobytes()
    assert not os.path.exists(path)  # the request let go of the last reference
