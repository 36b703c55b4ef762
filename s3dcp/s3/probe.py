"""Is an endpoint's scheme wrong? One probe tells a TLS/plain-HTTP mismatch apart.

An ``https://`` endpoint at a plain-HTTP server fails in the CRT with only
``AWS_IO_SOCKET_CLOSED`` ("socket is closed"), and an ``http://`` one at a TLS server gets no
HTTP answer either; neither error says why. After such a failure, :func:`scheme_mismatch`
connects once more and checks whether the server speaks the other protocol. It runs only on
an error path (it costs a connection and up to 2 s), never on a request's way: after the CLI's
commands fail, and in :func:`diagnose` for the Python API (``s3dcp.save``/``load``/``async_save``,
:class:`~s3dcp.CheckpointManager`), which adds the same sentence to the error they raise.
"""

from __future__ import annotations

import socket
import ssl
from urllib.parse import urlsplit

from ..errors import S3ConnectionError

__all__ = ["scheme_mismatch", "diagnose"]

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


def diagnose(error: BaseException, endpoint: str | None) -> BaseException:
    """``error`` with the TLS/plain-HTTP diagnosis of ``endpoint`` added to its message, when it
    is an :class:`S3ConnectionError` (no HTTP answer) and the endpoint speaks the other
    protocol; any other error as it is. The error keeps its type, fields and traceback (its
    text changes in place, so the one the caller catches is the one that was raised)."""
    if not isinstance(error, S3ConnectionError) or not endpoint or getattr(error, "diagnosis", None):
        return error
    hint = scheme_mismatch(endpoint)
    if hint is None:
        return error
    error.diagnosis = hint
    error.args = (f"{error.args[0] if error.args else ''}. {hint} (S3Config(endpoint_url=...) or "
                  "AWS_ENDPOINT_URL_S3)",) + tuple(error.args[1:])
    return error


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
