"""The file objects torch-checkpointing reads and writes through: ranged GETs into the caller's
buffer, and uploads from the caller's buffers.

    stream_read ──► ReadStream.readinto(buf) ──► one ranged GET of len(buf) bytes, split by the CRT
                    into download_part_size_bytes parts in parallel, each landing in buf itself
                    (small reads: one read_block_bytes block ahead, served from it)
    get_write_stream(path, data) ──► WriteStream.write(view) ── view inside a tensor of ``data``:
                    kept (a view of that tensor's storage, no copy) ── else copied (headers, pickle),
                    spooled to a file past write_memory_bytes ──► close(): one PUT of the pieces
                    (multipart above the threshold, every part checksummed) or, all spooled, put_file

Owns the two stream classes and :func:`tensor_owners` (the buffers of ``data`` a write may
keep). Every read is checked against the object's size before a byte is copied
(``object_size_bytes``), so a replaced or truncated object fails instead of filling the
buffer with the wrong bytes. A stream left by an exception (``with`` block) or by
:meth:`WriteStream.abort` uploads nothing. Requests and their errors are the client's; the
errors reach the caller in the contract's form (:func:`~s3dcp.interop.torch_checkpointing_dirs.wait`).
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import io
import mmap
import tempfile
from typing import Any, Callable

import numpy as np
import torch

from ..s3.client import S3Client
from ..s3.request import abort_and_wait
from ..s3.streams import SizedReader
from .torch_checkpointing_dirs import wait

__all__ = ["ReadStream", "MemoryStream", "WriteStream", "tensor_owners"]

_KEEP_FROM_BYTES = 64 << 10  # writes smaller than this are copied: finding their owner costs more


class _Reader(SizedReader):
    """A read-only stream of ``size`` bytes at position ``_pos``, seekable anywhere from 0 on
    (what the two streams below share; ``_name`` goes into its errors)."""

    _name = "the stream"

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        target = self._target(offset, whence)
        if target < 0:
            raise OSError(errno.EINVAL, f"negative seek position {target} in {self._name}")
        self._pos = target
        return target


class ReadStream(_Reader):
    """Bytes of one object of ``size_bytes``, read on demand (see the module docstring).
    ``timeout_s`` bounds each read: past it, the read's requests are aborted (and waited for:
    nothing writes into the buffer after the call) and ``TimeoutError`` is raised. ``check``
    (the storage's marker check, where nothing was asked before the stream) runs once a GET has
    been answered, until it passes: a read it refuses raises and counts no bytes as read."""

    def __init__(self, client: S3Client, bucket: str, key: str, size_bytes: int, *, timeout_s: float | None,
                 block_bytes: int, check: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._client, self._bucket, self._key = client, bucket, key
        self.size = size_bytes
        self._name = f"s3://{bucket}/{key}"
        self._timeout_s = timeout_s
        self._block_bytes = block_bytes
        self._block = bytearray()
        self._block_at = 0
        self._check = check  # run once a GET has been answered, until it passes (raises: no bytes given)

    def readinto(self, buffer: Any) -> int:
        self._checkClosed()
        out = memoryview(buffer).cast("B")
        n = max(0, min(out.nbytes, self.size - self._pos))
        if n == 0:
            return 0
        if n >= self._block_bytes:
            self._get(self._pos, out[:n])
        else:
            block_end = self._block_at + len(self._block)
            if not (self._block_at <= self._pos and self._pos + n <= block_end):
                block = bytearray(min(self._block_bytes, self.size - self._pos))
                self._get(self._pos, block)
                self._block_at, self._block = self._pos, block
            start = self._pos - self._block_at
            out[:n] = memoryview(self._block)[start:start + n]
        self._pos += n
        return n

    def readall(self) -> bytes:
        out = bytearray(max(0, self.size - self._pos))
        view = memoryview(out)
        got = 0
        while got < len(out):  # one read for all of it, unless it is smaller than a block
            step = self.readinto(view[got:])
            if not step:
                break
            got += step
        with view[:got] as whole:
            return bytes(whole)

    def close(self) -> None:
        self._block = bytearray()
        super().close()

    def _get(self, offset: int, into: Any) -> None:
        future = self._client.get_range_into(self._bucket, self._key, offset, into, object_size_bytes=self.size)
        try:
            wait(future, self._timeout_s)
        except TimeoutError as e:
            if future.done():
                raise
            abort_and_wait([future])  # the buffer is the caller's again only once the CRT let go of it
            raise TimeoutError(errno.ETIMEDOUT, f"reading {len(memoryview(into))} bytes at offset {offset} of "
                               f"s3://{self._bucket}/{self._key} took longer than ReadArgs.timeout_us "
                               f"({self._timeout_s} s); the read was stopped") from e
        if self._check is not None:
            self._check()
            self._check = None


class MemoryStream(_Reader):
    """A whole object already read into ``data`` (``ReadArgs.pre_read_full_file``), as a
    stream; reads copy out of it, it is never copied whole."""

    def __init__(self, data: bytearray) -> None:
        super().__init__()
        self._data = data
        self.size = len(data)

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(out.nbytes, self.size - self._pos))
        out[:n] = memoryview(self._data)[self._pos:self._pos + n]
        self._pos += n
        return n

    def readall(self) -> bytes:
        start, self._pos = self._pos, max(self._pos, self.size)
        return bytes(memoryview(self._data)[start:])

    def close(self) -> None:
        self._data = bytearray()
        self.size = 0
        super().close()


def tensor_owners(data: Any, *, limit: int = 1_000_000) -> list[tuple[int, int, Any]]:
    """``(address, nbytes, storage)`` of every CPU tensor storage in ``data`` (dicts, lists,
    tuples, DTensors' local shards), sorted by address: the memory a write may keep."""
    from torch.distributed.tensor import DTensor

    found: dict[int, tuple[int, int, Any]] = {}
    todo, seen = [data], 0
    while todo and seen < limit:
        item = todo.pop()
        seen += 1
        if isinstance(item, DTensor):
            item = item.to_local()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if item.device.type == "cpu" and storage.nbytes() and storage.data_ptr():
                found[storage.data_ptr()] = (storage.data_ptr(), storage.nbytes(), storage)
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
    return sorted(found.values(), key=lambda o: o[0])


class WriteStream(io.RawIOBase):
    """What ``torch.save`` (or any writer) writes, uploaded as one object on :meth:`close`
    (see the module docstring). ``owners`` (:func:`tensor_owners`) is the memory the caller
    keeps unchanged until the stream is closed or aborted; ``finish(pieces)`` uploads byte
    views, ``finish_file(path, nbytes, keep)`` a spool file; both wait for the upload."""

    def __init__(self, owners: list[tuple[int, int, Any]], *, memory_bytes: int, spool_dir: str | None,
                 finish: Callable[[list], None], finish_file: Callable[[str, int, Any], None]) -> None:
        super().__init__()
        self._owners = owners
        self._starts = [o[0] for o in owners]
        self._memory_bytes = memory_bytes
        self._spool_dir = spool_dir
        self._finish, self._finish_file = finish, finish_file
        self._pieces: list = []  # memoryviews, and (offset, length) ranges of the spool file
        self._tail = bytearray()  # copied bytes not yet sealed into a piece
        self._copied = 0
        self._spool = None
        self._pos = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        self._checkClosed()
        view = memoryview(data).cast("B")
        n = view.nbytes
        kept = self._keep(view) if n >= _KEEP_FROM_BYTES else None
        if kept is not None:
            self._seal()
            self._pieces.append(kept)
        elif self._spool is not None or self._copied + n > self._memory_bytes:
            self._spill(view)
        else:
            self._tail += view
            self._copied += n
        self._pos += n
        return n

    def abort(self) -> None:
        """Upload nothing; let go of the caller's memory and the spool."""
        self._drop()
        super().close()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._seal()
            if self._spool is not None and not any(isinstance(p, memoryview) for p in self._pieces):
                self._spool.flush()
                self._finish_file(f"/proc/self/fd/{self._spool.fileno()}", self._pos, self._spool)
            else:
                self._upload_pieces()
        finally:
            self._drop()
            super().close()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()

    def __del__(self) -> None:  # dropped unclosed (an error on the way): upload nothing
        if not self.closed:
            self.abort()

    # ------------------------------------------------------------------ internals
    def _keep(self, view: memoryview) -> memoryview | None:
        """A view of an owner's storage holding exactly ``view``'s bytes, or None."""
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        start, nbytes, storage = self._owners[i]
        if address + view.nbytes > start + nbytes:
            return None
        raw = (ctypes.c_uint8 * nbytes).from_address(start)
        raw._owner = storage  # the view keeps the storage alive
        return memoryview(raw).cast("B")[address - start:address - start + view.nbytes]

    def _seal(self) -> None:
        if self._tail:
            self._pieces.append(memoryview(self._tail))
            self._tail = bytearray()

    def _spill(self, view: memoryview) -> None:
        if self._spool is None:
            self._spool = tempfile.TemporaryFile(prefix="s3dcp-tc-", dir=self._spool_dir)
            for i, piece in enumerate(self._pieces):  # the copies made so far go first
                if isinstance(piece, memoryview) and isinstance(piece.obj, bytearray):
                    self._pieces[i] = self._append_to_spool(piece)
            self._pieces.append(self._append_to_spool(memoryview(self._tail)))
            self._tail = bytearray()
            self._copied = 0
        self._pieces.append(self._append_to_spool(view))

    def _append_to_spool(self, view: memoryview) -> tuple[int, int]:
        at = self._spool.seek(0, io.SEEK_END)
        self._spool.write(view)
        return at, view.nbytes

    def _upload_pieces(self) -> None:
        mapped = None
        if self._spool is not None:
            self._spool.flush()
            size = self._spool.seek(0, io.SEEK_END)
            mapped = mmap.mmap(self._spool.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        try:
            views = [p if isinstance(p, memoryview) else memoryview(mapped)[p[0]:p[0] + p[1]]
                     for p in self._pieces if isinstance(p, memoryview) or p[1]]
            try:
                self._finish(views)
            finally:
                for v in views:
                    v.release()
        finally:
            if mapped is not None:
                try:
                    mapped.close()
                except BufferError:  # a view still held somewhere: the mapping goes with it
                    pass

    def _drop(self) -> None:
        self._pieces, self._tail, self._owners, self._starts = [], bytearray(), [], []
        if self._spool is not None:
            self._spool.close()
            self._spool = None

