"""A small fault-injecting HTTP/1.1 proxy for S3 failure tests.

The proxy listens on ``127.0.0.1:<free port>`` and forwards every client
connection to an upstream S3 server over its own upstream TCP connection
(one upstream connection per client connection, kept alive as long as both
sides allow it).  Requests and responses are forwarded verbatim -- the Host
header is *not* rewritten, so SigV4 signatures computed for the proxy's
``host:port`` stay valid at a server that verifies them against the Host
header it receives (SeaweedFS does).

Both directions are parsed as HTTP/1.1 so that message boundaries on
keep-alive connections are known:

* request bodies: ``Transfer-Encoding: chunked`` (chunk sizes parsed, chunk
  extensions and trailers forwarded verbatim), else ``Content-Length``, else
  no body;
* ``Expect: 100-continue``: the upstream's interim ``100 Continue`` (and any
  other 1xx) is relayed while the request body is being forwarded; an early
  final response from upstream is relayed too (and both connections are closed
  afterwards, since the request body may not have been sent);
* response bodies: none for HEAD requests and 1xx/204/304 responses, else
  chunked, else ``Content-Length``, else until the upstream closes.

Bodies are streamed in chunks of up to ``_READ_SIZE`` bytes; nothing is ever
buffered whole.

Faults are described by :class:`Rule` objects that can be added or cleared
from any thread while the proxy's event loop runs in its own daemon thread.
For every request head the first rule (in insertion order) that matches and
fires (after its ``times``/``probability`` checks) is applied:

``error``
    The request is not forwarded.  Its body is read and discarded, then an S3
    XML error (``status``/``code``) is returned and the connection stays
    usable.  If the request carries ``Expect: 100-continue`` the error is sent
    at once, without reading the body, and the connection is closed.
``reset_request``
    The request head and at most ``after_bytes`` bytes of the request body (as
    they appear on the wire, i.e. including chunk framing) are forwarded, but
    never the complete request: if the whole request would fit in
    ``after_bytes`` its last byte is held back (for a request without a body
    the head's final CRLF is held back).  Then the client connection is reset
    (SO_LINGER 0 + close => TCP RST) and the upstream connection is aborted.
    The upstream therefore never sees a complete request.
``reset_response``
    The request is forwarded completely; the response head and at most
    ``after_bytes`` bytes of the response body (wire bytes) are relayed, but
    never the complete response (same hold-back rule as above, so a PUT's
    empty-bodied 200 is never delivered).  Then the client connection is
    reset.  The upstream has processed the request: this simulates "the
    server did it, but the client never learnt".
``stall_response``
    As ``reset_response``, but instead of the reset the connection goes silent:
    nothing more is relayed to the client, whose connection stays open until it
    closes it (a server or network path that stops mid-answer). The upstream
    connection is aborted.
``delay``
    Sleep ``delay_s`` seconds after the request head arrived, then forward
    normally.
``stall``
    Never answer.  Whatever the client sends is read and discarded until it
    closes the connection or the proxy stops.
``answer``
    The request is not forwarded (its body is read and discarded); ``status`` is returned
    with ``body`` (XML) verbatim and the connection stays usable: a hostile or broken server's
    answer, such as a listing page that names its own continuation token again.
``answer_early``
    The request is not forwarded and its body is not read: ``status`` with ``body`` (or, with no
    body, the XML error of ``code``) is sent at once, then the connection is reset once the
    answer has left (the body still coming in makes the close a RST), as S3 answers a request
    it refuses on its head alone (``ExpiredToken``) while a large part is still being sent.
``add_headers``
    Forward the request with ``headers`` added to its head.  SigV4 checks only
    the headers a request signed, so an added header reaches the upstream as if
    the client had sent it unsigned.

Besides method, path and query, a rule can look at the request's headers:
``header`` matches when some header, written ``name: value`` with the name in
lower case, matches the regex (``re.search``); ``without_header`` when none does.
``error``, ``answer`` and ``answer_early`` send ``answer_headers`` (``((name, value), ...)``)
besides their own (``x-amz-bucket-region``, an answer's ``Date``: a later one replaces theirs).

:func:`store_rules` builds the rules that make the upstream behave like a store
without S3's newer features (see docs/compatibility.md): ``"basic"`` rejects
flexible checksums, ``If-None-Match`` on PUT and CreateMultipartUpload without
``Content-Length`` (as GCS's XML API and older Ceph RGW / MinIO releases do);
``"gcs"`` does the same and honours GCS's create-only precondition
``x-goog-if-generation-match: 0`` by the upstream's own ``If-None-Match: *``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import http
import random
import re
import socket
import struct
import termios
import threading
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any, Optional

__all__ = ["Rule", "FaultEvent", "RequestRecord", "FaultProxy", "ACTIONS", "STORES", "store_rules"]

ACTIONS = ("error", "reset_request", "reset_response", "stall_response", "delay", "stall", "add_headers", "answer",
           "answer_early")

_READ_SIZE = 1 << 20  # max bytes per read when streaming bodies
_STREAM_LIMIT = 1 << 20  # StreamReader buffer limit (also max head/line length)
_WRITE_HIGH_WATER = 4 << 20
_RST_FLUSH_TIMEOUT_S = 2.0  # how long to wait for sent bytes to leave the kernel before a RST

_ERROR_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
    "RequestTimeout": "Your socket connection to the server was not read from or "
    "written to within the timeout period.",
    "InvalidArgument": "Invalid argument.",
    "NotImplemented": "A header you provided implies functionality that is not implemented.",
    "MissingContentLength": "You must provide the Content-Length HTTP header.",
}


@dataclass
class Rule:
    """A fault rule.  See the module docstring for what each action does."""

    action: str  # one of ACTIONS
    method: Optional[str] = None  # match "PUT", "GET", ...; None = any
    path_regex: Optional[str] = None  # re.search on the request target (path + query)
    query_has: Optional[str] = None  # substring of the query string, e.g. "partNumber"
    probability: float = 1.0  # apply with this probability (seeded RNG of the proxy)
    times: Optional[int] = None  # apply at most this many times (None = unlimited)
    status: int = 503  # for "error"
    code: str = "SlowDown"  # S3 error code put in the XML body for "error"
    after_bytes: int = 0  # for reset_*: body bytes forwarded before the reset
    delay_s: float = 0.0  # for "delay": sleep before forwarding
    header: Optional[str] = None  # re.search on some "name: value" (name lower case)
    without_header: Optional[str] = None  # ... and on none of them
    headers: tuple = ()  # for "add_headers": ((name, value), ...) added to the request head
    body: bytes = b""  # for "answer" / "answer_early": the response body, with ``status``
    answer_headers: tuple = ()  # for "error", "answer", "answer_early": ((name, value), ...) sent too
    fired: int = field(default=0, init=False, compare=False)  # times applied so far

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; expected one of {ACTIONS}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError("probability must be in [0, 1]")
        if self.after_bytes < 0 or self.delay_s < 0:
            raise ValueError("after_bytes and delay_s must be >= 0")
        self._regex = re.compile(self.path_regex) if self.path_regex is not None else None
        self._header = re.compile(self.header) if self.header is not None else None
        self._without = re.compile(self.without_header) if self.without_header is not None else None

    def matches(self, method: str, target: str, headers=()) -> bool:
        if self.method is not None and self.method.upper() != method.upper():
            return False
        if self._regex is not None and not self._regex.search(target):
            return False
        if self._header is not None or self._without is not None:
            lines = [f"{k.lower()}: {v}" for k, v in headers]
            if self._header is not None and not any(self._header.search(x) for x in lines):
                return False
            if self._without is not None and any(self._without.search(x) for x in lines):
                return False
        if self.query_has is not None:
            _, sep, query = target.partition("?")
            if not sep or self.query_has not in query:
                return False
        return True


@dataclass(frozen=True)
class FaultEvent:
    """A fault that was applied.  ``status`` is the injected status for "error" and the answers, else None."""

    action: str
    method: str
    target: str
    status: Optional[int] = None


@dataclass(frozen=True)
class RequestRecord:
    """A request head seen by the proxy (in arrival order)."""

    conn_id: int  # client connection number (1-based); equal ids = same keep-alive connection
    method: str
    target: str
    headers: tuple  # ((name, value), ...) as received, original case
    fault: Optional[str] = None  # action applied to this request, if any

    def header(self, name: str) -> Optional[str]:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None


class _ProtocolError(Exception):
    pass


class _Cut(Exception):
    """Raised by _Meter once its byte budget is exhausted."""


class _Head:
    __slots__ = ("raw", "start", "headers", "lower")

    def __init__(self, raw: bytes):
        self.raw = raw
        try:
            text = raw.decode("latin-1")
        except Exception as exc:  # pragma: no cover - latin-1 never fails
            raise _ProtocolError(str(exc)) from exc
        lines = text.split("\r\n")
        self.start = lines[0]
        self.headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            if not line:
                continue
            if line[0] in " \t" and self.headers:  # obsolete line folding
                k, v = self.headers[-1]
                self.headers[-1] = (k, v + " " + line.strip())
                continue
            name, sep, value = line.partition(":")
            if not sep:
                raise _ProtocolError(f"bad header line {line!r}")
            self.headers.append((name.strip(), value.strip()))
        self.lower: dict[str, str] = {}
        for k, v in self.headers:
            lk = k.lower()
            self.lower[lk] = f"{self.lower[lk]}, {v}" if lk in self.lower else v

    def get(self, name: str) -> Optional[str]:
        return self.lower.get(name)

    def tokens(self, name: str) -> list[str]:
        v = self.lower.get(name)
        return [t.strip().lower() for t in v.split(",") if t.strip()] if v else []

    def is_chunked(self) -> bool:
        te = self.tokens("transfer-encoding")
        return bool(te) and te[-1] == "chunked"

    def content_length(self) -> Optional[int]:
        v = self.lower.get("content-length")
        if v is None:
            return None
        vals = {x.strip() for x in v.split(",")}
        if len(vals) != 1:
            raise _ProtocolError(f"conflicting Content-Length {v!r}")
        try:
            n = int(vals.pop())
        except ValueError as exc:
            raise _ProtocolError(f"bad Content-Length {v!r}") from exc
        if n < 0:
            raise _ProtocolError(f"bad Content-Length {v!r}")
        return n


class _Meter:
    """Writes to a StreamWriter, optionally stopping after ``limit`` bytes.

    ``write(data, last=True)`` marks the final bytes of a message: if they
    would all fit into the budget, the last byte is held back, so that a
    metered message is never delivered completely.  Raises _Cut when the
    budget ends the message.  ``writer=None`` discards (used for draining).
    """

    def __init__(self, writer: Optional[asyncio.StreamWriter], limit: Optional[int] = None):
        self.writer = writer
        self.left = limit
        self.sent = 0

    async def write(self, data: bytes, last: bool = False) -> None:
        if self.left is not None:
            n = len(data)
            if n > self.left or (last and n > 0):
                keep = min(self.left, n - 1) if last else self.left
                await self._send(data[:keep])
                self.left -= keep
                raise _Cut()
            self.left -= n
        await self._send(data)

    async def _send(self, data: bytes) -> None:
        if data and self.writer is not None:
            self.writer.write(data)
            self.sent += len(data)
            await self.writer.drain()


async def _read_head(reader: asyncio.StreamReader) -> Optional[bytes]:
    """Read a message head (up to and incl. the blank line); None on clean EOF."""
    while True:
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial.strip():
                return None
            raise _ProtocolError("connection closed inside a message head") from exc
        except asyncio.LimitOverrunError as exc:
            raise _ProtocolError("message head too large") from exc
        # tolerate stray CRLFs between messages (RFC 9112 2.2)
        stripped = raw.lstrip(b"\r\n")
        if stripped:
            return stripped


async def _copy_exact(reader: asyncio.StreamReader, out: _Meter, n: int, last: bool) -> None:
    while n > 0:
        data = await reader.read(min(n, _READ_SIZE))
        if not data:
            raise _ProtocolError(f"connection closed with {n} body bytes outstanding")
        n -= len(data)
        await out.write(data, last=last and n == 0)


async def _copy_chunked(reader: asyncio.StreamReader, out: _Meter) -> None:
    while True:
        try:
            line = await reader.readuntil(b"\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise _ProtocolError("bad chunk-size line") from exc
        size_txt = line.split(b";", 1)[0].strip()
        try:
            size = int(size_txt, 16)
        except ValueError as exc:
            raise _ProtocolError(f"bad chunk size {line!r}") from exc
        await out.write(line)
        if size == 0:
            break
        await _copy_exact(reader, out, size, last=False)
        crlf = await reader.readexactly(2)
        if crlf != b"\r\n":
            raise _ProtocolError("missing CRLF after chunk data")
        await out.write(crlf)
    # trailer section, terminated by an empty line
    while True:
        try:
            line = await reader.readuntil(b"\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise _ProtocolError("bad trailer section") from exc
        if line == b"\r\n":
            await out.write(line, last=True)
            return
        await out.write(line)


async def _copy_body(
    reader: asyncio.StreamReader, out: _Meter, head: _Head, kind: str
) -> None:
    """kind: 'chunked', 'length', 'none', 'close'."""
    if kind == "chunked":
        await _copy_chunked(reader, out)
    elif kind == "length":
        await _copy_exact(reader, out, head.content_length() or 0, last=True)
    elif kind == "close":
        while True:
            data = await reader.read(_READ_SIZE)
            if not data:
                return
            await out.write(data)


def _request_body_kind(head: _Head) -> str:
    if head.get("transfer-encoding") is not None:
        if not head.is_chunked():
            raise _ProtocolError("request Transfer-Encoding without final chunked")
        return "chunked"
    n = head.content_length()
    return "length" if n else "none"


def _response_body_kind(method: str, status: int, head: _Head) -> str:
    if method == "HEAD" or 100 <= status < 200 or status in (204, 304):
        return "none"
    if head.get("transfer-encoding") is not None:
        return "chunked" if head.is_chunked() else "close"
    n = head.content_length()
    if n is None:
        return "close"
    return "length" if n else "none"


def _set_linger0(writer: Optional[asyncio.StreamWriter]) -> None:
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def _flush_kernel(writer: asyncio.StreamWriter, timeout: float) -> None:
    """Wait (bounded) until bytes already written have left the kernel send queue."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.drain(), timeout)
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            if struct.unpack("i", buf)[0] == 0:
                return
        except OSError:
            return
        await asyncio.sleep(0.005)


