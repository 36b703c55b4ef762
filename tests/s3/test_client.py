"""s3dcp.s3.client against the real SeaweedFS server: round trips, ranges, conditions, listing,
and errors that say what went wrong."""

import os
import pickle
import time
from dataclasses import replace
from urllib.parse import urlsplit

import pytest

from fault_proxy import FaultProxy, Rule
from s3dcp.s3.client import S3Client
from s3dcp.s3.request import abort_and_wait
from s3dcp.config import MiB
from s3dcp.errors import (
    AccessDeniedError,
    IntegrityError,
    NoSuchBucketError,
    NoSuchKeyError,
    PreconditionFailedError,
    RequestAbortedError,
    S3ConnectionError,
)

PART = 5 * MiB


@pytest.fixture
def client(s3_server):
    return S3Client(s3_server.s3_config(part_size_bytes=PART))


@pytest.mark.parametrize("size", [0, 1, PART - 1, PART, PART + 1, 3 * PART + 12345])
def test_round_trip_is_byte_exact(client, bucket, size):
    data = os.urandom(size)
    result = client.put(bucket, f"obj/{size}", data).result()
    assert result.size == size
    assert client.head(bucket, f"obj/{size}").result().size == size
    out = bytearray(size)
    assert client.get_range_into(bucket, f"obj/{size}", 0, out).result() == size
    assert out == data
    assert client.get(bucket, f"obj/{size}").result() == data


def test_large_object_round_trip(client, bucket):
    data = os.urandom(200 * MiB)
    etag = client.put(bucket, "big", memoryview(data)).result().etag
    assert etag and "-" in etag  # went multipart
    out = bytearray(len(data))
    client.get_range_into(bucket, "big", 0, out).result()
    assert out == data


def test_put_sends_several_buffers_back_to_back(client, bucket):
    parts = [os.urandom(n) for n in (3, 0, PART + 7, 11)]
    client.put(bucket, "joined", parts).result()
    assert client.get(bucket, "joined").result() == b"".join(parts)


def test_ranged_reads_at_object_edges(client, bucket):
    data = os.urandom(2 * PART + 100)
    client.put(bucket, "edges", data).result()
    for offset, length in [(0, 1), (len(data) - 1, 1), (PART - 3, 6), (PART, PART), (7, len(data) - 7)]:
        out = bytearray(length)
        client.get_range_into(bucket, "edges", offset, out).result()
        assert out == data[offset:offset + length], (offset, length)
    assert client.get_range_into(bucket, "edges", 5, bytearray(0)).result() == 0


def test_reading_past_the_end_is_an_integrity_error(client, bucket):
    client.put(bucket, "short", b"12345").result()
    for offset in (0, 5, 100):  # runs off the end; starts at it; starts past it (S3 and moto: 416)
        with pytest.raises(IntegrityError, match="shorter than its metadata says"):
            client.get_range_into(bucket, "short", offset, bytearray(10)).result()


def test_scatter_read_fills_each_sink_and_skips_holes(client, bucket):
    data = os.urandom(1000)
    client.put(bucket, "scatter", data).result()
    a, b = bytearray(100), bytearray(50)
    client.get_scatter(bucket, "scatter", 100, 500, [(100, a), (450, b)]).result()
    assert a == data[100:200] and b == data[450:500]


def test_conditional_put_refuses_an_existing_key(client, bucket):
    client.put(bucket, "once", b"first", if_none_match=True).result()
    with pytest.raises(PreconditionFailedError) as e:
        client.put(bucket, "once", b"second", if_none_match=True).result()
    assert e.value.status == 412 and e.value.key == "once" and e.value.bucket == bucket
    assert client.get(bucket, "once").result() == b"first"


def test_listing_past_one_page_and_batched_delete(client, bucket):
    keys = [f"many/{i:04d}" for i in range(25)] + ["other/x"]
    for k in keys:
        client.put(bucket, k, k.encode()).result()
    objects, prefixes = client.list(bucket, "many/", page_size=7).result()
    assert [o.key for o in objects] == keys[:25] and prefixes == []
    assert all(o.size == len(o.key) for o in objects)
    _, prefixes = client.list(bucket, "", delimiter="/", page_size=1).result()
    assert prefixes == ["many/", "other/"]
    client.delete(bucket, keys[:25]).result()
    assert client.list(bucket, "many/").result() == ([], [])
    client.delete(bucket, ["never-existed"]).result()  # missing keys are not an error


def test_keys_with_special_characters(client, bucket):
    key = "run 1/step=10/ü+%&?#[x].bin"
    client.put(bucket, key, b"x").result()
    assert client.get(bucket, key).result() == b"x"
    assert [o.key for o in client.list(bucket, "run 1/").result()[0]] == [key]


