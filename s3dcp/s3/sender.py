"""Requests over s3dcp's own blocking sockets: the threads, connections and retries that
multipart uploads (:mod:`s3dcp.s3.sockets`) and ranged reads (:mod:`s3dcp.s3.socket_reads`)
run on.

    SocketSender.submit(job) ──► one of ``connections`` threads (started with the first job)
    SocketSender.request ──sign (the CRT's signing config)──► a kept-alive connection ──► answer
        connection error, 5xx, 429, throttling, RequestTimeout ──► full-jitter backoff, again

Owns :class:`SocketSender` (one per native client: its signing config, threads and idle
connections), :class:`Flow` (one operation's requests as the CRT's meta request behaves),
:class:`Live` (whether a flow goes on; cancel wakes its blocked threads), the answers and
errors of one request (translated as the CRT's are; an answer the server sent before it
stopped reading a body is read, not lost) and what these sockets cannot do, refused by name
(:func:`refuse_proxy`, :func:`refuse_directory_bucket`). Each request is retried here, as the CRT
retries its own, at most ``max_retries`` times. It must not know what an upload or a read is
(:mod:`s3dcp.s3.sockets`, :mod:`s3dcp.s3.socket_reads`) nor queue requests or hold deadlines
(:mod:`s3dcp.s3.request`).
"""

from __future__ import annotations

import http.client
import queue
import random
import socket
import ssl
import threading
import traceback
import xml.etree.ElementTree as ET
from typing import Callable, Sequence
from urllib.parse import urlsplit

from ..config import S3Config
from ..errors import ConfigError, S3ConnectionError, S3Error
from ..uri import directory_bucket_zone
from .proxy import proxy_for
from .responses import text

__all__ = ["Answer", "Cancelled", "Flow", "Live", "SocketSender", "refuse_proxy", "refuse_directory_bucket"]

_MAX_ANSWER = 1 << 20  # bytes of an answer's body read at most (errors and XML results are small)
STALL_S = 30.0  # a connection that moves no byte for this long is dropped and its request retried
_SEND_SLICE = 1 << 20  # bytes per sendall, each bounded by STALL_S (a stall, not a slow link, fails)
_EARLY_ANSWER_S = 5.0  # after a failed send, how long the answer the server may have sent is waited for
_RETRY_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                          "TooManyRequestsException", "RequestThrottled", "RequestTimeout", "InternalError",
                          "ServiceUnavailable", "BadDigest", "XAmzContentChecksumMismatch"})


def refuse_proxy(config: S3Config) -> None:
    """ConfigError if the environment names an HTTP proxy for the endpoint: the CRT's requests
    would go through it and these sockets, which connect directly, would not (where S3 is
    reachable only through the proxy, every part would fail)."""
    proxy = proxy_for(config.endpoint_url)
    if proxy is not None:  # the variable's name only: its value may hold the proxy's password
        raise ConfigError(
            f"transport='sockets' does not go through HTTP proxies, and {proxy[0]} names one for "
            f"{config.endpoint_url}: use transport='crt' (S3Config(transport='crt') or S3DCP_TRANSPORT=crt), "
            f"whose requests follow {proxy[0]} and NO_PROXY, or name the endpoint's host in NO_PROXY")


def refuse_directory_bucket(bucket: str) -> None:
    """ConfigError for an S3 Express One Zone directory bucket, whose requests need the session
    credentials (CreateSession) that only the CRT makes."""
    if directory_bucket_zone(bucket) is not None:
        raise ConfigError(
            f"transport='sockets' cannot sign for the S3 Express One Zone directory bucket {bucket!r} (its "
            "requests need the session credentials of CreateSession, which only the CRT makes): use "
            "transport='crt' (S3Config(transport='crt') or S3DCP_TRANSPORT=crt)")


class Cancelled(Exception):
    """The flow was cancelled (abort or deadline); :class:`s3dcp.s3.request._Call` says which."""