class _Conn:
    """One client connection and its upstream connection."""

    def __init__(self, proxy: "FaultProxy", conn_id: int, reader, writer):
        self.proxy = proxy
        self.id = conn_id
        self.c_reader: asyncio.StreamReader = reader
        self.c_writer: asyncio.StreamWriter = writer
        self.u_reader: Optional[asyncio.StreamReader] = None
        self.u_writer: Optional[asyncio.StreamWriter] = None
        with contextlib.suppress(Exception):
            writer.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)

    # -- connection management ------------------------------------------------

    async def upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # An idle keep-alive upstream connection the server has closed (idle timeout)
        # or reset meanwhile is replaced, so the client never sees the upstream's idle close.
        if self.u_writer is not None and (self.u_reader.at_eof() or self.u_writer.is_closing()):
            self.close_upstream(abort=True)
        if self.u_writer is None:
            p = self.proxy
            self.u_reader, self.u_writer = await asyncio.open_connection(
                p.upstream_host, p.upstream_port, limit=_STREAM_LIMIT
            )
            with contextlib.suppress(Exception):
                self.u_writer.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
                self.u_writer.get_extra_info("socket").setsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
                )
            p._note_upstream_connection()
        return self.u_reader, self.u_writer

    def close_upstream(self, abort: bool = False) -> None:
        w, self.u_writer, self.u_reader = self.u_writer, None, None
        if w is not None:
            if abort:
                _set_linger0(w)
                w.transport.abort()
            else:
                w.close()

    async def reset_client(self, flush: bool = True) -> None:
        if flush:
            await _flush_kernel(self.c_writer, _RST_FLUSH_TIMEOUT_S)
        _set_linger0(self.c_writer)
        self.c_writer.transport.abort()

    def close_all(self) -> None:
        self.close_upstream(abort=True)
        with contextlib.suppress(Exception):
            self.c_writer.transport.abort()

    # -- main loop --------------------------------------------------------------

    async def run(self) -> None:
        with contextlib.suppress(Exception):
            self.c_writer.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )
        try:
            while True:
                raw = await _read_head(self.c_reader)
                if raw is None:
                    break
                if not await self.handle_request(_Head(raw)):
                    break
            # graceful close
            self.close_upstream()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.c_writer.drain(), 5)
            self.c_writer.close()
        except (_ProtocolError, ConnectionError, OSError, asyncio.IncompleteReadError):
            self.close_all()
        except asyncio.CancelledError:
            self.close_all()
            raise
        except BaseException:
            self.close_all()
            raise

    async def handle_request(self, head: _Head) -> bool:
        """Handle one request; returns whether the client connection stays open."""
        parts = head.start.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            raise _ProtocolError(f"bad request line {head.start!r}")
        method, target, version = parts[0].upper(), parts[1], parts[2]
        rule = self.proxy._match(method, target, head.headers)
        self.proxy._record(self.id, method, target, head, rule)
        body_kind = _request_body_kind(head)
        conn_tokens = head.tokens("connection")
        keep_alive = "close" not in conn_tokens and (
            version != "HTTP/1.0" or "keep-alive" in conn_tokens
        )
        expect_100 = "100-continue" in head.tokens("expect")

        action = rule.action if rule is not None else None
        if action in ("error", "answer"):
            return await self.answer_error(rule, method, head, body_kind, expect_100, keep_alive)
        if action == "answer_early":
            self.c_writer.write(self._answer_bytes(rule, method, close=True))
            await self.reset_client(flush=True)
            return False
        if action == "stall":
            while await self.c_reader.read(_READ_SIZE):
                pass
            return False
        if action == "delay":
            await asyncio.sleep(rule.delay_s)
        if action == "add_headers":
            added = "".join(f"{k}: {v}\r\n" for k, v in rule.headers).encode("latin-1")
            head = _Head(head.raw[:-2] + added + b"\r\n")

        req_limit = rule.after_bytes if action == "reset_request" else None
        resp_limit = rule.after_bytes if action in ("reset_response", "stall_response") else None
        return await self.forward(method, head, body_kind, req_limit, resp_limit, keep_alive,
                                  stall=action == "stall_response")

    # -- actions ----------------------------------------------------------------

    def _answer_bytes(self, rule: Rule, method: str, close: bool) -> bytes:
        """The answer of an "error", "answer" or "answer_early" rule, head and body."""
        request_id = f"fault-{self.proxy._next_fault_id()}"
        message = _ERROR_MESSAGES.get(rule.code, "Injected fault.")
        body = rule.body
        if rule.action == "error" or (rule.action == "answer_early" and not body):
            body = ('<?xml version="1.0" encoding="UTF-8"?>\n'
                    f"<Error><Code>{rule.code}</Code><Message>{message}</Message>"
                    f"<RequestId>{request_id}</RequestId></Error>").encode()
        try:
            reason = http.HTTPStatus(rule.status).phrase
        except ValueError:
            reason = "Error"
        headers = [
            ("Content-Type", "application/xml"),
            ("Content-Length", str(len(body))),
            ("x-amz-request-id", request_id),
            ("Date", formatdate(usegmt=True)),
            ("Server", "FaultProxy"),
            ("Connection", "close" if close else "keep-alive"),
        ]
        replaced = {name.lower() for name, _ in rule.answer_headers}
        headers = [(k, v) for k, v in headers if k.lower() not in replaced] + list(rule.answer_headers)
        lines = [f"HTTP/1.1 {rule.status} {reason}", *(f"{k}: {v}" for k, v in headers)]
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return data if method == "HEAD" else data + body

    async def answer_error(self, rule: Rule, method, head, body_kind, expect_100, keep_alive):
        close = expect_100 or not keep_alive
        if not expect_100:
            await _copy_body(self.c_reader, _Meter(None), head, body_kind)
        self.c_writer.write(self._answer_bytes(rule, method, close))
        await self.c_writer.drain()
        if close and expect_100:
            # lingering close: stop writing, discard whatever the client still
            # sends for a short while, so that closing does not turn into a RST
            # that could destroy the response before the client read it.
            async def discard() -> None:
                while await self.c_reader.read(_READ_SIZE):
                    pass

            with contextlib.suppress(Exception):
                self.c_writer.write_eof()
                await asyncio.wait_for(discard(), 2.0)
        return not close

    async def forward(self, method, head, body_kind, req_limit, resp_limit, keep_alive, stall=False) -> bool:
        u_reader, u_writer = await self.upstream()
        req_meter = _Meter(u_writer, req_limit)
        if body_kind == "none" and req_limit is not None:
            # reset_request on a request without a body: never complete the head
            u_writer.write(head.raw[:-2])
            await u_writer.drain()
            await self.reset_client(flush=False)
            self.close_upstream(abort=True)
            return False
        u_writer.write(head.raw)
        await u_writer.drain()

        req_task = asyncio.ensure_future(
            _copy_body(self.c_reader, req_meter, head, body_kind)
        )
        resp_task = asyncio.ensure_future(self.relay_response(method, resp_limit))
        try:
            done, _ = await asyncio.wait(
                {req_task, resp_task}, return_when=asyncio.FIRST_COMPLETED
            )
            if req_task in done:
                exc = req_task.exception()
                if isinstance(exc, _Cut):
                    # reset_request: upstream got the head and (part of) the body
                    resp_task.cancel()
                    await self.reset_client(flush=False)
                    self.close_upstream(abort=True)
                    return False
                if exc is not None:
                    raise exc
                # request fully forwarded; wait for the final response
                resp_keep = await resp_task
                return keep_alive and resp_keep
            # The response finished (or failed) before the request body task.
            exc = resp_task.exception()
            if exc is not None:
                raise exc
            # Normally the request task just has not been scheduled yet; give it
            # a moment before treating this as an early response.
            await asyncio.wait({req_task}, timeout=0.1)
            if req_task.done() and req_task.exception() is None:
                return keep_alive and resp_task.result()
            # early final response (e.g. error answering Expect: 100-continue):
            # the request body may be partly unsent -> connection unusable
            self.close_upstream(abort=True)
            return False
        except _Cut:
            # reset_response / stall_response (raised from resp_task via `await resp_task`)
            req_task.cancel()
            if stall:  # silent from here on, until the client gives up on the connection
                self.close_upstream(abort=True)
                while await self.c_reader.read(_READ_SIZE):
                    pass
                return False
            await self.reset_client(flush=True)
            self.close_upstream(abort=True)
            return False
        finally:
            for t in (req_task, resp_task):
                if not t.done():
                    t.cancel()
                    with contextlib.suppress(BaseException):
                        await t

    async def relay_response(self, method: str, resp_limit: Optional[int]) -> bool:
        """Relay 1xx responses and the final response; returns upstream keep-alive."""
        u_reader = self.u_reader
        while True:
            raw = await _read_head(u_reader)
            if raw is None:
                raise _ProtocolError("upstream closed before responding")
            head = _Head(raw)
            parts = head.start.split(" ", 2)
            try:
                version, status = parts[0], int(parts[1])
            except (IndexError, ValueError) as exc:
                raise _ProtocolError(f"bad status line {head.start!r}") from exc
            if 100 <= status < 200 and status != 101:
                self.c_writer.write(raw)
                await self.c_writer.drain()
                continue
            break
        kind = _response_body_kind(method, status, head)
        if kind == "none" and resp_limit is not None:
            # reset_response on a bodiless response: never complete the head
            self.c_writer.write(raw[:-2])
            await self.c_writer.drain()
            raise _Cut()
        self.c_writer.write(raw)
        await self.c_writer.drain()
        await _copy_body(u_reader, _Meter(self.c_writer, resp_limit), head, kind)
        if kind == "close" and resp_limit is not None:
            raise _Cut()
        tokens = head.tokens("connection")
        keep = (
            kind != "close"
            and "close" not in tokens
            and (version != "HTTP/1.0" or "keep-alive" in tokens)
            and status != 101
        )
        if not keep:
            self.close_upstream()
        return keep


