"""Tests for tests/fault_proxy.py.

Two groups:

* framing tests against a scripted fake upstream (raw sockets, exact bytes): chunked
  bodies with extensions and trailers, HEAD/204/304, Expect: 100-continue, pipelining,
  until-close responses, and the exact cut points of the reset faults;
* end-to-end tests against a real SeaweedFS S3 server, with boto3 and with awscrt's
  S3Client pointed at the proxy (SigV4 signed for the proxy's host:port).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import threading
import time
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions as bexc
import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from fault_proxy import FaultEvent, FaultProxy, Rule

MiB = 1 << 20
# what botocore raises when the connection dies under a request or a response body
CONN_ERRORS = (bexc.HTTPClientError, bexc.ConnectionError)


# ----------------------------------------------------------------------------------------
# scripted fake upstream (no S3 server needed)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes: {bytes(buf)[:200]!r}")
        buf += data
    return bytes(buf)


def _recv_all(sock: socket.socket) -> tuple[bytes, BaseException | None]:
    """Read until EOF or error; returns (data, error or None for a clean EOF)."""
    buf = bytearray()
    while True:
        try:
            data = sock.recv(65536)
        except OSError as exc:
            return bytes(buf), exc
        if not data:
            return bytes(buf), None
        buf += data


class ScriptedUpstream:
    """Accepts a connection and plays a script of ("recv", bytes) / ("send", bytes) /
    ("recv_all", None) / ("accept", None) (close, take the next connection) /
    ("close", None) steps; mismatches land in .errors."""

    def __init__(self, script):
        self.script = script
        self.errors: list[str] = []
        self.received_all: bytes | None = None
        self.accepted = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _accept(self) -> socket.socket:
        conn, _ = self.listener.accept()
        self.accepted += 1
        conn.settimeout(10)
        return conn

    def _run(self) -> None:
        conn = None
        try:
            self.listener.settimeout(10)
            conn = self._accept()
            with contextlib.ExitStack() as stack:
                stack.callback(lambda: conn.close())
                for i, (op, arg) in enumerate(self.script):
                    if op == "accept":  # the previous connection is closed, take the next one
                        conn.close()
                        conn = self._accept()
                    elif op == "recv":
                        got = _recv_exact(conn, len(arg))
                        if got != arg:
                            self.errors.append(
                                f"step {i}: expected {arg[:300]!r}, got {got[:300]!r}"
                            )
                            return
                    elif op == "send":
                        conn.sendall(arg)
                    elif op == "recv_all":
                        self.received_all, _ = _recv_all(conn)
                    elif op == "close":
                        return
        except BaseException as exc:  # noqa: BLE001
            self.errors.append(f"upstream: {exc!r}")
        finally:
            self.listener.close()

    def join(self) -> list[str]:
        self.thread.join(15)
        assert not self.thread.is_alive(), "scripted upstream did not finish"
        return self.errors


def _client(proxy: FaultProxy) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    return s


def test_rule_matching_unit():
    r = Rule("error", method="put", path_regex=r"^/b/k", query_has="partNumber")
    assert r.matches("PUT", "/b/key?partNumber=3&uploadId=x")
    assert not r.matches("GET", "/b/key?partNumber=3&uploadId=x")
    assert not r.matches("PUT", "/b/key?uploadId=x")
    assert not r.matches("PUT", "/c/key?partNumber=1")
    assert not r.matches("PUT", "/b/partNumber")  # query_has looks at the query string only
    assert Rule("delay").matches("HEAD", "/")
    with pytest.raises(ValueError):
        Rule("explode")


def test_rule_matching_on_headers_unit():
    trailer = Rule("error", header=r"^x-amz-trailer:")
    assert trailer.matches("PUT", "/b/k", [("X-Amz-Trailer", "x-amz-checksum-crc32c")])  # names match in lower case
    assert not trailer.matches("PUT", "/b/k", [("Content-Length", "3")])
    assert not trailer.matches("PUT", "/b/k")  # no headers given: a header rule never matches
    unsized = Rule("error", method="POST", query_has="uploads", without_header=r"^content-length:")
    assert unsized.matches("POST", "/b/k?uploads=", [("Host", "h")])
    assert not unsized.matches("POST", "/b/k?uploads=", [("Content-Length", "0")])
    gen0 = Rule("add_headers", header=r"^x-goog-if-generation-match: 0$", headers=(("If-None-Match", "*"),))
    assert gen0.matches("PUT", "/b/k", [("x-goog-if-generation-match", "0")])
    assert not gen0.matches("PUT", "/b/k", [("x-goog-if-generation-match", "17")])


def test_store_rules_unit():
    from fault_proxy import STORES, store_rules

    for store in STORES:
        rules = store_rules(store)
        first = {(r.method, r.status, r.code) for r in rules if r.action == "error"}
        assert first == {(None, 400, "InvalidArgument"), ("PUT", 501, "NotImplemented"),
                         ("POST", 411, "MissingContentLength")}
    assert [r.action for r in store_rules("gcs")][-1] == "add_headers"
    with pytest.raises(ValueError):
        store_rules("azure")
    with pytest.raises(ValueError):
        Rule("error", probability=1.5)


def test_framing_passthrough_keepalive():
    """Every framing case on ONE client connection; both sides see exactly the bytes sent."""
    chunked_req = (
        b"POST /b/chunked HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Trailer: x-amz-checksum-crc32c\r\n\r\n"
    )
    chunked_body = (
        b"5;chunk-ext=1\r\nhello\r\n" + b"10\r\n" + b"0123456789abcdef" + b"\r\n"
        b"0\r\nx-amz-checksum-crc32c: AAAAAA==\r\n\r\n"
    )
    chunked_resp = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\nX-Trailer: yes\r\n\r\n"
    )
    head_req = b"HEAD /b/k HTTP/1.1\r\nHost: x\r\n\r\n"
    head_resp = b"HTTP/1.1 200 OK\r\nContent-Length: 123456\r\nETag: \"e\"\r\n\r\n"
    del_req = b"DELETE /b/k HTTP/1.1\r\nHost: x\r\n\r\n"
    del_resp = b"HTTP/1.1 204 No Content\r\nx-amz-request-id: 1\r\n\r\n"
    nm_req = b"GET /b/k HTTP/1.1\r\nHost: x\r\nIf-None-Match: \"e\"\r\n\r\n"
    nm_resp = b"HTTP/1.1 304 Not Modified\r\nETag: \"e\"\r\nContent-Length: 123456\r\n\r\n"
    exp_req = (
        b"PUT /b/k HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 11\r\n\r\n"
    )
    exp_body = b"hello world"
    cont = b"HTTP/1.1 100 Continue\r\n\r\n"
    exp_resp = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    zero_req = b"PUT /b/empty HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    zero_resp = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    p1 = b"GET /b/p1 HTTP/1.1\r\nHost: x\r\n\r\n"
    p2 = b"GET /b/p2?list-type=2 HTTP/1.1\r\nHost: x\r\n\r\n"
    r1 = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\none"
    r2 = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\ntwo"
    close_req = b"GET /b/close HTTP/1.1\r\nHost: x\r\n\r\n"
    close_resp = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"until-close " * 1000

    up = ScriptedUpstream(
        [
            ("recv", chunked_req + chunked_body), ("send", chunked_resp),
            ("recv", head_req), ("send", head_resp),
            ("recv", del_req), ("send", del_resp),
            ("recv", nm_req), ("send", nm_resp),
            ("recv", exp_req), ("send", cont), ("recv", exp_body), ("send", exp_resp),
            ("recv", zero_req), ("send", zero_resp),
            ("recv", p1), ("send", r1), ("recv", p2), ("send", r2),
            ("recv", close_req), ("send", close_resp), ("close", None),
        ]
    )
    with FaultProxy("127.0.0.1", up.port) as proxy, _client(proxy) as c:
        c.sendall(chunked_req + chunked_body)
        assert _recv_exact(c, len(chunked_resp)) == chunked_resp
        for req, resp in ((head_req, head_resp), (del_req, del_resp), (nm_req, nm_resp)):
            c.sendall(req)
            assert _recv_exact(c, len(resp)) == resp
        c.sendall(exp_req)
        assert _recv_exact(c, len(cont)) == cont  # the interim response is relayed
        c.sendall(exp_body)
        assert _recv_exact(c, len(exp_resp)) == exp_resp
        c.sendall(zero_req)
        assert _recv_exact(c, len(zero_resp)) == zero_resp
        c.sendall(p1 + p2)  # pipelined
        assert _recv_exact(c, len(r1) + len(r2)) == r1 + r2
        c.sendall(close_req)
        data, err = _recv_all(c)
        assert (data, err) == (close_resp, None)
        assert up.join() == []
        assert proxy.requests_seen == 9
        assert proxy.connections_accepted == 1 and proxy.upstream_connections == 1
        assert {r.conn_id for r in proxy.requests} == {1}
        assert proxy.events == [] and proxy.counts() == {}


def test_upstream_idle_close_is_hidden_from_the_client():
    r1 = b"GET /b/1 HTTP/1.1\r\nHost: x\r\n\r\n"
    r2 = b"GET /b/2 HTTP/1.1\r\nHost: x\r\n\r\n"
    resp = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    up = ScriptedUpstream(
        [
            ("recv", r1), ("send", resp),
            ("accept", None),  # idle close by the upstream, then a new connection
            ("recv", r2), ("send", resp), ("close", None),
        ]
    )
    with FaultProxy("127.0.0.1", up.port) as proxy, _client(proxy) as c:
        c.sendall(r1)
        assert _recv_exact(c, len(resp)) == resp
        time.sleep(0.3)  # the upstream closes the idle connection meanwhile
        c.sendall(r2)  # same client connection, a fresh upstream connection
        assert _recv_exact(c, len(resp)) == resp
        assert up.join() == []
        assert proxy.connections_accepted == 1 and proxy.upstream_connections == 2


def test_framing_error_rule_drains_chunked_body_and_keeps_connection():
    req_ok = b"GET /b/ok HTTP/1.1\r\nHost: x\r\n\r\n"
    resp_ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    up = ScriptedUpstream([("recv", req_ok), ("send", resp_ok), ("close", None)])
    with FaultProxy("127.0.0.1", up.port) as proxy, _client(proxy) as c:
        proxy.add_rule(Rule("error", method="PUT", status=500, code="InternalError"))
        c.sendall(
            b"PUT /b/k HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"4\r\nabcd\r\n0\r\nx-amz-checksum-crc32c: AAAAAA==\r\n\r\n"
        )
        head = c.recv(4096)
        while b"</Error>" not in head:
            head += c.recv(4096)
        assert head.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
        assert b"<Code>InternalError</Code>" in head and b"<RequestId>fault-1</RequestId>" in head
        assert b"x-amz-request-id: fault-1\r\n" in head and b"Content-Type: application/xml" in head
        # same connection, next request is forwarded
        c.sendall(req_ok)
        assert _recv_exact(c, len(resp_ok)) == resp_ok
        assert up.join() == []
        assert proxy.events == [FaultEvent("error", "PUT", "/b/k", 500)]


def test_framing_error_rule_with_expect_answers_early_and_closes():
    never_used = socket.create_server(("127.0.0.1", 0))
    port = never_used.getsockname()[1]
    with never_used, FaultProxy("127.0.0.1", port) as proxy, _client(proxy) as c:
        proxy.add_rule(Rule("error"))
        c.sendall(
            b"PUT /b/k HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
        )
        data, err = _recv_all(c)  # answered without waiting for the body, then closed
        assert err is None
        assert data.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert b"Connection: close" in data
        assert data.endswith(b"</Error>") and b"<Code>SlowDown</Code>" in data
        assert proxy.upstream_connections == 0


def test_framing_answer_rule_sends_its_headers_and_replaces_the_proxys_own():
    never_used = socket.create_server(("127.0.0.1", 0))
    port = never_used.getsockname()[1]
    with never_used, FaultProxy("127.0.0.1", port) as proxy, _client(proxy) as c:
        proxy.add_rule(Rule("answer", status=301, body=b"<Error/>", answer_headers=(
            ("x-amz-bucket-region", "eu-west-1"), ("date", "Thu, 01 Jan 2099 00:00:00 GMT"))))
        c.sendall(b"GET /b/k HTTP/1.1\r\nHost: x\r\n\r\n")
        data = c.recv(65536)
        while not data.endswith(b"<Error/>"):
            data += c.recv(65536)
        head = data.split(b"\r\n\r\n")[0].decode().split("\r\n")
        assert head[0] == "HTTP/1.1 301 Moved Permanently"
        assert "x-amz-bucket-region: eu-west-1" in head and "date: Thu, 01 Jan 2099 00:00:00 GMT" in head
        assert not any(line.startswith("Date:") for line in head)  # replaced, not doubled
        assert proxy.upstream_connections == 0


def test_framing_answer_early_answers_before_the_body_and_resets():
    never_used = socket.create_server(("127.0.0.1", 0))
    port = never_used.getsockname()[1]
    with never_used, FaultProxy("127.0.0.1", port) as proxy, _client(proxy) as c:
        proxy.add_rule(Rule("answer_early", status=400, code="ExpiredToken"))
        c.sendall(b"PUT /b/k?partNumber=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n" + b"x" * 1000)
        data, err = _recv_all(c)  # the answer, though the body is far from sent, then a reset
        assert data.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"<Code>ExpiredToken</Code>" in data, data
        assert b"Connection: close" in data
        with pytest.raises(OSError):  # the connection was reset: the rest of the body cannot go
            for _ in range(100):
                c.sendall(b"x" * 65536)
                time.sleep(0.01)
        assert proxy.upstream_connections == 0
        assert proxy.events == [FaultEvent("answer_early", "PUT", "/b/k?partNumber=1", 400)]


@pytest.mark.parametrize("chunked", [False, True])
def test_framing_reset_request_cut_point(chunked):
    if chunked:
        head = b"PUT /b/k HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        body = b"64\r\n" + b"x" * 100 + b"\r\n0\r\n\r\n"
    else:
        head = b"PUT /b/k HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        body = b"x" * 100
    up = ScriptedUpstream([("recv_all", None)])
    with FaultProxy("127.0.0.1", up.port) as proxy, _client(proxy) as c:
        proxy.add_rule(Rule("reset_request", after_bytes=10))
        c.sendall(head + body)
        data, err = _recv_all(c)
        assert data == b"" and isinstance(err, ConnectionResetError)
        assert up.join() == []
        assert up.received_all == head + body[:10]  # head + exactly after_bytes wire bytes


def test_framing_reset_request_never_completes_a_request():
    """after_bytes beyond the body: the last byte is held back; bodiless: the head's CRLF."""
    head = b"PUT /b/k HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    up = ScriptedUpstream([("recv_all", None)])
    with FaultProxy("127.0.0.1", up.port) as proxy, _client(proxy) as c:
        proxy.add_rule(Rule("reset_request", after_bytes=10**9))
        c.sendall(head + b"y" * 100)
        assert isinstance(_recv_all(c)[1], ConnectionResetError)
        up.join()
        assert up.received_all == head + b"y" * 99
    get = b"GET /b/k HTTP/1.1\r\nHost: x\r\n\r\n"
    up = ScriptedUpstream([("recv_all", None)])
    with FaultProxy("127.0.0.1", up.port) as proxy, _client(proxy) as c:
        proxy.add_rule(Rule("reset_request"))
        c.sendall(get)
        assert isinstance(_recv_all(c)[1], ConnectionResetError)
        up.join()
        assert up.received_all == get[:-2]


