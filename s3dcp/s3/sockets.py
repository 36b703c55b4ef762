"""Multipart uploads sent from the caller's buffers over blocking sockets.

    S3Client.put (multipart) ──► SocketUpload.start
        CreateMultipartUpload ──► UploadPart × N (a thread each, at most ``connections`` at once;
        the kernel reads the caller's memory) ──► CompleteMultipartUpload ──► on_done()
        any failure, cancel() or the deadline ──► AbortMultipartUpload ──► on_done(error)

Why not the CRT's PUT: it copies every part into a buffer of its own (which the kernel faults
in and zeroes again after the CRT trims its pool, seconds after a save), then writes it out in
16 KiB messages from its event loop. Measured on the 2-core machine against the same server, a
512 MiB upload cost the CRT 0.66-0.79 CPU s (131k page faults) and this path 0.22-0.24 CPU s,
at the same wall time (``docs/architecture.md``, "Uploads"). Downloads and small requests stay
on the CRT.

Owns :class:`SocketSender` (one per native client: its signing config, threads and idle
connections) and :class:`SocketUpload` (one multipart upload, behaving as the CRT's meta
request does for :class:`s3dcp.s3.request._Call`: ``cancel()``, and ``on_done(error=...)``
once nothing reads the caller's buffers any more). Each request is retried here, as the CRT
retries its own: on connection errors, HTTP 5xx, throttling and ``RequestTimeout``, with
full-jitter backoff, at most ``max_retries`` times. It must not queue requests or hold
deadlines (:mod:`s3dcp.s3.request`, :mod:`s3dcp.s3.native`).
"""

from __future__ import annotations

import base64
import http.client
import queue
import random
import socket
import ssl
import threading
import traceback
import xml.etree.ElementTree as ET
from typing import Callable, Sequence
from urllib.parse import quote, urlencode, urlsplit

from ..config import S3Config
from ..errors import S3ConnectionError, S3Error
from .responses import text

__all__ = ["SocketSender", "SocketUpload", "part_layout"]

_MAX_ANSWER = 1 << 20  # bytes of an answer's body read at most (errors and XML results are small)
_RETRY_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                          "TooManyRequestsException", "RequestThrottled", "RequestTimeout", "InternalError",
                          "ServiceUnavailable", "BadDigest", "XAmzContentChecksumMismatch"})
_XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"
_CHECKSUM_NAMES = {"crc32c": "CRC32C", "crc64nvme": "CRC64NVME"}
_MAX_PARTS = 10_000  # S3's limit


