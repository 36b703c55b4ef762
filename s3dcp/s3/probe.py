"""Is an endpoint's scheme wrong? One probe tells a TLS/plain-HTTP mismatch apart.

An ``https://`` endpoint at a plain-HTTP server fails in the CRT with only
``AWS_IO_SOCKET_CLOSED`` ("socket is closed"), and an ``http://`` one at a TLS server gets no
HTTP answer either; neither error says why. After such a failure, :func:`scheme_mismatch`
connects once more and checks whether the server speaks the other protocol. It runs only on
an error path (it costs a connection and up to 2 s), never on a request's way.
"""

from __future__ import annotations

import socket
import ssl
from urllib.parse import urlsplit

__all__ = ["scheme_mismatch"]

_PROBE_TIMEOUT_S = 2.0


def scheme_mismatch(endpoint: str) -> str | None:
    """A sentence saying that ``endpoint`` speaks the other protocol and what to use, else None."""
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    other = f"{'http' if parts.scheme == 'https' else 'https'}://{parts.netloc}"
    try:
        if parts.scheme == "https" and _answers_plain_http(host, port):
            return f"{endpoint} answers plain HTTP, not TLS (a TLS/plain-HTTP mismatch): use {other}"
        if parts.scheme == "http" and _answers_tls(host, port):
            return f"{endpoint} speaks TLS, not plain HTTP (a TLS/plain-HTTP mismatch): use {other}"
    except OSError:
        pass  # unreachable either way: the original error says so already
    return None


def _answers_plain_http(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S) as s:
        s.sendall(f"HEAD / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        return s.recv(5) == b"HTTP/"


def _answers_tls(host: str, port: int) -> bool:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only asking whether it speaks TLS at all; nothing is sent
    with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S) as raw:
        try:
            with context.wrap_socket(raw, server_hostname=host or None):
                return True
        except ssl.SSLError:
            return False