def test_framing_reset_response_cut_point():
    req = b"GET /b/k HTTP/1.1\r\nHost: x\r\n\r\n"
    resp_head = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"
    resp_body = b"z" * 100
    up = ScriptedUpstream([("recv", req), ("send", resp_head + resp_body), ("recv_all", None)])
    with FaultProxy("127.0.0.1", up.port) as proxy, _client(proxy) as c:
        proxy.add_rule(Rule("reset_response", after_bytes=7))
        c.sendall(req)
        data, err = _recv_all(c)
        assert data == resp_head + resp_body[:7]
        assert isinstance(err, ConnectionResetError)
        assert up.join() == []
        assert proxy.counts() == {"reset_response": 1}


# ----------------------------------------------------------------------------------------
# real S3 server (SeaweedFS): `s3_server` and `bucket` come from conftest.py


@pytest.fixture
def proxy(s3_server):
    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port, seed=1234) as p:
        yield p


def _region(s3_server) -> str:
    return s3_server.region


def _boto3(s3_server, endpoint_url: str, **config):
    options = dict(
        s3={"addressing_style": "path"},
        signature_version="s3v4",
        proxies={},
        retries={"total_max_attempts": 1, "mode": "standard"},  # NB max_attempts=1 means 1 *retry*
        connect_timeout=5,
        read_timeout=20,
    )
    options.update(config)
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=_region(s3_server),
        aws_access_key_id=s3_server.access_key,
        aws_secret_access_key=s3_server.secret_key,
        config=botocore.config.Config(**options),
    )


