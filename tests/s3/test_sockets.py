"""Multipart uploads over s3dcp's own sockets (s3dcp.s3.sockets) against the real server, with
the fault proxy in between to see and break each request: the bytes and each part's wire
checksum are exact, faults S3 says to retry are retried, the rest fail by name with the upload
aborted, an abort or deadline stops it at once, and threads and connections stay bounded."""

import base64
import gc
import os
import threading
import time
import weakref
from dataclasses import replace

import pytest
from awscrt import checksums

from fault_proxy import Rule
from s3dcp.config import MiB, S3Config
from s3dcp.errors import AccessDeniedError, ConfigError, NoSuchBucketError, RequestAbortedError, S3ConnectionError
from s3dcp.s3.client import S3Client
from s3dcp.s3.native import close_native_clients
from s3dcp.s3.request import abort_and_wait
from s3dcp.s3.sockets import part_layout

PART = 5 * MiB
FAST_RETRIES = dict(max_retries=3, retry_backoff_base_ms=10, retry_max_backoff_s=1)


def _client(s3_server, proxy, **overrides) -> S3Client:
    """A client of the socket transport (the opt-in this file tests), or of ``transport=``."""
    config = s3_server.s3_config(part_size_bytes=PART, **{"transport": "sockets", **overrides})
    return S3Client(replace(config, endpoint_url=proxy.endpoint_url))


