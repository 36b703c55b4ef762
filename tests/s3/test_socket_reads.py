"""Ranged reads over s3dcp's own sockets (s3dcp.s3.socket_reads) against the real server, with
the fault proxy in between: bytes land exactly where the sinks say (holes dropped, overlapping
sinks all filled), faults S3 says to retry are retried mid-body too, an object replaced during
a read, a short one and a server that answers something else than the range asked for all fail
by name, and an abort or deadline ends a read at once and lets go of the caller's buffers."""

import os
import re
import time
import weakref
from dataclasses import replace
from urllib.parse import urlsplit

import pytest
import torch

from fault_proxy import Rule
from tls_front import TlsFront, make_certificate
from s3dcp.config import MiB
from s3dcp.errors import IntegrityError, NoSuchBucketError, NoSuchKeyError, RequestAbortedError, S3ConnectionError, S3Error
from s3dcp.s3.client import S3Client
from s3dcp.s3.request import abort_and_wait

PART = 256 * 1024  # the smallest download part: a few MiB make many parts
FAST_RETRIES = dict(max_retries=3, retry_backoff_base_ms=10, retry_max_backoff_s=1)


def _client(s3_server, proxy=None, **overrides) -> S3Client:
    """A client of the socket transport (the opt-in this file tests), or of ``transport=``."""
    config = s3_server.s3_config(download_part_size_bytes=PART, **{"transport": "sockets", **FAST_RETRIES, **overrides})
    return S3Client(config if proxy is None else replace(config, endpoint_url=proxy.endpoint_url))


def _gets(proxy, key):
    return [r for r in proxy.requests if r.method == "GET" and r.target.split("?")[0].endswith("/" + key)]


@pytest.mark.parametrize("transport", ["sockets", "crt"])
def test_scatter_fills_every_covering_sink_across_part_edges_and_drops_the_holes(s3_server, bucket, transport):
    data = os.urandom(3 * MiB + 17)
    client = _client(s3_server, transport=transport)
    client.put(bucket, "scatter", data).result(timeout=60)
    # sinks across part edges, a hole between them, two overlapping the same bytes, one past a part
    spans = [(5, PART - 3), (PART + 100, PART), (PART + 200, 50), (2 * PART + 150, 2 * MiB)]
    sinks = [(offset, bytearray(n)) for offset, n in spans]
    start, end = 5, 2 * PART + 150 + 2 * MiB
    assert client.get_scatter(bucket, "scatter", start, end, [(o, memoryview(b)) for o, b in sinks]).result() == end - start
    for offset, buf in sinks:
        assert buf == data[offset:offset + len(buf)], offset
    whole = bytearray(len(data))
    assert client.get_range_into(bucket, "scatter", 0, whole).result() == len(data) and whole == data


def test_each_part_is_one_ranged_get_straight_into_the_tensor(s3_server, proxy, bucket):
    client = _client(s3_server, proxy)
    source = torch.randint(0, 256, (5 * PART + 3,), dtype=torch.uint8)
    client.put(bucket, "t", memoryview(source.numpy())).result(timeout=60)
    proxy.reset_stats()
    out = torch.zeros_like(source)
    client.get_range_into(bucket, "t", 0, memoryview(out.numpy())).result(timeout=60)
    assert torch.equal(out, source)
    ranges = sorted(int(re.match(r"bytes=(\d+)-(\d+)", r.header("Range"))[1]) for r in _gets(proxy, "t"))
    assert ranges == [i * PART for i in range(6)]


def test_gets_refused_for_now_or_cut_mid_body_are_sent_again(s3_server, proxy, bucket):
    client = _client(s3_server, proxy)
    data = os.urandom(4 * PART)
    client.put(bucket, "flaky", data).result(timeout=60)
    proxy.add_rule(Rule("error", method="GET", header=f"^range: bytes={PART}-", status=503, code="SlowDown", times=2))
    proxy.add_rule(Rule("reset_response", method="GET", header=f"^range: bytes={2 * PART}-", after_bytes=100_000,
                        times=1))
    out = bytearray(len(data))
    client.get_range_into(bucket, "flaky", 0, out).result(timeout=60)
    assert out == data
    assert proxy.counts() == {"error": 2, "reset_response": 1}


@pytest.mark.parametrize("transport", ["sockets", "crt"])
def test_an_object_replaced_during_a_read_fails_instead_of_mixing_two_versions(s3_server, proxy, bucket,
                                                                               boto3_client, transport):
    client = _client(s3_server, proxy, transport=transport)
    client.put(bucket, "moving", bytes(2 * PART)).result(timeout=60)
    proxy.add_rule(Rule("delay", method="GET", header=f"^range: bytes={PART}-", delay_s=1.5, times=1))
    future = client.get_range_into(bucket, "moving", 0, bytearray(2 * PART))
    time.sleep(0.5)  # the first part has its answer; the second waits in the proxy
    boto3_client.put_object(Bucket=bucket, Key="moving", Body=b"\1" * (2 * PART))
    with pytest.raises(IntegrityError, match="replaced while it was read"):
        future.result(timeout=60)