@pytest.fixture
def via(s3_server, proxy):
    """boto3 client through the proxy, retries off."""
    return _boto3(s3_server, proxy.endpoint_url)


@pytest.fixture
def direct(s3_server):
    """boto3 client straight to the server (to check what really got stored)."""
    return _boto3(s3_server, s3_server.endpoint_url)


def _crt_client(s3_server, *, retries: bool = True):
    from awscrt.auth import AwsCredentialsProvider
    from awscrt.s3 import (
        S3Client,
        S3RequestTlsMode,
        S3RetryConfig,
        S3RetryMode,
        create_default_s3_signing_config,
    )

    signing = create_default_s3_signing_config(
        region=_region(s3_server),
        credential_provider=AwsCredentialsProvider.new_static(
            s3_server.access_key, s3_server.secret_key
        ),
    )
    return S3Client(
        region=_region(s3_server),
        tls_mode=S3RequestTlsMode.DISABLED,
        signing_config=signing,
        part_size=5 * MiB,
        multipart_upload_threshold=5 * MiB,
        retry_config=None if retries else S3RetryConfig(retry_mode=S3RetryMode.NONE),
    )


def _crt_put(client, proxy: FaultProxy, bucket: str, key: str, data: bytes, timeout=60):
    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.s3 import (
        S3ChecksumAlgorithm,
        S3ChecksumConfig,
        S3ChecksumLocation,
        S3RequestType,
    )

    headers = HttpHeaders([("Host", f"127.0.0.1:{proxy.port}"), ("Content-Length", str(len(data)))])
    req = HttpRequest("PUT", f"/{bucket}/{key}", headers, io.BytesIO(data))
    r = client.make_request(
        type=S3RequestType.PUT_OBJECT,
        request=req,
        checksum_config=S3ChecksumConfig(
            algorithm=S3ChecksumAlgorithm.CRC32C, location=S3ChecksumLocation.TRAILER
        ),
    )
    return r.finished_future.result(timeout)