def _uploads(boto3_client, bucket):
    return boto3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def _wait_for(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _crc(algorithm: str, data: bytes) -> str:
    if algorithm == "crc32c":
        return base64.b64encode(checksums.crc32c(data).to_bytes(4, "big")).decode()
    return base64.b64encode(checksums.crc64nvme(data).to_bytes(8, "big")).decode()


class _Buffer(bytearray):
    """A bytearray a weakref can follow."""


def test_part_layout_covers_the_object_and_stays_within_ten_thousand_parts():
    assert part_layout(0, PART) == []
    assert part_layout(2 * PART + 1, PART) == [(0, PART), (PART, PART), (2 * PART, 1)]
    layout = part_layout(10_000 * PART + 1, PART)
    assert len(layout) <= 10_000
    assert sum(n for _, n in layout) == 10_000 * PART + 1
    assert all(a + n == b for (a, n), (b, _) in zip(layout, layout[1:]))


@pytest.mark.parametrize("checksum", ["crc32c", "crc64nvme", None])
def test_each_part_goes_from_the_callers_buffers_with_its_checksum_and_the_object_is_exact(
        s3_server, proxy, bucket, boto3_client, checksum):
    client = _client(s3_server, proxy, checksum=checksum)
    pieces = [os.urandom(n) for n in (7, PART - 3, 0, PART + 11, 2 * MiB)]  # part edges inside buffers
    data = b"".join(pieces)
    result = client.put(bucket, "joined", pieces).result(timeout=60)
    assert result.size == len(data) and result.etag and "-" in result.etag.strip('"')
    assert client.get(bucket, "joined").result() == data

    records = [r for r in proxy.requests if r.target.split("?")[0].endswith("/joined")]
    create = [r for r in records if r.method == "POST" and r.target.endswith("?uploads")]
    parts = [r for r in records if r.method == "PUT" and "partNumber=" in r.target]
    complete = [r for r in records if r.method == "POST" and "uploadId=" in r.target]
    assert len(create) == 1 and len(complete) == 1
    assert len(parts) == len(part_layout(len(data), PART)) == 3
    for record in parts:
        number = int(record.target.split("partNumber=")[1].split("&")[0])
        offset, length = part_layout(len(data), PART)[number - 1]
        assert record.header("Content-Length") == str(length)
        assert record.header("x-amz-content-sha256") == "UNSIGNED-PAYLOAD"
        assert record.header("Transfer-Encoding") is None  # one plain body, no aws-chunked framing
        if checksum is None:
            assert not any(k.lower().startswith("x-amz-checksum-") for k, _ in record.headers)
        else:
            assert record.header(f"x-amz-checksum-{checksum}") == _crc(checksum, data[offset:offset + length])
    assert create[0].header("x-amz-checksum-algorithm") == (checksum.upper() if checksum else None)
    assert _uploads(boto3_client, bucket) == []


def test_parts_the_server_refuses_for_now_or_drops_are_sent_again(s3_server, proxy, bucket, boto3_client):
    client = _client(s3_server, proxy, **FAST_RETRIES)
    proxy.add_rule(Rule("error", method="PUT", query_has="partNumber=2", status=503, code="SlowDown", times=2))
    proxy.add_rule(Rule("reset_request", method="PUT", query_has="partNumber=1", after_bytes=MiB, times=1))
    proxy.add_rule(Rule("error", method="POST", query_has="uploadId", status=500, code="InternalError", times=1))
    data = os.urandom(3 * PART - 5)
    client.put(bucket, "retried", data).result(timeout=60)
    assert proxy.counts() == {"error": 3, "reset_request": 1}
    assert client.get(bucket, "retried").result() == data
    assert _uploads(boto3_client, bucket) == []


def test_a_refused_part_fails_the_upload_by_name_and_aborts_it(s3_server, proxy, bucket, boto3_client):
    client = _client(s3_server, proxy, **FAST_RETRIES)
    proxy.add_rule(Rule("error", method="PUT", query_has="partNumber=3", status=403, code="AccessDenied"))
    future = client.put(bucket, "denied", os.urandom(3 * PART))
    with pytest.raises(AccessDeniedError) as info:
        future.result(timeout=60)
    assert info.value.key == "denied" and info.value.bucket == bucket
    assert sum(1 for r in proxy.requests if "partNumber=3" in r.target) == 1  # not retried
    assert any(r.method == "DELETE" and "uploadId=" in r.target for r in proxy.requests)
    assert _uploads(boto3_client, bucket) == []
    assert "Contents" not in boto3_client.list_objects_v2(Bucket=bucket)


def test_a_missing_bucket_fails_at_create_by_name(s3_server, proxy):
    client = _client(s3_server, proxy, **FAST_RETRIES)
    with pytest.raises(NoSuchBucketError):
        client.put("no-such-bucket-here", "k", bytes(2 * PART)).result(timeout=60)


def test_an_unreachable_server_fails_as_a_connection_error_after_the_retries(s3_server):
    client = S3Client(replace(s3_server.s3_config(part_size_bytes=PART, transport="sockets", **FAST_RETRIES),
                              endpoint_url="http://127.0.0.1:9"))  # discard port: nothing listens
    with pytest.raises(S3ConnectionError, match="CreateMultipartUpload"):
        client.put("bucket", "k", bytes(2 * PART)).result(timeout=60)


def test_abort_and_deadline_stop_parts_in_flight_and_release_the_buffers(s3_server, proxy, bucket, boto3_client):
    """Every part is held by the server for 60 s: an abort, and a deadline of 2 s, each end the
    upload at once, abort it on the server and drop every reference to the caller's buffer."""
    proxy.add_rule(Rule("stall", method="PUT", query_has="partNumber"))
    for how in ("abort", "deadline"):
        client = _client(s3_server, proxy, request_timeout_s=2.0 if how == "deadline" else 600.0)
        buffer = _Buffer(os.urandom(3 * PART))
        ref = weakref.ref(buffer)
        future = client.put(bucket, how, buffer)
        del buffer
        _wait_for(lambda: sum(1 for r in proxy.requests if f"/{how}?partNumber=" in r.target) == 3,
                  "the parts never reached the server")
        started = time.monotonic()
        if how == "abort":
            abort_and_wait([future], only_if_clean=True)
            assert isinstance(future.exception(timeout=30), RequestAbortedError)
        else:
            with pytest.raises(S3ConnectionError, match="timed out|deadline|request_timeout_s"):
                future.result(timeout=30)
        assert time.monotonic() - started < 10
        assert any(r.method == "DELETE" and r.target.split("?")[0].endswith(f"/{how}") for r in proxy.requests)
        gc.collect()
        _wait_for(lambda: ref() is None, "the caller's buffer is still referenced", timeout=10)
    assert _uploads(boto3_client, bucket) == []
    assert "Contents" not in boto3_client.list_objects_v2(Bucket=bucket)


def test_threads_and_connections_stay_bounded_over_many_uploads_and_end_with_the_client(
        s3_server, proxy, bucket):
    close_native_clients(wait_s=10)
    client = _client(s3_server, proxy, max_concurrency=4)
    data = os.urandom(3 * PART + 1)

    def put_threads():
        return [t for t in threading.enumerate() if t.name.startswith("s3dcp-net")]

    for round_ in range(5):
        futures = [client.put(bucket, f"k{round_}/{i}", data) for i in range(4)]
        for f in futures:
            f.result(timeout=60)
        assert len(put_threads()) == 4  # all started with the first upload, none after
    assert client.get(bucket, "k4/3").result() == data
    # Connections are kept alive and reused: at most one per thread (plus the CRT's for GETs).
    assert proxy.connections_accepted <= 4 + 4
    client.close()
    close_native_clients(wait_s=10)
    _wait_for(lambda: not put_threads(), "the upload threads outlived their client", timeout=10)


def test_the_crt_transport_is_still_there_and_the_choice_is_checked(s3_server, bucket):
    client = S3Client(s3_server.s3_config(part_size_bytes=PART, transport="crt"))
    data = os.urandom(2 * PART + 3)
    assert "-" in client.put(bucket, "crt", data).result(timeout=60).etag
    assert client.get(bucket, "crt").result() == data
    with pytest.raises(ConfigError, match="transport='curl' must be one of"):
        S3Config(transport="curl")
