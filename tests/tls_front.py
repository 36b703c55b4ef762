"""TLS in front of the plain-HTTP test server, and the certificates it needs.

    >>> cert, key = make_certificate(tmp_path)            # a self-signed one for 127.0.0.1
    >>> front = TlsFront(("127.0.0.1", s3_port), cert, key)  # https://127.0.0.1:<front.port>
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading

import pytest

__all__ = ["TlsFront", "make_certificate"]


def make_certificate(directory, name: str = "cert") -> tuple[str, str]:
    """A self-signed certificate for ``127.0.0.1`` (valid a day): paths of the PEM certificate
    (also the CA bundle that trusts it) and of its key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(cert), str(key)


class TlsFront:
    """TLS in front of the plain-HTTP server: each TLS connection relayed byte for byte to the
    server over a connection of its own (the Host header, and so SigV4, stays the client's)."""

    def __init__(self, upstream: tuple[str, int], cert, key) -> None:
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(cert, key)
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)  # accept() wakes to see close()
        self._closed = False
        self.port = self._listener.getsockname()[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self._sockets: list = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # the timeout that lets close() be seen
                continue
            # each handshake on a thread of its own: a client that opens several connections
            # at once (the CRT does) is not kept waiting behind one handshake, nor behind one
            # that never completes
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        conn.settimeout(30)
        try:
            tls = self._context.wrap_socket(conn, server_side=True)
        except OSError:  # a client that refused the certificate, or went silent
            conn.close()
            return
        tls.settimeout(None)
        plain = socket.create_connection(self._upstream)
        self._sockets += [tls, plain]
        for a, b in ((tls, plain), (plain, tls)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=10)
        self._listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> "TlsFront":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