def _get(client, bucket, key) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def test_boto3_passthrough_on_one_connection(proxy, via, direct, bucket):
    data = os.urandom(3 * MiB + 17)
    via.put_object(Bucket=bucket, Key="a/obj", Body=data)  # boto3 PUTs use Expect: 100-continue
    assert _get(via, bucket, "a/obj") == data
    assert via.head_object(Bucket=bucket, Key="a/obj")["ContentLength"] == len(data)
    ranged = via.get_object(Bucket=bucket, Key="a/obj", Range="bytes=10-19")
    assert ranged["Body"].read() == data[10:20]
    listed = via.list_objects_v2(Bucket=bucket, Prefix="a/")
    assert [o["Key"] for o in listed["Contents"]] == ["a/obj"]
    via.delete_object(Bucket=bucket, Key="a/obj")
    with pytest.raises(bexc.ClientError) as ei:
        via.head_object(Bucket=bucket, Key="a/obj")
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    assert proxy.requests_seen == 7
    assert proxy.connections_accepted == 1  # keep-alive reused for all 7 requests
    assert proxy.requests[0].header("Expect") == "100-continue"
    assert proxy.events == []


def test_crt_multipart_trailer_checksum_passthrough(s3_server, proxy, direct, bucket):
    crt = _crt_client(s3_server)
    small = os.urandom(1000)
    _crt_put(crt, proxy, bucket, "crt/small", small)
    big = os.urandom(20 * MiB)
    _crt_put(crt, proxy, bucket, "crt/big", big)
    assert _get(direct, bucket, "crt/small") == small
    assert _get(direct, bucket, "crt/big") == big
    reqs = proxy.requests
    methods = [(r.method, r.target.split("?", 1)[1].split("=")[0] if "?" in r.target else "")
               for r in reqs]
    assert methods.count(("PUT", "")) == 1  # the small one, single PutObject
    assert methods.count(("POST", "uploads")) == 1
    assert methods.count(("PUT", "partNumber")) == 4
    assert methods.count(("POST", "uploadId")) == 1
    for r in reqs:
        if r.method == "PUT":
            # awscrt frames trailer-checksummed uploads as aws-chunked inside a Content-Length
            # body: no Transfer-Encoding, no Expect.
            assert r.header("Content-Encoding") == "aws-chunked"
            assert r.header("x-amz-trailer") == "x-amz-checksum-crc32c"
            assert r.header("x-amz-content-sha256") == "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
            assert r.header("Transfer-Encoding") is None and r.header("Expect") is None
            assert int(r.header("Content-Length")) > int(r.header("x-amz-decoded-content-length"))
            assert r.header("Host") == f"127.0.0.1:{proxy.port}"
    # some connection carried more than one request (keep-alive through the proxy)
    per_conn: dict[int, int] = {}
    for r in reqs:
        per_conn[r.conn_id] = per_conn.get(r.conn_id, 0) + 1
    assert max(per_conn.values()) >= 2
    assert proxy.upstream_connections == proxy.connections_accepted