def part_layout(size: int, part_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each part: ``part_size`` long, more when 10,000 would not do."""
    part = max(part_size, -(-size // _MAX_PARTS))
    return [(offset, min(part, size - offset)) for offset in range(0, size, part)]


class _Cancelled(Exception):
    """The upload was cancelled (abort or deadline); :class:`_Call` says which."""


class _Answer:
    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


def _error_code(body: bytes) -> str | None:
    try:
        root = ET.fromstring(body) if body else None
    except ET.ParseError:
        return None
    if root is None or root.tag.rsplit("}", 1)[-1] != "Error":
        return None
    return text(root, "Code") or None


class SocketSender:
    """What every socket upload of one native client shares: the CRT's signing config (so the
    credentials are the CRT's), ``connections`` threads (started with its first upload) and
    their idle keep-alive connections. Made by :mod:`s3dcp.s3.native`; :meth:`close` when the
    native client goes."""

    def __init__(self, config: S3Config, signing_config, tls: bool) -> None:
        self.config = config
        self.connections = config.max_concurrency
        self._signing = signing_config
        self._tls = tls
        self._ssl: ssl.SSLContext | None = None
        if tls:
            self._ssl = ssl.create_default_context(cafile=config.ca_bundle)
            if not config.verify_tls:
                self._ssl.check_hostname = False
                self._ssl.verify_mode = ssl.CERT_NONE
        self._lock = threading.Lock()
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._closed = False
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on one of the sender's threads. They start together with the first job (a
        fixed number for the sender's life, so a long job's thread count stays flat) and end
        with :meth:`close`; RuntimeError once closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the sender is closed")
            if not self._threads:
                self._threads = [threading.Thread(target=self._work, name=f"s3dcp-put-{i}", daemon=True)
                                 for i in range(self.connections)]
                for thread in self._threads:
                    thread.start()
            self._jobs.put(job)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
            del job  # not kept alive while waiting for the next

    def close(self) -> None:
        """Let the threads end once the jobs queued are done and close the idle connections."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
            threads = len(self._threads)
        for _ in range(threads):
            self._jobs.put(None)
        for conns in idle.values():
            for conn in conns:
                conn.close()

    # -------------------------------------------------------------- one request, with retries
    def request(self, operation: str, method: str, host: str, path: str, headers: Sequence[tuple[str, str]],
                body: Sequence[memoryview] = (), *, live: "_Live", bucket: str, key: str) -> _Answer:
        """Send one request (``body``: views sent back to back) until it gets a final answer,
        retrying what S3 says to retry; raises ``_Cancelled`` once ``live`` is cancelled, or the
        translated error. Runs on a sender thread; blocks."""
        length = sum(v.nbytes for v in body)
        attempt = 0
        while True:
            if live.cancelled:
                raise _Cancelled()
            try:
                answer = self._exchange(method, host, path, [*headers, ("Content-Length", str(length))], body, live)
            except _Cancelled:
                raise
            except (OSError, http.client.HTTPException) as e:
                if live.cancelled:
                    raise _Cancelled() from e
                failure: BaseException = S3ConnectionError(
                    f"{operation} failed without an HTTP answer: {e!r}; check that the endpoint is reachable "
                    "and the server is running", operation=operation, bucket=bucket, key=key or None)
                failure.__cause__ = e
                retry = True
            else:
                code = _error_code(answer.body)
                if answer.status < 300 and code is None:
                    return answer
                failure = _response_error(answer, operation)
                retry = answer.status >= 500 or answer.status == 429 or code in _RETRY_CODES
            if not retry or attempt >= self.config.max_retries:
                raise failure
            attempt += 1
            cap = min(self.config.retry_max_backoff_s, self.config.retry_backoff_base_ms / 1000 * 2 ** attempt)
            if live.wait(random.uniform(0, cap)):
                raise _Cancelled()

    def _exchange(self, method, host, path, headers, body, live: "_Live") -> _Answer:
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.auth import aws_sign_request

        request = HttpRequest(method, path, HttpHeaders([("Host", host), *headers]))
        aws_sign_request(request, self._signing).result()
        conn, reused = self._connection(host)
        try:
            live.track(conn)
            try:
                conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                for name, value in request.headers:
                    conn.putheader(name, value)
                conn.endheaders()
                for view in body:
                    conn.send(view)
                response = conn.getresponse()
                data = response.read(_MAX_ANSWER + 1)
            finally:
                live.untrack(conn)
        except (OSError, http.client.HTTPException):
            conn.close()
            if reused and not live.cancelled:  # the server closed an idle connection: not a failure
                return self._exchange(method, host, path, headers, body, live)
            raise
        if len(data) > _MAX_ANSWER or not response.isclosed():
            conn.close()  # an answer this large is not S3's; its rest is not read
            if len(data) > _MAX_ANSWER:
                raise S3Error(f"{method} {path}: the server's answer is larger than {_MAX_ANSWER} bytes")
        elif response.will_close:
            conn.close()
        else:
            self._keep(host, conn)
        return _Answer(response.status, response.getheaders(), data)

    def _connection(self, host: str) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            idle = self._idle.get(host)
            if idle:
                return idle.pop(), True
        parts = urlsplit("//" + host)
        timeout = self.config.connect_timeout_s
        if self._tls:
            conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        conn.connect()
        conn.sock.settimeout(None)  # the request's deadline (request_timeout_s) bounds it; cancel() unblocks
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn, False

    def _keep(self, host: str, conn) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(host, []).append(conn)
                return
        conn.close()


def _response_error(answer: _Answer, operation: str) -> BaseException:
    """An S3 answer that is not a success, as the CRT reports it, for ``translate_error``."""
    from awscrt.s3 import S3ResponseError

    return S3ResponseError(code=0, name="AWS_ERROR_S3_INVALID_RESPONSE_STATUS",
                           message=f"{operation}: HTTP {answer.status}", status_code=answer.status,
                           headers=answer.headers, body=answer.body, operation_name=operation)


class _Live:
    """Whether an upload goes on, and the connections its threads are blocked on (shut down by
    :meth:`cancel`, which wakes those threads)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._conns: set = set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)

    def cancel(self) -> None:
        self._event.set()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def track(self, conn) -> None:
        with self._lock:
            self._conns.add(conn)
        if self.cancelled:
            self.cancel()

    def untrack(self, conn) -> None:
        with self._lock:
            self._conns.discard(conn)


class SocketUpload:
    """One multipart upload of ``views`` (sent back to back as one object), driven by callbacks
    on the sender's threads; nothing here blocks the caller. Made before it is queued;
    :meth:`start` runs it on a native client's sender; :attr:`etag` is the object's once done."""

    def __init__(self, bucket: str, key: str, host: str, path: str, views: Sequence[memoryview], *,
                 part_size: int, checksum: str | None, create_headers: Sequence[tuple[str, str]],
                 part_headers: Sequence[tuple[str, str]]) -> None:
        self.bucket, self.key, self._host, self._path = bucket, key, host, path
        self._views = list(views)
        self._create_headers, self._part_headers = list(create_headers), list(part_headers)
        self._checksum = checksum
        self._parts = part_layout(sum(v.nbytes for v in self._views), part_size)
        self._answers: list[tuple[str, str | None] | None] = [None] * len(self._parts)
        self._pending = len(self._parts)
        self._failure: BaseException | None = None
        self._live = _Live()
        self._lock = threading.Lock()
        self._sender: SocketSender | None = None
        self._on_done: Callable | None = None
        self._upload_id: str | None = None
        self.etag: str | None = None

    def start(self, native, on_done: Callable) -> "SocketUpload":
        """Run on ``native.sender`` (the ``start`` of :class:`s3dcp.s3.request._Call`)."""
        self._sender, self._on_done = native.sender, on_done
        self._run(self._create, self._created_or_failed)
        return self

    def cancel(self) -> None:
        self._live.cancel()

    # ------------------------------------------------------------------ steps
    # create, then every part (each on a thread of its own), then complete: the step that fails
    # first is the upload's failure; once no part runs, the upload is aborted and reported.
    def _run(self, step: Callable[[], None], failed: Callable[[BaseException], None]) -> None:
        def guarded() -> None:
            try:
                step()
            except BaseException as e:  # noqa: BLE001 - reaches the caller's future
                failed(_without_locals(e))
        try:
            self._sender.submit(guarded)
        except RuntimeError as e:  # the sender was closed under us
            failed(S3ConnectionError(f"upload of s3://{self.bucket}/{self.key}: the client was closed ({e})"))

    def _send(self, operation: str, method: str, query: dict | str, headers, body=(), live=None) -> _Answer:
        if not isinstance(query, str):
            query = urlencode(query, quote_via=quote, safe="-_.~")
        path = self._path + "?" + query
        return self._sender.request(operation, method, self._host, path, headers, body,
                                    live=live or self._live, bucket=self.bucket, key=self.key)

    def _xml(self, operation: str, answer: _Answer):
        try:
            return ET.fromstring(answer.body)
        except ET.ParseError as e:
            raise S3Error(f"{operation} s3://{self.bucket}/{self.key}: the answer is not XML ({e})",
                          operation=operation, bucket=self.bucket, key=self.key) from e

    def _create(self) -> None:
        answer = self._send("CreateMultipartUpload", "POST", "uploads", self._create_headers)
        upload_id = text(self._xml("CreateMultipartUpload", answer), "UploadId")
        if not upload_id:
            raise S3Error(f"CreateMultipartUpload s3://{self.bucket}/{self.key}: the answer names no UploadId",
                          operation="CreateMultipartUpload", bucket=self.bucket, key=self.key)
        self._upload_id = upload_id
        for number in range(len(self._parts)):
            self._run(lambda number=number: self._part(number), self._part_ended)

    def _part(self, number: int) -> None:
        if self._live.cancelled:
            raise _Cancelled()
        offset, length = self._parts[number]
        body = _slices(self._views, offset, length)
        headers = [*self._part_headers]
        value = None
        if self._checksum is not None:
            value = _checksum(self._checksum, body)
            headers.append((f"x-amz-checksum-{self._checksum}", value))
        answer = self._send("UploadPart", "PUT", {"partNumber": str(number + 1), "uploadId": self._upload_id},
                            headers, body)
        etag = answer.header("ETag")
        if not etag:
            raise S3Error(f"UploadPart {number + 1} of s3://{self.bucket}/{self.key}: the answer has no ETag",
                          operation="UploadPart", bucket=self.bucket, key=self.key)
        self._answers[number] = (etag, value)
        self._part_ended(None)

    def _part_ended(self, error: BaseException | None) -> None:
        with self._lock:
            first = error is not None and self._failure is None
            if first:
                self._failure = error
            self._pending -= 1
            last, failure = self._pending == 0, self._failure
        if first:
            self._live.cancel()  # wakes the other parts' threads
        if last and failure is None:
            self._complete_or_abort()
        elif last:
            self._abort_and_finish(failure)

    def _complete_or_abort(self) -> None:
        try:
            self._complete()
        except BaseException as e:  # noqa: BLE001 - reaches the caller's future
            self._abort_and_finish(e)

    def _complete(self) -> None:
        root = ET.Element("CompleteMultipartUpload", xmlns=_XMLNS)
        for number, (etag, value) in enumerate(self._answers, 1):  # type: ignore[misc]
            part = ET.SubElement(root, "Part")
            ET.SubElement(part, "PartNumber").text = str(number)
            ET.SubElement(part, "ETag").text = etag
            if value is not None:
                ET.SubElement(part, "Checksum" + _CHECKSUM_NAMES[self._checksum]).text = value
        body = ET.tostring(root, encoding="utf-8", xml_declaration=True)
        answer = self._send("CompleteMultipartUpload", "POST", {"uploadId": self._upload_id},
                            [("Content-Type", "application/xml"), *self._part_headers], [memoryview(body)])
        self.etag = text(self._xml("CompleteMultipartUpload", answer), "ETag") or answer.header("ETag")
        self._finish(None)

    def _created_or_failed(self, error: BaseException) -> None:
        """Creating the upload failed (a cancel while its answer was on the way leaves an upload
        that ``s3dcp gc`` lists, as with the CRT)."""
        self._finish(error)

    def _abort_and_finish(self, error: BaseException) -> None:
        try:  # a fresh _Live: the upload's own is cancelled, and the abort must still go out
            self._send("AbortMultipartUpload", "DELETE", {"uploadId": self._upload_id}, self._part_headers,
                       live=_Live())
        except BaseException:  # noqa: BLE001 - the failure that matters is the upload's; gc lists leftovers
            pass
        self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        on_done, self._on_done = self._on_done, None
        self._views = []
        if on_done is not None:
            on_done(error=error)


def _without_locals(error: BaseException) -> BaseException:
    """``error`` with the locals of its tracebacks' finished frames cleared (and of its causes'):
    a part's frames hold views of the caller's buffers, which an error kept by the future must
    not keep alive."""
    seen, link = set(), error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        traceback.clear_frames(link.__traceback__)
        link = link.__cause__ or link.__context__
    return error


def _slices(views: Sequence[memoryview], offset: int, length: int) -> list[memoryview]:
    """The pieces of ``views`` (back to back) covering ``[offset, offset + length)``."""
    out = []
    for view in views:
        n = view.nbytes
        if offset >= n:
            offset -= n
            continue
        take = min(n - offset, length)
        out.append(view[offset:offset + take])
        length -= take
        offset = 0
        if length == 0:
            break
    return out


def _checksum(algorithm: str, body: Sequence[memoryview]) -> str:
    from awscrt import checksums  # releases the GIL while it runs

    if algorithm == "crc32c":
        crc = 0
        for view in body:
            crc = checksums.crc32c(view, crc)
        return base64.b64encode(crc.to_bytes(4, "big")).decode()
    crc = 0
    for view in body:
        crc = checksums.crc64nvme(view, crc)
    return base64.b64encode(crc.to_bytes(8, "big")).decode()