def test_missing_bucket_and_missing_key_are_distinct(client, bucket):
    with pytest.raises(NoSuchKeyError) as e:
        client.get(bucket, "nope").result()
    assert e.value.status == 404 and e.value.code == "NoSuchKey" and e.value.request_id
    assert f"s3://{bucket}/nope" in str(e.value)
    with pytest.raises(NoSuchKeyError):
        client.head(bucket, "nope").result()
    with pytest.raises(NoSuchBucketError) as e:
        client.get("no-such-bucket-xyz", "k").result()
    assert "no-such-bucket-xyz" in str(e.value) and "create the bucket" in str(e.value)
    with pytest.raises(NoSuchBucketError):
        client.head("no-such-bucket-xyz", "k").result()
    with pytest.raises(NoSuchBucketError):  # not auto-created on upload
        client.put("no-such-bucket-xyz", "k", b"data").result()


def test_wrong_secret_is_access_denied_with_status(s3_server, bucket):
    bad = S3Client(s3_server.s3_config(secret_access_key="definitely-wrong-secret"))
    with pytest.raises(AccessDeniedError) as e:
        bad.put(bucket, "k", b"x").result()
    assert e.value.status == 403 and "403" in str(e.value)
    assert "definitely-wrong-secret" not in str(e.value)


def test_refused_connection_is_a_connection_error(s3_server):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = S3Client(s3_server.s3_config(endpoint_url=f"http://127.0.0.1:{port}", max_retries=1))
    with pytest.raises(S3ConnectionError, match="endpoint is reachable"):
        dead.get("bucket", "k").result()


def test_multipart_uploads_list_and_abort(client, bucket, boto3_client):
    up = boto3_client.create_multipart_upload(Bucket=bucket, Key="dangling")
    uploads = client.list_uploads(bucket).result()
    assert [(u.key, u.upload_id) for u in uploads] == [("dangling", up["UploadId"])]
    client.abort_upload(bucket, "dangling", up["UploadId"]).result()
    assert client.list_uploads(bucket).result() == []
    client.abort_upload(bucket, "dangling", up["UploadId"]).result()  # already gone: fine


def test_client_pickles_without_its_native_handle(client, bucket):
    client.put(bucket, "p", b"v").result()
    clone = pickle.loads(pickle.dumps(client))
    assert clone.get(bucket, "p").result() == b"v"
    assert "secret" not in repr(clone).lower()


def test_abort_stops_a_request_in_flight_and_one_still_queued(s3_server, bucket, boto3_client):
    """The server holds every part for 60 s. A multipart PUT in flight and a PUT queued behind
    it (max_concurrency=1) are aborted: both fail at once, the queued one never reaches the
    server, the multipart upload is aborted, and the client works on afterwards."""
    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port) as proxy:
        client = S3Client(replace(s3_server.s3_config(part_size_bytes=PART), endpoint_url=proxy.endpoint_url,
                                  max_concurrency=1))
        proxy.add_rule(Rule("delay", method="PUT", query_has="partNumber", delay_s=60))
        big = client.put(bucket, "big", bytearray(3 * PART))
        queued = client.put(bucket, "queued", b"small")
        deadline = time.monotonic() + 30
        while not any("partNumber=" in r.target for r in proxy.requests):
            assert time.monotonic() < deadline, "the multipart upload never sent a part"
            time.sleep(0.05)
        assert not big.done() and not queued.done()
        started = time.monotonic()
        abort_and_wait([big, queued], only_if_clean=True)  # a multipart upload and a queued PUT stop cleanly
        assert time.monotonic() - started < 10  # not the 60 s the parts are held
        for future, key in ((big, "big"), (queued, "queued")):
            err = future.exception()
            assert isinstance(err, RequestAbortedError) and err.key == key and "PutObject aborted" in str(err), err
        assert not any(r.target.endswith("/queued") for r in proxy.requests)  # never started
        assert any(r.method == "DELETE" and "uploadId=" in r.target for r in proxy.requests)
        assert boto3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
        assert "Contents" not in boto3_client.list_objects_v2(Bucket=bucket)
        big.abort()  # over: nothing to do
        proxy.clear_rules()
        assert client.put(bucket, "after", b"v").result(timeout=30).size == 1