def test_chunked_request_with_trailer_to_real_server(s3_server, proxy, direct, bucket):
    """A SigV4-signed PUT sent with Transfer-Encoding: chunked (+ extensions, trailer)."""
    data = os.urandom(300_000)
    host = f"127.0.0.1:{proxy.port}"
    url = f"http://{host}/{bucket}/chunky"
    req = AWSRequest(method="PUT", url=url, data=data, headers={"Host": host})
    creds = Credentials(s3_server.access_key, s3_server.secret_key)
    S3SigV4Auth(creds, "s3", _region(s3_server)).add_auth(req)  # signs sha256(decoded body)
    head = f"PUT /{bucket}/chunky HTTP/1.1\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in req.headers.items())
    head += "Transfer-Encoding: chunked\r\nTrailer: X-Foo\r\n\r\n"
    body = b"".join(
        b"%x;ext=1\r\n" % len(data[i : i + 65536]) + data[i : i + 65536] + b"\r\n"
        for i in range(0, len(data), 65536)
    ) + b"0\r\nX-Foo: bar\r\n\r\n"
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c:
        c.sendall(head.encode() + body)
        resp = c.recv(65536)
    assert resp.startswith(b"HTTP/1.1 200 "), resp
    assert _get(direct, bucket, "chunky") == data


