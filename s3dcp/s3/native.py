"""The native CRT clients of this process, shared by every S3Client of one configuration.

    S3Client ──_acquire_native──► registry (process, config, credentials) ──► _NativeClient (CRT client + queue)
    S3Client.close / finalizer ──_release_native──► idle linger (at most _MAX_IDLE kept) ──► retired

Owns the registry (``_NATIVE``), each native client (a CRT client and, with
``transport="sockets"``, the :class:`~s3dcp.s3.sender.SocketSender` of its multipart
uploads and ranged reads), its admission queue (at most
``max_concurrency`` requests in flight, the rest wait in order), the idle linger, and
:func:`close_native_clients` / :func:`native_clients`. It must not build or translate requests
(:mod:`s3dcp.s3.client`, :mod:`s3dcp.s3.request`) nor resolve credentials or configure the CRT
(:mod:`s3dcp.s3.crt`); it never imports :mod:`s3dcp.s3.client`.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
import time
from typing import TYPE_CHECKING

from ..config import S3Config
from ..uri import directory_bucket_zone
from .crt import _credential_source, _make_crt_client, express_signing
from .proxy import proxy_for
from .sender import SocketSender
from .streams import deadlines

if TYPE_CHECKING:
    from .request import _Call

__all__ = ["close_native_clients", "native_clients"]


class _NativeClient:
    """One awscrt S3Client shared by every S3Client of one configuration, credentials and
    process, with its admission queue: at most ``limit`` requests in flight, the rest wait
    their turn in order. Nothing here blocks, so it may be entered from CRT callbacks."""

    def __init__(self, key, crt, limit: int, sender=None, signing=None) -> None:
        self.key = key
        self.crt = crt
        self._express = None if signing is None else express_signing(signing)
        self.sender = sender  # the socket transfers' threads and connections (s3dcp.s3.sender)
        self.limit = limit
        self.users = 0  # S3Clients holding it
        self.in_flight = 0
        self.closed = False  # dropped from the registry; the CRT client goes with its last request
        self.idle_since = 0.0  # when its last S3Client let go (orders idle clients, oldest first)
        self._queue: collections.deque[_Call] = collections.deque()
        self._lock = threading.Lock()

    def submit(self, call: _Call) -> None:
        with self._lock:
            if self.in_flight >= self.limit:
                call._waits_in = self
                self._queue.append(call)
                return
            self.in_flight += 1
        self._launch(call)

    def signing_for(self, bucket: str):
        """The signing config of a request to ``bucket``: S3 Express session auth for a directory
        bucket, else None (the client's own)."""
        return self._express if directory_bucket_zone(bucket) is not None else None

    def unqueue(self, call: _Call) -> bool:
        """Take ``call`` out of the queue; False if it is not there (started, or about to)."""
        with self._lock:
            try:
                self._queue.remove(call)
            except ValueError:
                return False
            return True

    def finished(self) -> None:
        """A request ended: its slot goes to the next queued request, if any."""
        self._launch(self._next())

    def _next(self) -> _Call | None:
        with self._lock:
            if self._queue:
                return self._queue.popleft()
            self.in_flight -= 1
            if self.closed and self.in_flight == 0:
                self._drop()
            return None

    def _drop(self) -> None:
        """Let go of the CRT client and the socket sender (under the lock, nothing in flight)."""
        self.crt = None
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()

    def _launch(self, call: _Call | None) -> None:
        while call is not None and not call.start(self):
            call = self._next()  # it failed to start: the slot is still ours

    @property
    def idle(self) -> bool:
        with self._lock:
            return self.users == 0 and self.in_flight == 0 and not self._queue


_NATIVE: dict = {}  # key -> _NativeClient
_NATIVE_LOCK = threading.Lock()
_IDLE_LINGER_S = 10.0  # an unused native client waits this long for the next checkpoint's writer
_MAX_IDLE = 2  # idle native clients kept at most (each holds CRT threads and sockets)


class _NativeUse:
    """An S3Client's hold on a native client (separate from the S3Client so that a finalizer
    can release it without keeping the S3Client alive)."""

    __slots__ = ("native", "__weakref__")

    def __init__(self) -> None:
        self.native: _NativeClient | None = None

    def release(self) -> None:
        native, self.native = self.native, None
        if native is not None and native.key[0] == os.getpid():  # a forked child leaves the parent's alone
            _release_native(native)


def _acquire_native(config: S3Config, tls: bool, profile_given: bool) -> _NativeClient:
    """The shared native client for ``config`` and the credentials and proxy in force now, made on
    first use. Keyed by process (a forked child builds its own), by a digest of static credentials,
    so a secret changed in the environment is used by the next S3Client, as with boto3, and by the
    proxy the environment names for the endpoint (the CRT reads it when it connects)."""

    source = _credential_source(config, profile_given, os.environ)
    key = (os.getpid(), config, source[0], hashlib.sha256(repr(source).encode()).hexdigest(),
           proxy_for(config.endpoint_url))
    with _NATIVE_LOCK:
        native = _NATIVE.get(key)
        if native is None:
            crt, signing = _make_crt_client(config, tls, source)
            sender = SocketSender(config, signing, tls) if config.transport == "sockets" else None
            native = _NATIVE[key] = _NativeClient(key, crt, config.max_concurrency, sender, signing)
        native.users += 1
        return native


def _release_native(native: _NativeClient) -> None:
    """An S3Client let go of ``native``. Unused, it lingers for the next checkpoint's client of the
    same configuration, but at most ``_MAX_IDLE`` idle ones are kept: a job that makes a config
    per load (rotating credentials) holds a bounded number of CRT threads and sockets at any
    pace, not as many as it made in the last ``_IDLE_LINGER_S``."""
    with _NATIVE_LOCK:
        native.users -= 1
        if native.users or _NATIVE.get(native.key) is not native:
            return
        native.idle_since = time.monotonic()
        unused = sorted((n for n in _NATIVE.values() if n.users == 0), key=lambda n: n.idle_since)
        surplus = unused[:-_MAX_IDLE]
        for n in surplus:
            del _NATIVE[n.key]
    for n in surplus:
        _retire(n)
    if native not in surplus:
        deadlines().add(_IDLE_LINGER_S, lambda: _drop_if_idle(native))


def _drop_if_idle(native: _NativeClient) -> None:
    with _NATIVE_LOCK:
        if not (native.idle and _NATIVE.get(native.key) is native):
            return
        del _NATIVE[native.key]
    _retire(native)


def _retire(native: _NativeClient):
    """Close ``native``, already out of the registry: its CRT client goes now if nothing is in
    flight, else with its last request. Returns the CRT client's shutdown event (None if gone)."""
    with native._lock:
        native.closed = True
        crt = native.crt
        if native.in_flight == 0:
            native._drop()
    return None if crt is None else crt.shutdown_event


def close_native_clients(*, idle_only: bool = False, wait_s: float = 0.0) -> int:
    """Release native clients of this process (``s3dcp.close()``): every one, or with
    ``idle_only`` those no S3Client holds. Idle ones go now, busy ones when their last request
    ends; S3Clients still in use take a fresh one on their next request. With ``wait_s``, wait up
    to that long for their CRT threads and sockets to be gone. Returns how many were released."""
    with _NATIVE_LOCK:
        natives = [n for n in _NATIVE.values() if not idle_only or n.users == 0]
        for native in natives:
            del _NATIVE[native.key]
    events = [e for e in map(_retire, natives) if e is not None]
    deadline = time.monotonic() + wait_s
    for event in events:
        if wait_s > 0:
            event.wait(max(0.0, deadline - time.monotonic()))
    return len(natives)


def native_clients() -> int:
    """How many native CRT clients this process holds (for tests and the soak benchmark)."""
    with _NATIVE_LOCK:
        return len(_NATIVE)