def test_a_single_put_already_sending_is_left_to_finish_unless_every_request_must_stop(s3_server, bucket,
                                                                                       boto3_client):
    """A single PUT cancelled after its body went out may still be stored by the server, even
    after a DELETE that followed: ``only_if_clean`` lets it finish; a plain abort stops it."""
    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port) as proxy:
        client = S3Client(replace(s3_server.s3_config(part_size_bytes=PART), endpoint_url=proxy.endpoint_url))
        proxy.add_rule(Rule("delay", method="PUT", delay_s=2))
        for key in ("finishes", "stops"):
            future = client.put(bucket, key, b"payload")
            deadline = time.monotonic() + 30
            while not any(r.target.endswith(f"/{key}") for r in proxy.requests):
                assert time.monotonic() < deadline, "the PUT never reached the server"
                time.sleep(0.05)
            abort_and_wait([future], only_if_clean=key == "finishes")
            if key == "finishes":
                assert future.result().size == 7
            else:
                assert isinstance(future.exception(), RequestAbortedError)
        assert boto3_client.get_object(Bucket=bucket, Key="finishes")["Body"].read() == b"payload"


def test_copy_into_takes_the_gil_free_path_for_large_writable_or_bytes_sources_and_checks_ranges():
    from s3dcp.s3.streams import _RELEASE_GIL_FROM, copy_into

    n = _RELEASE_GIL_FROM + 13
    data = os.urandom(n + 7)
    for source in (data, bytearray(data), memoryview(data), memoryview(bytearray(data))):  # bytes, writable, read-only
        for count in (5, n):
            dest = bytearray(n + 3)
            copy_into(memoryview(dest), 3, source, 7, count)
            assert dest[3:3 + count] == data[7:7 + count] and dest[:3] == b"\0\0\0"
    with pytest.raises(ValueError, match="outside its buffer"):
        copy_into(memoryview(bytearray(n)), 1, data, 0, n)  # would write one byte past dest
    with pytest.raises(ValueError, match="outside its buffer"):
        copy_into(memoryview(bytearray(n + 7)), 0, data, 8, n)  # would read past source


def test_upload_and_load_of_writable_buffers_go_through_the_memmove_path_byte_exact(client, bucket):
    import torch
    from s3dcp.format.tensors import byte_view

    parts = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (PART + 5, 3, 2 * MiB + 1)]
    client.put(bucket, "tensors", [byte_view(t) for t in parts]).result()
    whole = torch.cat(parts)
    out = torch.zeros_like(whole)
    client.get_range_into(bucket, "tensors", 0, byte_view(out)).result()
    assert torch.equal(out, whole)
    head, tail = torch.zeros(PART, dtype=torch.uint8), torch.zeros(MiB, dtype=torch.uint8)
    client.get_scatter(bucket, "tensors", 0, whole.numel(), [(0, byte_view(head)),
                                                            (whole.numel() - MiB, byte_view(tail))]).result()
    assert torch.equal(head, whole[:PART]) and torch.equal(tail, whole[-MiB:])


@pytest.mark.parametrize("transport", ["crt", "sockets"])
def test_a_read_told_the_object_size_refuses_another_size_before_copying_a_byte(s3_server, bucket, transport):
    client = S3Client(s3_server.s3_config(part_size_bytes=PART, download_part_size_bytes=PART, transport=transport))
    data = os.urandom(2 * PART + 10)
    client.put(bucket, "sized", data).result()
    out = bytearray(len(data))
    assert client.get_range_into(bucket, "sized", 0, out, object_size_bytes=len(data)).result() == len(data)
    assert out == data
    part = bytearray(PART)
    client.get_range_into(bucket, "sized", PART, part, object_size_bytes=len(data)).result()
    assert part == data[PART:2 * PART]
    for told in (len(data) - 1, len(data) + 1, 0):  # replaced, grown, or a size from elsewhere
        into = bytearray(b"\xee" * len(data))
        with pytest.raises(IntegrityError, match=f"holds {len(data)} bytes, not the {told}"):
            client.get_range_into(bucket, "sized", 0, memoryview(into)[:PART], object_size_bytes=told).result()
        assert into == b"\xee" * len(data)  # nothing copied


def test_a_first_page_only_listing_is_one_request_of_at_most_page_size(client, bucket):
    for i in range(5):
        client.put(bucket, f"few/{i}", b"x").result()
    objects, _ = client.list(bucket, "few/", page_size=2, first_page_only=True).result()
    assert [o.key for o in objects] == ["few/0", "few/1"]
    objects, prefixes = client.list(bucket, "", delimiter="/", page_size=1, first_page_only=True).result()
    assert (objects, prefixes) == ([], ["few/"])
    assert client.list(bucket, "none/", page_size=1, first_page_only=True).result() == ([], [])
    assert len(client.list(bucket, "few/", page_size=2).result()[0]) == 5  # every page without it