def test_error_rule(proxy, via, direct, bucket):
    direct.put_object(Bucket=bucket, Key="k", Body=b"original")
    proxy.add_rule(Rule("error", method="GET"))
    with pytest.raises(bexc.ClientError) as ei:
        via.get_object(Bucket=bucket, Key="k")
    err = ei.value.response
    assert err["Error"]["Code"] == "SlowDown"
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert err["ResponseMetadata"]["RequestId"] == "fault-1"
    # PUT carries Expect: 100-continue -> answered at once, body never forwarded
    proxy.clear_rules()
    proxy.add_rule(Rule("error", method="PUT", status=500, code="InternalError"))
    with pytest.raises(bexc.ClientError) as ei:
        via.put_object(Bucket=bucket, Key="k", Body=b"replacement" * 1000)
    assert ei.value.response["Error"]["Code"] == "InternalError"
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    assert _get(direct, bucket, "k") == b"original"
    # HEAD error: status only (no body on the wire)
    proxy.clear_rules()
    proxy.add_rule(Rule("error", method="HEAD", status=503))
    with pytest.raises(bexc.ClientError) as ei:
        via.head_object(Bucket=bucket, Key="k")
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    proxy.clear_rules()
    assert _get(via, bucket, "k") == b"original"  # connection still fine, no rule left
    assert proxy.counts() == {"error": 3}
    assert [(e.method, e.status) for e in proxy.events] == [
        ("GET", 503), ("PUT", 500), ("HEAD", 503)
    ]