class Answer:
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
    """What every socket transfer of one native client shares: the CRT's signing config (so the
    credentials are the CRT's), ``connections`` threads (started with its first transfer) and
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
                self._threads = [threading.Thread(target=self._work, name=f"s3dcp-net-{i}", daemon=True)
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
                body: Sequence[memoryview] = (), *, live: "Live", bucket: str, key: str,
                into: Callable | None = None, final: Sequence[int] = ()) -> Answer:
        """Send one request (``body``: views sent back to back) until it gets a final answer,
        retrying what S3 says to retry; raises ``Cancelled`` once ``live`` is cancelled, or the
        translated error. ``into(response)`` reads a 2xx answer's body (a GET's bytes, into the
        caller's buffers; a failure in it is retried as a lost connection is); ``final``: other
        statuses returned as answers. Runs on a sender thread; blocks."""
        length = sum(v.nbytes for v in body)
        if body or method in ("PUT", "POST"):
            headers = [*headers, ("Content-Length", str(length))]
        attempt = 0
        while True:
            if live.cancelled:
                raise Cancelled()
            try:
                answer = self._exchange(method, host, path, headers, body, live, into)
            except Cancelled:
                raise
            except (OSError, http.client.HTTPException) as e:
                if live.cancelled:
                    raise Cancelled() from e
                failure: BaseException = S3ConnectionError(
                    f"{operation} failed without an HTTP answer: {e!r}; check that the endpoint is reachable "
                    "and the server is running", operation=operation, bucket=bucket, key=key or None)
                failure.__cause__ = e
                retry = True
            else:
                code = _error_code(answer.body)
                if (answer.status < 300 and code is None) or answer.status in final:
                    return answer
                failure = _response_error(answer, operation)
                retry = answer.status >= 500 or answer.status == 429 or code in _RETRY_CODES
            if not retry or attempt >= self.config.max_retries:
                raise failure
            attempt += 1
            cap = min(self.config.retry_max_backoff_s, self.config.retry_backoff_base_ms / 1000 * 2 ** attempt)
            if live.wait(random.uniform(0, cap)):
                raise Cancelled()

    def _exchange(self, method, host, path, headers, body, live: "Live", into=None) -> Answer:
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.auth import aws_sign_request

        request = HttpRequest(method, path, HttpHeaders([("Host", host), *headers]))
        aws_sign_request(request, self._signing).result()
        conn, reused = self._connection(host)
        response = early = None
        try:
            live.track(conn)
            try:
                conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                for name, value in request.headers:
                    conn.putheader(name, value)
                conn.endheaders()
                try:
                    for view in body:  # in slices: a socket's timeout bounds each sendall as a whole
                        for at in range(0, view.nbytes, _SEND_SLICE):
                            conn.send(view[at:at + _SEND_SLICE])
                except OSError as unsent:
                    response = early = _early_answer(conn, unsent, live)
                else:
                    response = conn.getresponse()
                if into is not None and response.status < 300:
                    into(response)
                data = response.read(_MAX_ANSWER + 1)
            finally:
                live.untrack(conn)
        except BaseException as e:
            conn.close()  # whatever is left of the exchange on it is unknown
            stale = reused and response is None and isinstance(e, (OSError, http.client.HTTPException))
            if stale and not live.cancelled:  # the server had closed the idle connection: not a failure
                return self._exchange(method, host, path, headers, body, live, into)
            raise
        if len(data) > _MAX_ANSWER or not response.isclosed() or early is not None:
            # an answer this large is not S3's (its rest is not read); one that came before the
            # whole body went out leaves the connection unusable
            conn.close()
            if len(data) > _MAX_ANSWER:
                raise S3Error(f"{method} {path}: the server's answer is larger than {_MAX_ANSWER} bytes")
        elif response.will_close:
            conn.close()
        else:
            self._keep(host, conn)
        return Answer(response.status, response.getheaders(), data)

    def _connection(self, host: str) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            idle = self._idle.get(host)
            if idle:
                return idle.pop(), True
        parts = urlsplit("//" + host)
        timeout = self.config.connect_timeout_s
        port = parts.port or (443 if self._tls else 80)  # given: http.client would read "::1" as host ":", port 1
        if self._tls:
            conn = http.client.HTTPSConnection(parts.hostname, port, timeout=timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(parts.hostname, port, timeout=timeout)
        conn.connect()
        # A send or receive that makes no progress for STALL_S fails the exchange, which is retried
        # (the CRT drops a connection that stalls as long); the request's deadline
        # (request_timeout_s) bounds the whole, and cancel() unblocks it at once.
        conn.sock.settimeout(STALL_S)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn, False

    def _keep(self, host: str, conn) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(host, []).append(conn)
                return
        conn.close()


def _early_answer(conn: http.client.HTTPConnection, unsent: OSError, live: "Live") -> http.client.HTTPResponse:
    """The answer the server sent before it stopped reading the request's body, read after the
    send failed: S3 refuses a request on its head alone (``ExpiredToken``, ``AccessDenied``) and
    closes the connection while a large part is still being sent, and that answer, not a
    connection error and a resent part, is what the caller needs. Only an error counts (a
    success before the whole body went out is none); without one, the send's own failure."""
    if live.cancelled or conn.sock is None:
        raise unsent
    try:
        conn.sock.settimeout(_EARLY_ANSWER_S)  # it is there at once, or the server sent none
        response = conn.getresponse()
    except (OSError, http.client.HTTPException):
        raise unsent from None
    if response.status < 300:
        raise unsent
    return response


