"""A tiny HTTP proxy on loopback, as ``HTTPS_PROXY`` / ``HTTP_PROXY`` name one: ``CONNECT
host:port`` opens a tunnel (what a client does for an https endpoint), and a request in
absolute form (``GET http://host:port/path``, what a client does for an http endpoint) is
relayed with the rest of its connection to that host. It records the targets it was asked
for and counts the bytes clients sent through it, so a test sees what went through it.

    >>> with HttpProxy() as proxy:
    ...     os.environ["HTTPS_PROXY"] = proxy.url
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit

__all__ = ["HttpProxy"]


class HttpProxy:
    """A thread per connection; ``targets`` lists ``CONNECT host:port`` and the absolute URLs of
    the first request of every forwarded connection, in order; ``sent_bytes`` counts what the
    clients sent through it (request heads and bodies, TLS records in a tunnel)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)  # accept() wakes to see close()
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._targets: list[str] = []
        self._sent = 0
        self._sockets: list[socket.socket] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="HttpProxy", daemon=True)

    @property
    def targets(self) -> list[str]:
        with self._lock:
            return list(self._targets)

    @property
    def sent_bytes(self) -> int:
        with self._lock:
            return self._sent

    def _count(self, n: int) -> None:
        with self._lock:
            self._sent += n

    def __enter__(self) -> "HttpProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed = True
        self._thread.join(timeout=10)
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # a timeout: look at _closed again
                continue
            conn.settimeout(None)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            self._sockets.append(client)
        head = b""
        while b"\r\n\r\n" not in head:
            data = client.recv(65536)
            if not data:
                client.close()
                return
            head += data
        method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        with self._lock:
            self._targets.append(f"CONNECT {target}" if method == "CONNECT" else target)
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            upstream = socket.create_connection((host.strip("[]"), int(port)))
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            rest = head.split(b"\r\n\r\n", 1)[1]
        else:  # absolute form: relayed as it is (servers must accept it, RFC 9112 3.2.2)
            parts = urlsplit(target)
            upstream = socket.create_connection((parts.hostname, parts.port or 80))
            rest = head
        with self._lock:
            self._sockets.append(upstream)
        if rest:
            upstream.sendall(rest)
            self._count(len(rest))
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream, self._count)


def _pipe(src: socket.socket, dst: socket.socket, count=lambda n: None) -> None:
    try:
        while data := src.recv(1 << 20):
            dst.sendall(data)
            count(len(data))
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