def test_error_rule_keeps_connection_alive(proxy, via, direct, bucket):
    direct.put_object(Bucket=bucket, Key="k", Body=b"v")
    proxy.add_rule(Rule("error", method="GET", times=1))
    with pytest.raises(bexc.ClientError):
        via.get_object(Bucket=bucket, Key="k")
    assert _get(via, bucket, "k") == b"v"
    assert proxy.connections_accepted == 1
    assert [r.fault for r in proxy.requests] == ["error", None]


def test_reset_request_mid_body(proxy, via, direct, bucket):
    original = os.urandom(MiB)
    direct.put_object(Bucket=bucket, Key="k", Body=original)
    proxy.add_rule(Rule("reset_request", method="PUT", after_bytes=256 * 1024))
    with pytest.raises(CONN_ERRORS):
        via.put_object(Bucket=bucket, Key="k", Body=os.urandom(2 * MiB))
    with pytest.raises(CONN_ERRORS):
        via.put_object(Bucket=bucket, Key="new", Body=os.urandom(2 * MiB))
    proxy.clear_rules()
    assert _get(direct, bucket, "k") == original  # not changed
    with pytest.raises(bexc.ClientError):
        direct.head_object(Bucket=bucket, Key="new")  # not created
    assert proxy.counts() == {"reset_request": 2}


def test_reset_response_mid_body(proxy, via, direct, bucket):
    original = os.urandom(MiB)
    direct.put_object(Bucket=bucket, Key="k", Body=original)
    proxy.add_rule(Rule("reset_response", method="GET", after_bytes=64 * 1024))
    with pytest.raises(CONN_ERRORS):
        _get(via, bucket, "k")  # the headers arrive; reading the body fails
    proxy.clear_rules()
    assert _get(via, bucket, "k") == original
    # On a PUT the request is forwarded fully: the server stores the object, the client
    # never learns (its 200 is cut before completion) -- the "ambiguous success" case.
    proxy.add_rule(Rule("reset_response", method="PUT"))
    replacement = os.urandom(1000)
    with pytest.raises(CONN_ERRORS):
        via.put_object(Bucket=bucket, Key="k", Body=replacement)
    assert _get(direct, bucket, "k") == replacement
    assert proxy.counts() == {"reset_response": 2}


def test_delay(proxy, via, direct, bucket):
    direct.put_object(Bucket=bucket, Key="k", Body=b"v")
    assert _get(via, bucket, "k") == b"v"  # warm the connection
    proxy.add_rule(Rule("delay", method="GET", delay_s=0.6))
    t0 = time.monotonic()
    assert _get(via, bucket, "k") == b"v"
    assert time.monotonic() - t0 >= 0.6
    t0 = time.monotonic()
    via.head_object(Bucket=bucket, Key="k")  # not matched
    assert time.monotonic() - t0 < 0.5
    assert proxy.counts() == {"delay": 1}