class FaultProxy:
    """Fault-injecting HTTP/1.1 proxy running in a background thread.

    >>> with FaultProxy("127.0.0.1", s3_port) as proxy:
    ...     proxy.add_rule(Rule("error", method="PUT", times=1))
    ...     client = make_client(endpoint_url=proxy.endpoint_url)
    """

    def __init__(
        self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1", port: int = 0, seed: int = 0
    ):
        self.upstream_host = upstream_host
        self.upstream_port = int(upstream_port)
        self.host = host  # "::1" listens on IPv6's loopback
        self._listen_port = port  # 0: a free one
        self.port: Optional[int] = None
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._rules: list[Rule] = []
        self._events: list[FaultEvent] = []
        self._records: list[RequestRecord] = []
        self._requests_seen = 0
        self._connections = 0
        self._upstream_connections = 0
        self._fault_ids = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._server: Optional[asyncio.base_events.Server] = None
        self._tasks: set[asyncio.Task] = set()
        self._conns: set[_Conn] = set()
        self._stopped = False

    # -- lifecycle --------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise RuntimeError("proxy not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "FaultProxy":
        if self._thread is not None:
            raise RuntimeError("proxy already started")
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                try:
                    self._server = loop.run_until_complete(
                        asyncio.start_server(
                            self._on_client, self.host, self._listen_port, limit=_STREAM_LIMIT, backlog=256
                        )
                    )
                    self.port = self._server.sockets[0].getsockname()[1]
                except BaseException as exc:  # noqa: BLE001
                    failure.append(exc)
                    return
                finally:
                    ready.set()
                loop.run_forever()
            finally:
                with contextlib.suppress(Exception):
                    loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=main, name="FaultProxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        return self

    def stop(self) -> None:
        with self._lock:
            if self._stopped or self._thread is None:
                return
            self._stopped = True
        loop = self._loop
        if loop is not None and loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
            with contextlib.suppress(Exception):
                fut.result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.close_all()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    def __enter__(self) -> "FaultProxy":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- rules and reporting ----------------------------------------------------

    def add_rule(self, rule: Rule) -> Rule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove_rule(self, rule: Rule) -> None:
        with self._lock:
            self._rules = [r for r in self._rules if r is not rule]

    def clear_rules(self) -> None:
        with self._lock:
            self._rules = []

    @property
    def rules(self) -> list[Rule]:
        with self._lock:
            return list(self._rules)

    @property
    def events(self) -> list[FaultEvent]:
        """Snapshot of the faults applied so far, in order."""
        with self._lock:
            return list(self._events)

    @property
    def requests(self) -> list[RequestRecord]:
        """Snapshot of all request heads seen so far, in order."""
        with self._lock:
            return list(self._records)

    @property
    def requests_seen(self) -> int:
        with self._lock:
            return self._requests_seen

    @property
    def connections_accepted(self) -> int:
        with self._lock:
            return self._connections

    @property
    def upstream_connections(self) -> int:
        with self._lock:
            return self._upstream_connections

    def counts(self) -> dict[str, int]:
        """action -> times applied."""
        out: dict[str, int] = {}
        with self._lock:
            for ev in self._events:
                out[ev.action] = out.get(ev.action, 0) + 1
        return out

    def reset_stats(self) -> None:
        """Forget events and request records (rules and their `fired` counts stay)."""
        with self._lock:
            self._events.clear()
            self._records.clear()
            self._requests_seen = 0

    # -- internals (called on the proxy thread) ----------------------------------

    def _match(self, method: str, target: str, headers=()) -> Optional[Rule]:
        with self._lock:
            for rule in self._rules:
                if not rule.matches(method, target, headers):
                    continue
                if rule.times is not None and rule.fired >= rule.times:
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                rule.fired += 1
                status = rule.status if rule.action in ("error", "answer", "answer_early") else None
                self._events.append(FaultEvent(rule.action, method, target, status))
                return rule
        return None

    def _record(self, conn_id: int, method: str, target: str, head: _Head, rule) -> None:
        with self._lock:
            self._requests_seen += 1
            self._records.append(
                RequestRecord(
                    conn_id, method, target, tuple(head.headers), rule.action if rule else None
                )
            )

    def _next_fault_id(self) -> int:
        with self._lock:
            self._fault_ids += 1
            return self._fault_ids

    def _note_upstream_connection(self) -> None:
        with self._lock:
            self._upstream_connections += 1

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._lock:
            self._connections += 1
            conn_id = self._connections
        task = asyncio.current_task()
        conn = _Conn(self, conn_id, reader, writer)
        self._tasks.add(task)
        self._conns.add(conn)
        try:
            await conn.run()
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - a broken connection must not kill the proxy
            conn.close_all()
        finally:
            self._tasks.discard(task)
            self._conns.discard(conn)