def test_short_objects_and_missing_ones_fail_by_name(s3_server, bucket):
    client = _client(s3_server)
    client.put(bucket, "short", b"12345").result()
    with pytest.raises(IntegrityError, match="asked for 10 bytes at offset 0, got 5"):
        client.get_range_into(bucket, "short", 0, bytearray(10)).result(timeout=60)
    with pytest.raises(IntegrityError, match="asked for 4 bytes at offset 100, got 0"):  # past the end: a 416
        client.get_range_into(bucket, "short", 100, bytearray(4)).result(timeout=60)
    with pytest.raises(NoSuchKeyError):
        client.get_range_into(bucket, "absent", 0, bytearray(4)).result(timeout=60)
    with pytest.raises(NoSuchBucketError):
        client.get_range_into("no-such-bucket-here", "k", 0, bytearray(4)).result(timeout=60)


@pytest.mark.parametrize("status,body,offset,match", [
    (206, b"x" * 10, 0, "the answer holds None"),  # no Content-Range
    (200, b"y" * 100, 0, "answered with the whole object"),  # more than the range
    (200, b"z" * 10, 7, "answered with the whole object"),  # a 200 for a range not at the start
])
def test_an_answer_that_is_not_the_range_asked_for_is_refused(s3_server, proxy, bucket, status, body, offset, match):
    client = _client(s3_server, proxy, max_retries=0)
    client.put(bucket, "k", bytes(64)).result(timeout=60)
    proxy.add_rule(Rule("answer", method="GET", status=status, body=body))
    out = bytearray(10)
    with pytest.raises(S3Error, match=match):
        client.get_range_into(bucket, "k", offset, out).result(timeout=60)


def test_abort_and_deadline_end_a_read_at_once_and_release_the_destination(s3_server, proxy, bucket):
    data = os.urandom(4 * PART)
    _client(s3_server).put(bucket, "held", data).result(timeout=60)
    proxy.add_rule(Rule("stall", method="GET"))
    for how in ("abort", "deadline"):
        client = _client(s3_server, proxy, request_timeout_s=2.0 if how == "deadline" else 600.0)
        dest = torch.zeros(len(data), dtype=torch.uint8)
        ref = weakref.ref(dest)
        future = client.get_range_into(bucket, "held", 0, memoryview(dest.numpy()))
        del dest
        deadline = time.monotonic() + 30
        while len(_gets(proxy, "held")) < 4:
            assert time.monotonic() < deadline, "the GETs never reached the server"
            time.sleep(0.02)
        started = time.monotonic()
        if how == "abort":
            abort_and_wait([future])
            assert isinstance(future.exception(timeout=30), RequestAbortedError)
        else:
            with pytest.raises(S3ConnectionError, match="timed out"):
                future.result(timeout=30)
        assert time.monotonic() - started < 10
        proxy.reset_stats()
        deadline = time.monotonic() + 10
        while ref() is not None:
            assert time.monotonic() < deadline, "the destination tensor is still referenced"
            time.sleep(0.02)


def test_transfers_over_tls_check_the_certificate_against_the_ca_bundle(s3_server, bucket, tmp_path):
    cert, key = make_certificate(tmp_path)
    other, _ = make_certificate(tmp_path, "other")
    u = urlsplit(s3_server.endpoint_url)
    front = TlsFront((u.hostname, u.port), cert, key)
    try:
        url = f"https://127.0.0.1:{front.port}"
        data = os.urandom(3 * 5 * MiB + 11)  # a multipart upload and reads of many parts
        client = _client(s3_server, endpoint_url=url, ca_bundle=str(cert), part_size_bytes=5 * MiB)
        assert "-" in client.put(bucket, "tls", data).result(timeout=60).etag
        out = bytearray(len(data))
        assert client.get_range_into(bucket, "tls", 0, out).result(timeout=60) == len(data) and out == data
        # a certificate the bundle does not vouch for: refused, not sent to
        stranger = _client(s3_server, endpoint_url=url, ca_bundle=str(other), part_size_bytes=5 * MiB, max_retries=0)
        with pytest.raises(S3ConnectionError):
            stranger.put(bucket, "refused", data).result(timeout=60)
        with pytest.raises(S3ConnectionError):
            stranger.get_range_into(bucket, "tls", 0, bytearray(10)).result(timeout=60)
        # verify_tls=False accepts it (a private test endpoint)
        lax = _client(s3_server, endpoint_url=url, verify_tls=False, part_size_bytes=5 * MiB)
        lax_out = bytearray(len(data))
        lax.get_range_into(bucket, "tls", 0, lax_out).result(timeout=60)
        assert lax_out == data
    finally:
        front.close()