def test_stall_times_out_and_stop_releases_it(s3_server, proxy, direct, bucket):
    direct.put_object(Bucket=bucket, Key="k", Body=b"v")
    proxy.add_rule(Rule("stall", method="GET"))
    client = _boto3(s3_server, proxy.endpoint_url, read_timeout=1)
    t0 = time.monotonic()
    with pytest.raises(bexc.ReadTimeoutError):
        client.get_object(Bucket=bucket, Key="k")
    assert 0.9 <= time.monotonic() - t0 < 5
    assert proxy.counts() == {"stall": 1}
    # a stalled raw connection is released (closed) by stop()
    c = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    c.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    deadline = time.monotonic() + 5
    while proxy.counts().get("stall", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    proxy.stop()
    data, _ = _recv_all(c)
    c.close()
    assert data == b"" and time.monotonic() - t0 < 5
    proxy.stop()  # idempotent


def test_times_probability_and_rule_order(s3_server, proxy, via, direct, bucket):
    direct.put_object(Bucket=bucket, Key="k", Body=b"v")
    # times: the first rule fires twice, then falls through to the second (which never
    # matches GET); rules are tried in insertion order
    proxy.add_rule(Rule("error", method="GET", times=2, code="SlowDown"))
    proxy.add_rule(Rule("error", method="GET", path_regex="nomatch", code="InternalError"))
    outcomes = []
    for _ in range(5):
        try:
            outcomes.append(_get(via, bucket, "k"))
        except bexc.ClientError as exc:
            outcomes.append(exc.response["Error"]["Code"])
    assert outcomes == ["SlowDown", "SlowDown", b"v", b"v", b"v"]
    assert proxy.counts() == {"error": 2}
    assert proxy.events == [FaultEvent("error", "GET", f"/{bucket}/k", 503)] * 2

    # probability, with the proxy's seeded RNG: reproducible
    def pattern(p: FaultProxy, client) -> list[bool]:
        p.add_rule(Rule("error", method="HEAD", probability=0.3))
        out = []
        for _ in range(40):
            try:
                client.head_object(Bucket=bucket, Key="k")
                out.append(False)
            except bexc.ClientError:
                out.append(True)
        return out

    proxy.clear_rules()
    first = pattern(proxy, via)
    assert 3 <= sum(first) <= 25
    assert proxy.counts()["error"] == 2 + sum(first)
    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port, seed=1234) as again:
        assert pattern(again, _boto3(s3_server, again.endpoint_url)) == first

    # times and probability together
    proxy.clear_rules()
    rule = proxy.add_rule(Rule("delay", method="HEAD", probability=0.5, times=3))
    for _ in range(30):
        via.head_object(Bucket=bucket, Key="k")
    assert rule.fired == 3 and proxy.counts()["delay"] == 3


def test_crt_recovers_from_single_faults(s3_server, proxy, direct, bucket):
    """awscrt's own retries get a multipart upload through one fault of each kind."""
    crt = _crt_client(s3_server)
    data = os.urandom(12 * MiB)  # 3 parts
    proxy.add_rule(Rule("error", query_has="partNumber=1", times=1))
    proxy.add_rule(Rule("reset_request", query_has="partNumber=2", times=1, after_bytes=MiB))
    proxy.add_rule(Rule("reset_response", query_has="partNumber=3", times=1))
    _crt_put(crt, proxy, bucket, "crt/retried", data)
    assert _get(direct, bucket, "crt/retried") == data
    assert proxy.counts() == {"error": 1, "reset_request": 1, "reset_response": 1}
    parts = [r.target for r in proxy.requests if "partNumber=" in r.target]
    assert len(parts) == 6  # each part twice


def test_crt_without_retries_sees_the_fault(s3_server, proxy, direct, bucket):
    from awscrt.exceptions import AwsCrtError

    crt = _crt_client(s3_server, retries=False)
    proxy.add_rule(Rule("error", method="PUT", times=1))
    with pytest.raises(AwsCrtError) as ei:
        _crt_put(crt, proxy, bucket, "crt/fails", os.urandom(1000))
    assert ei.value.name == "AWS_ERROR_S3_SLOW_DOWN"
    with pytest.raises(bexc.ClientError):
        direct.head_object(Bucket=bucket, Key="crt/fails")