# -- stores without S3's newer features -------------------------------------------

STORES = ("basic", "gcs")

# What such stores refuse (public reports: mountpoint-s3 #853, qdrant #9568, langfuse #13280):
# flexible checksums, conditional PUT, and a CreateMultipartUpload POST without Content-Length.
_CHECKSUM_HEADERS = r"^(x-amz-trailer|x-amz-checksum-[a-z0-9-]+|x-amz-sdk-checksum-algorithm):"


def store_rules(store: str) -> list[Rule]:
    """Rules (add them in order, before any others) that make the upstream answer like
    ``store``: ``"basic"`` (older Ceph RGW / MinIO) or ``"gcs"`` (GCS's XML API with HMAC keys).

    Both reject with 400 InvalidArgument a request carrying a flexible checksum (an aws-chunked
    trailer, ``x-amz-checksum-*``, ``x-amz-sdk-checksum-algorithm``), with 501 NotImplemented a
    PUT with ``If-None-Match``, and with 411 MissingContentLength a CreateMultipartUpload
    without ``Content-Length``. ``"gcs"`` also makes ``x-goog-if-generation-match: 0`` create-
    only, enforced atomically by the upstream's ``If-None-Match: *``."""
    if store not in STORES:
        raise ValueError(f"unknown store {store!r}; expected one of {STORES}")
    rules = [
        Rule("error", header=_CHECKSUM_HEADERS, status=400, code="InvalidArgument"),
        Rule("error", method="PUT", header=r"^if-none-match:", status=501, code="NotImplemented"),
        Rule("error", method="POST", query_has="uploads", without_header=r"^content-length:", status=411,
             code="MissingContentLength"),
    ]
    if store == "gcs":
        rules.append(Rule("add_headers", method="PUT", header=r"^x-goog-if-generation-match: 0$",
                          headers=(("If-None-Match", "*"),)))
    return rules
