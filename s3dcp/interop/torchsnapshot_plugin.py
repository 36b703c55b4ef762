"""A TorchSnapshot storage plugin on s3dcp's CRT client: ``Snapshot.take("s3dcp://bucket/prefix", …)``.

    Snapshot.take / async_take ── WriteIO(path, buf) ──► S3Client.put: multipart from ``buf`` itself
                                                         (no copy), checksummed parts, retries
    Snapshot.restore / read_object ── ReadIO(path, byte_range) ──► S3Client.get_range_into: parallel
                                                         ranged GETs into one bytearray, handed over
                                                         as it is (getvalue() makes no copy)

TorchSnapshot's own ``s3://`` plugin (aiobotocore, one PUT per object) is built in and cannot be
replaced, so this plugin registers under its own protocol, ``s3dcp``, through TorchSnapshot's
``storage_plugins`` entry point (see pyproject.toml). ``storage_options`` may hold
``{"config": S3Config(...)}``, S3Config field names (``{"endpoint_url": ..., "region": ...}``) or
``{"client": S3Client(...)}``; by default the configuration comes from the environment, as for
:class:`s3dcp.S3StorageWriter`.

Re-taking onto a path that holds a snapshot: TorchSnapshot names its objects by their place in
the state (``0/app/w``), so a second take overwrites the first one's objects and, when it fails
midway, the old ``.snapshot_metadata`` (its commit marker, written last by rank 0) would point at
a mix of old and new objects. So the first write of each take checks for ``.snapshot_metadata``
under the root (one HEAD, before any object is written): it is refused with
:class:`CheckpointExistsError` unless ``storage_options`` holds ``"overwrite": True``, in which case
the old ``.snapshot_metadata`` is deleted first and a failed re-take leaves no snapshot at all.

Every coroutine awaits a future of :class:`s3dcp.s3.client.S3Client`; at most ``max_concurrency``
requests are started at once (an ``asyncio.Semaphore``, so the event loop never blocks on the
client's own limit). Errors are s3dcp's (:class:`NoSuchBucketError`, :class:`AccessDeniedError`,
…) and reach the caller of ``take``/``restore``/``wait``.

Integrity: every uploaded part carries the configured checksum (CRC32C by default), verified
by the server. TorchSnapshot's format has no place for per-object checksums, so reads are
checked for length only (a short object fails with :class:`IntegrityError`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
from concurrent.futures import Future
from typing import Any, Awaitable, Callable, Optional

from torchsnapshot.io_types import ReadIO, StoragePlugin, WriteIO

from ..config import S3Config
from ..errors import CheckpointExistsError, ConfigError, NoSuchKeyError
from ..s3.client import S3Client
from ..uri import parse_s3_uri

__all__ = ["S3CRTStoragePlugin", "PROTOCOL", "SNAPSHOT_METADATA_NAME", "create_plugin"]

PROTOCOL = "s3dcp"
SNAPSHOT_METADATA_NAME = ".snapshot_metadata"  # TorchSnapshot's commit marker, written last by rank 0


class S3CRTStoragePlugin(StoragePlugin):
    """TorchSnapshot ``StoragePlugin`` for ``s3dcp://bucket/prefix``.

    TorchSnapshot makes one per ``take``/``restore`` inside its event loop, calls ``write``,
    ``read`` and ``delete`` as coroutines (many at once), then ``close``. The first ``write``
    checks for an earlier snapshot under the root before any write goes out (see the module
    docstring); the others wait for that check.

    Args:
        root: ``bucket/prefix`` (the URL without ``s3dcp://``).
        storage_options: see the module docstring; ``"overwrite": True`` lets a take replace a
            snapshot already at the root.
    """

    def __init__(self, root: str, storage_options: Optional[dict[str, Any]] = None) -> None:
        options = dict(storage_options or {})
        self.overwrite = options.pop("overwrite", False)
        if not isinstance(self.overwrite, bool):
            raise ConfigError(f"storage_options: overwrite={self.overwrite!r} must be True or False")
        client = options.pop("client", None)
        config = options.pop("config", None)
        if client is not None and (config is not None or options):
            raise ConfigError("storage_options: pass either 'client' or a config, not both")
        if options:
            known = {f.name for f in dataclasses.fields(S3Config)}
            unknown = sorted(set(options) - known)
            if unknown:
                raise ConfigError(f"storage_options: unknown option(s) {unknown}; expected 'config', 'client', "
                                  f"'overwrite' or S3Config fields")
            config = dataclasses.replace(config, **options) if config is not None else S3Config(**options)
        self.uri = parse_s3_uri(f"s3://{root}")
        self._own_client = client is None
        self.client: S3Client = client if client is not None else S3Client(config)
        self._slots: asyncio.Semaphore | None = None
        self._previous_checked: Future | None = None  # made by the first write

    def __repr__(self) -> str:
        return f"S3CRTStoragePlugin({PROTOCOL}://{self.uri.bucket}/{self.uri.prefix})"

    async def write(self, write_io: WriteIO) -> None:
        if self._previous_checked is None:  # no await between test and set: one check per plugin
            self._previous_checked = self._check_previous()
        await asyncio.wrap_future(self._previous_checked)
        key = self.uri.key(write_io.path)
        await self._request(lambda: self.client.put(self.uri.bucket, key, write_io.buf))

    def _check_previous(self) -> Future:
        """HEAD ``.snapshot_metadata`` under the root: absent, go ahead; present, refuse with
        :class:`CheckpointExistsError`, or with ``overwrite`` delete it (the old snapshot stops
        being one before any of its objects is replaced). Every error lands in the future."""
        bucket, key = self.uri.bucket, self.uri.key(SNAPSHOT_METADATA_NAME)
        root = f"{PROTOCOL}://{bucket}/{self.uri.prefix}".rstrip("/")
        out: Future = Future()

        def deleted(f: Future) -> None:
            err = f.exception()
            out.set_exception(err) if err is not None else out.set_result(None)

        def headed(f: Future) -> None:
            err = f.exception()
            try:
                if isinstance(err, NoSuchKeyError):
                    out.set_result(None)
                elif err is not None:
                    out.set_exception(err)
                elif not self.overwrite:
                    out.set_exception(CheckpointExistsError(
                        f"{root}/{SNAPSHOT_METADATA_NAME} exists: a snapshot was already taken at {root}. Take "
                        "this one to a new path, or pass storage_options={'overwrite': True} to replace it (the "
                        f"old {SNAPSHOT_METADATA_NAME} is deleted first, so a re-take that fails leaves no "
                        "snapshot rather than a mix of old and new objects)"))
                else:
                    self.client.delete(bucket, [key]).add_done_callback(deleted)
            except BaseException as e:  # noqa: BLE001 - the caller awaits this future
                if not out.done():
                    out.set_exception(e)

        self.client.head(bucket, key).add_done_callback(headed)
        return out

    async def read(self, read_io: ReadIO) -> None:
        key = self.uri.key(read_io.path)
        if read_io.byte_range is None:
            info = await self._request(lambda: self.client.head(self.uri.bucket, key))
            start, end = 0, info.size
        else:
            start, end = read_io.byte_range
        buf = bytearray(end - start)
        if buf:
            await self._request(lambda: self.client.get_range_into(self.uri.bucket, key, start, buf))
        read_io.buf = _Downloaded(buf)

    async def delete(self, path: str) -> None:
        key = self.uri.key(path)
        await self._request(lambda: self.client.delete(self.uri.bucket, [key]))

    async def close(self) -> None:
        if self._own_client:
            self.client.close()

    async def _request(self, start: Callable[[], Any]) -> Any:
        """Start one client call once a slot is free; await its future without blocking the loop."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.client.config.max_concurrency)
        async with self._slots:
            future: Awaitable = asyncio.wrap_future(start())
            return await future


class _Downloaded(io.BytesIO):
    """What ``read`` hands TorchSnapshot: its scheduler calls ``getvalue()`` and its consumers
    use the value as a bytes-like object (``memoryview``, ``torch.frombuffer``, ``BytesIO``,
    ``.decode``). ``getvalue()`` returns the downloaded bytearray itself instead of a copy;
    reading it as a stream works too (from a copy made on first use)."""

    def __init__(self, data: bytearray) -> None:
        super().__init__()
        self._data: bytearray | None = data
        self._streamed = False

    def getvalue(self) -> bytearray:  # type: ignore[override]
        return self._data if not self._streamed else super().getvalue()

    def _stream(self) -> None:
        if not self._streamed:
            super().write(self._data)
            super().seek(0)
            self._streamed, self._data = True, None

    def read(self, size: int | None = -1) -> bytes:
        self._stream()
        return super().read(size)

    def readinto(self, buffer) -> int:
        self._stream()
        return super().readinto(buffer)

    def seek(self, pos: int, whence: int = 0) -> int:
        self._stream()
        return super().seek(pos, whence)

    def tell(self) -> int:
        self._stream()
        return super().tell()


def create_plugin(root: str, storage_options: Optional[dict[str, Any]] = None) -> S3CRTStoragePlugin:
    """The ``storage_plugins`` entry point: TorchSnapshot calls ``factory(path, storage_options)``."""
    return S3CRTStoragePlugin(root, storage_options)
