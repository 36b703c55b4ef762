"""Ranged reads from s3dcp's own sockets straight into the caller's buffers.

    S3Client.get_scatter ──► SocketRead.start ──► ranged GET × N (parts of download_part_size_bytes,
        a sender thread each) ──recv_into──► every sink covering each byte (holes read, dropped)
        every part answered for the same object (ETag) ──► on_done(); the first failure cancels the rest

Why not the CRT's GET: it receives each part into a buffer of its own (faulted in again after
the CRT trims its pool) and hands it over in chunks that are then copied into the tensors. A
512 MiB read into one tensor on the 2-core machine (``benchmarks/transport_cpu.py``): the CRT
0.96 s and 0.77 CPU s (131k page faults), these sockets 0.46 s and 0.22 CPU s: the kernel's copy
is the only one (``docs/architecture.md``, "Reads").

Owns :class:`SocketRead`: the parts of one read, what a part's answer must say (206 with the
``Content-Range`` asked for; 200 only for a whole object that fits the range; 416 past the
end) and the bytes a short object leaves unread, counted so the caller's check fails. Requests,
retries and cancellation are :class:`~s3dcp.s3.sender.SocketSender`'s. It must not decide what
a short read means (:meth:`s3dcp.s3.client.S3Client.get_scatter`) nor queue requests.
"""

from __future__ import annotations

import bisect
import http.client
import itertools
import re
from typing import Sequence

from ..errors import IntegrityError, S3Error
from .responses import size_mismatch
from .sender import Cancelled, Flow
from .streams import copy_into

__all__ = ["SocketRead"]

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)$")
_SCRATCH = 1 << 20  # bytes no sink covers are read through a buffer this large at most


class SocketRead(Flow):
    """Bytes ``[start, end)`` of one object into ``sinks`` (``(object offset, writable byte
    view)``, sorted by offset): each byte into every sink that covers it. :attr:`received` is
    how many bytes of the range the object held once done."""

    operation = "GetObject"

    def __init__(self, bucket: str, key: str, host: str, path: str, start: int, end: int,
                 sinks: Sequence[tuple[int, memoryview]], *, part_size: int, headers: Sequence[tuple[str, str]],
                 object_size: int | None = None):
        super().__init__(bucket, key)
        self._host, self._path, self._headers = host, path, list(headers)
        self._sinks = list(sinks)
        self._reach = list(itertools.accumulate((off + v.nbytes for off, v in self._sinks), max))
        self._parts = [(offset, min(part_size, end - offset)) for offset in range(start, end, part_size)]
        self._pending = len(self._parts)
        self._etag: str | None = None
        self._object_size = object_size  # what every answer must say the whole object holds, when given
        self.received = 0

    def _begin(self) -> None:
        if not self._parts:
            self._finish(None)
        for offset, length in self._parts:
            self._run(lambda offset=offset, length=length: self._part(offset, length), self._part_over)

    def _release(self) -> None:
        self._sinks, self._reach = [], []

    def _part(self, offset: int, length: int) -> None:
        if self._live.cancelled:
            raise Cancelled()
        got = [0]

        def into(response: http.client.HTTPResponse) -> None:
            got[0] = self._receive(response, offset, length)

        answer = self._sender.request(
            "GetObject", "GET", self._host, self._path, [("Range", f"bytes={offset}-{offset + length - 1}"),
                                                         *self._headers],
            live=self._live, bucket=self.bucket, key=self.key, into=into, final=(416,))
        if answer.status != 416:  # 416: the range starts past the object's end, nothing to read
            etag = answer.header("ETag")
            with self._lock:
                first, self._etag = self._etag, self._etag or etag
            if first is not None and etag != first:
                raise IntegrityError(f"s3://{self.bucket}/{self.key} was replaced while it was read "
                                     f"(ETag {first} for one range, {etag} for another)")
            with self._lock:
                self.received += got[0]
        self._part_over(None)

    def _receive(self, response: http.client.HTTPResponse, offset: int, length: int) -> int:
        """Check the answer is the range asked for and read its body into the sinks; returns
        how many bytes it held (fewer than ``length`` where the object ends inside the range)."""
        size = response.length
        if size is None:
            raise S3Error(f"GetObject s3://{self.bucket}/{self.key}: the answer has no Content-Length")
        if response.status == 206:
            match = _CONTENT_RANGE.match(response.getheader("Content-Range") or "")
            if (match is None or int(match[1]) != offset or int(match[2]) >= offset + length
                    or int(match[2]) - int(match[1]) + 1 != size):
                raise S3Error(f"GetObject s3://{self.bucket}/{self.key}: asked for bytes {offset}-"
                              f"{offset + length - 1}, the answer holds {response.getheader('Content-Range')!r} "
                              f"({size} bytes)")
        elif offset != 0 or size > length:  # a 200 is the whole object: only right if that is the range
            raise S3Error(f"GetObject s3://{self.bucket}/{self.key}: asked for bytes {offset}-{offset + length - 1}, "
                          f"the server answered with the whole object ({size} bytes)")
        if response.status == 206:
            total = int(match[3]) if match[3].isdigit() else None
        else:
            total = size
        if self._object_size is not None and total != self._object_size:  # checked before a byte is copied
            raise size_mismatch(self.bucket, self.key, total, self._object_size)
        self._fill(response, offset, offset + size)
        return size

    def _fill(self, response: http.client.HTTPResponse, lo: int, hi: int) -> None:
        """Read object bytes ``[lo, hi)`` from ``response``: into the first sink covering each
        stretch, copied from there into the others covering it; stretches none covers dropped."""
        scratch = None
        position = lo
        while position < hi:
            first = bisect.bisect_right(self._reach, position)
            covering, stop = [], hi
            for sink_offset, view in self._sinks[first:]:
                if sink_offset >= stop:
                    break
                if sink_offset > position:
                    stop = sink_offset
                elif sink_offset + view.nbytes > position:
                    covering.append((sink_offset, view))
                    stop = min(stop, sink_offset + view.nbytes)
            if covering:
                (home_offset, home), *others = covering
                target = home[position - home_offset:stop - home_offset]
                _read_exactly(response, target)
                for sink_offset, view in others:
                    copy_into(view, position - sink_offset, target, 0, stop - position)
            else:
                stop = min(stop, position + _SCRATCH)
                if scratch is None:
                    scratch = memoryview(bytearray(min(_SCRATCH, hi - lo)))
                _read_exactly(response, scratch[:stop - position])
            position = stop

    def _part_over(self, error: BaseException | None) -> None:
        last, failure = self._part_ended(error)
        if last:
            self._finish(failure)


def _read_exactly(response: http.client.HTTPResponse, target: memoryview) -> None:
    """Fill ``target`` from the body; the connection ending first is an IncompleteRead (retried)."""
    done = 0
    while done < target.nbytes:
        n = response.readinto(target[done:])
        if not n:
            raise http.client.IncompleteRead(bytes(0), target.nbytes - done)
        done += n
