"""Stalled connections and broken answers, on every transport, against the real server through
the fault proxy: each costs a bounded time (a stall: about 30 s, the CRT's and the socket
transport's stall detection; docs/errors.md) and ends in the right bytes or a named error."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import pytest

from s3dcp.config import TRANSPORTS, MiB
from s3dcp.errors import S3Error, ThrottlingError
from s3dcp.s3.client import S3Client

from fault_proxy import Rule

PART = 5 * MiB
STALL_BOUND_S = 90  # 30 s of silence, then a retry; generous for a loaded 2-core machine


def _client(s3_server, proxy, transport, **overrides) -> S3Client:
    config = s3_server.s3_config(part_size_bytes=PART, download_part_size_bytes=PART, transport=transport,
                                 max_retries=3, retry_backoff_base_ms=10, retry_max_backoff_s=1, **overrides)
    return S3Client(replace(config, endpoint_url=proxy.endpoint_url))


def _at_once(**works):
    """Run every ``works[name](transport)`` for every transport at once (each stall costs its own
    ~30 s; together they cost it once); return {(name, transport): (seconds, error or None)}."""
    out: dict = {}

    def run(name, t):
        start = time.monotonic()
        try:
            works[name](t)
            out[name, t] = (time.monotonic() - start, None)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out[name, t] = (time.monotonic() - start, e)

    threads = [threading.Thread(target=run, args=(name, t)) for name in works for t in TRANSPORTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def test_a_stalled_read_and_an_unanswered_upload_part_are_retried_in_bounded_time(s3_server, proxy, bucket,
                                                                                  boto3_client):
    """On each transport, at the same time: a read whose second part's body stops after 1 MiB,
    and an upload whose second part is swallowed (no answer at all); each is retried once its
    transport's stall detection fires and ends with the exact bytes."""
    data = os.urandom(3 * PART + 11)
    uploaded = os.urandom(3 * PART + 7)
    for t in TRANSPORTS:
        boto3_client.put_object(Bucket=bucket, Key=f"stalls-{t}", Body=data)
        # the second part's answer stops after 1 MiB of its body, once, for each transport's key
        proxy.add_rule(Rule("stall_response", method="GET", path_regex=f"/stalls-{t}$",
                            header=f"^range: bytes={PART}-", after_bytes=MiB, times=1))
        # the second part of each transport's upload is swallowed, once
        proxy.add_rule(Rule("stall", method="PUT", path_regex=f"/unanswered-{t}\\?partNumber=2&", times=1))

    def read(t):
        client = _client(s3_server, proxy, t)
        try:
            out = bytearray(len(data))
            client.get_range_into(bucket, f"stalls-{t}", 0, out).result(timeout=STALL_BOUND_S + 30)
            assert out == data
        finally:
            client.close()

    def upload(t):
        client = _client(s3_server, proxy, t)
        try:
            client.put(bucket, f"unanswered-{t}", uploaded).result(timeout=STALL_BOUND_S + 30)
        finally:
            client.close()

    results = _at_once(read=read, upload=upload)
    assert len(results) == 2 * len(TRANSPORTS)
    for (what, t), (seconds, error) in results.items():
        assert error is None and seconds < STALL_BOUND_S, (what, t, seconds, error)
    for t in TRANSPORTS:
        assert boto3_client.get_object(Bucket=bucket, Key=f"unanswered-{t}")["Body"].read() == uploaded
    assert [rule.fired for rule in proxy.rules] == [1] * 2 * len(TRANSPORTS), "every read and upload met its stall"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_broken_answers_are_retried_or_named(s3_server, proxy, bucket, boto3_client, transport):
    """A CompleteMultipartUpload answered 200 with an <Error> body, a 400 RequestTimeout and a
    body cut mid-way are retried; a 503 storm ends, after the retries, as ThrottlingError."""
    client = _client(s3_server, proxy, transport)
    data = os.urandom(2 * PART + 3)
    try:
        error_body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
                      b"<Message>We encountered an internal error. Please try again.</Message></Error>")
        proxy.add_rule(Rule("answer", method="POST", query_has="uploadId", status=200, body=error_body, times=1))
        proxy.add_rule(Rule("error", method="PUT", query_has="partNumber=1", status=400, code="RequestTimeout",
                            times=1))
        client.put(bucket, "broken", data).result(timeout=120)
        assert boto3_client.get_object(Bucket=bucket, Key="broken")["Body"].read() == data
        assert all(rule.fired == 1 for rule in proxy.rules)

        proxy.clear_rules()
        proxy.add_rule(Rule("reset_response", method="GET", after_bytes=MiB, times=1))
        out = bytearray(len(data))
        client.get_range_into(bucket, "broken", 0, out).result(timeout=120)
        assert out == data and proxy.rules[0].fired == 1

        proxy.clear_rules()
        proxy.add_rule(Rule("error", method="GET", status=503, code="SlowDown"))
        with pytest.raises(ThrottlingError):
            client.get_range_into(bucket, "broken", 0, bytearray(len(data))).result(timeout=120)
        assert 4 <= proxy.rules[0].fired <= 4 * 3 + 4  # the first try and 3 retries (per part)
    finally:
        client.close()