def _response_error(answer: Answer, operation: str) -> BaseException:
    """An S3 answer that is not a success, as the CRT reports it, for ``translate_error``."""
    from awscrt.s3 import S3ResponseError

    return S3ResponseError(code=0, name="AWS_ERROR_S3_INVALID_RESPONSE_STATUS",
                           message=f"{operation}: HTTP {answer.status}", status_code=answer.status,
                           headers=answer.headers, body=answer.body, operation_name=operation)


class Live:
    """Whether a flow goes on, and the connections its threads are blocked on (shut down by
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


class Flow:
    """One operation's requests run as jobs on a sender's threads, behaving as the CRT's meta
    request does for :class:`s3dcp.s3.request._Call`: ``cancel()``, and ``on_done(error=...)``
    once, when no job touches the caller's buffers any more. A subclass starts its first jobs in
    :meth:`_begin`, drops the caller's buffers in :meth:`_release` and ends with :meth:`_finish`."""

    operation = "request"

    def __init__(self, bucket: str, key: str) -> None:
        self.bucket, self.key = bucket, key
        self._live = Live()
        self._lock = threading.Lock()
        self._sender: SocketSender | None = None
        self._on_done: Callable | None = None
        self._pending = 0  # parts not ended yet (a subclass sets it before they start)
        self._failure: BaseException | None = None  # the first part's failure

    def start(self, native, on_done: Callable) -> "Flow":
        """Run on ``native.sender`` (the ``start`` of :class:`s3dcp.s3.request._Call`)."""
        refuse_directory_bucket(self.bucket)
        self._sender, self._on_done = native.sender, on_done
        self._begin()
        return self

    def cancel(self) -> None:
        self._live.cancel()

    def _begin(self) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        """Drop every reference to the caller's buffers."""

    def _run(self, step: Callable[[], None], failed: Callable[[BaseException], None]) -> None:
        """``step`` on a sender thread; what it raises goes to ``failed`` (there too)."""
        def guarded() -> None:
            try:
                step()
            except BaseException as e:  # noqa: BLE001 - reaches the caller's future
                failed(_without_locals(e))
        try:
            self._sender.submit(guarded)
        except RuntimeError as e:  # the sender was closed under us
            failed(S3ConnectionError(f"{self.operation} s3://{self.bucket}/{self.key}: the client was closed ({e})"))

    def _part_ended(self, error: BaseException | None) -> tuple[bool, BaseException | None]:
        """Count one part as ended (failed with ``error``, unless None); the first failure
        cancels the others, waking their threads. Whether it was the last, and the failure."""
        with self._lock:
            first = error is not None and self._failure is None
            if first:
                self._failure = error
            self._pending -= 1
            last, failure = self._pending == 0, self._failure
        if first:
            self._live.cancel()
        return last, failure

    def _finish(self, error: BaseException | None) -> None:
        on_done, self._on_done = self._on_done, None
        self._release()
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
