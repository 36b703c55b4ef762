"""Multipart uploads sent from the caller's buffers over blocking sockets.

    S3Client.put (multipart) ──► SocketUpload.start
        CreateMultipartUpload ──► UploadPart × N (a thread each, at most ``connections`` at once;
        the kernel reads the caller's memory) ──► CompleteMultipartUpload ──► on_done()
        any failure, cancel() or the deadline ──► AbortMultipartUpload ──► on_done(error)

Why not the CRT's PUT: it copies every part into a buffer of its own (which the kernel faults
in and zeroes again after the CRT trims its pool, seconds after a save), then writes it out in
16 KiB messages from its event loop. Measured on the 2-core machine against the same server
(``benchmarks/transport_cpu.py``), a 512 MiB upload cost the CRT 0.64 CPU s (131k page faults) and
this path 0.17 CPU s, in less wall time (``docs/architecture.md``, "Uploads"). Downloads and
small requests stay on the CRT.

Owns :class:`SocketUpload` (one multipart upload, behaving as the CRT's meta request does for
:class:`s3dcp.s3.request._Call`: ``cancel()``, and ``on_done(error=...)`` once nothing reads
the caller's buffers any more): its steps, each part's slices of the caller's buffers and their
checksum, and the abort after a failure. Its requests go through the native client's
:class:`~s3dcp.s3.sender.SocketSender` (threads, connections, retries). It must not queue
requests or hold deadlines (:mod:`s3dcp.s3.request`, :mod:`s3dcp.s3.native`).
"""

from __future__ import annotations

import base64
import xml.etree.ElementTree as ET
from typing import Sequence
from urllib.parse import quote, urlencode

from ..errors import S3Error
from .responses import text
from .sender import Answer, Cancelled, Flow, Live

__all__ = ["SocketUpload", "part_layout"]

_XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"
_CHECKSUM_NAMES = {"crc32c": "CRC32C", "crc64nvme": "CRC64NVME"}
_MAX_PARTS = 10_000  # S3's limit


def part_layout(size: int, part_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each part: ``part_size`` long, more when 10,000 would not do."""
    part = max(part_size, -(-size // _MAX_PARTS))
    return [(offset, min(part, size - offset)) for offset in range(0, size, part)]


class SocketUpload(Flow):
    """One multipart upload of ``views`` (sent back to back as one object), driven by callbacks
    on the sender's threads; nothing here blocks the caller. Made before it is queued;
    :meth:`start` runs it on a native client's sender; :attr:`etag` is the object's once done."""

    operation = "upload"

    def __init__(self, bucket: str, key: str, host: str, path: str, views: Sequence[memoryview], *,
                 part_size: int, checksum: str | None, create_headers: Sequence[tuple[str, str]],
                 part_headers: Sequence[tuple[str, str]]) -> None:
        super().__init__(bucket, key)
        self._host, self._path = host, path
        self._views = list(views)
        self._create_headers, self._part_headers = list(create_headers), list(part_headers)
        self._checksum = checksum
        self._parts = part_layout(sum(v.nbytes for v in self._views), part_size)
        self._answers: list[tuple[str, str | None] | None] = [None] * len(self._parts)
        self._pending = len(self._parts)
        self._upload_id: str | None = None
        self.etag: str | None = None

    # ------------------------------------------------------------------ steps
    # create, then every part (each on a thread of its own), then complete: the step that fails
    # first is the upload's failure; once no part runs, the upload is aborted and reported.
    def _begin(self) -> None:
        self._run(self._create, self._created_or_failed)

    def _release(self) -> None:
        self._views = []

    def _send(self, operation: str, method: str, query: dict | str, headers, body=(), live=None) -> Answer:
        if not isinstance(query, str):
            query = urlencode(query, quote_via=quote, safe="-_.~")
        path = self._path + "?" + query
        return self._sender.request(operation, method, self._host, path, headers, body,
                                    live=live or self._live, bucket=self.bucket, key=self.key)

    def _xml(self, operation: str, answer: Answer):
        try:
            return ET.fromstring(answer.body)
        except ET.ParseError as e:
            raise S3Error(f"{operation} s3://{self.bucket}/{self.key}: the answer is not XML ({e})",
                          operation=operation, bucket=self.bucket, key=self.key) from e

    def _create(self) -> None:
        answer = self._send("CreateMultipartUpload", "POST", "uploads", self._create_headers)
        upload_id = text(self._xml("CreateMultipartUpload", answer), "UploadId")
        if not upload_id:
            raise S3Error(f"CreateMultipartUpload s3://{self.bucket}/{self.key}: the answer names no UploadId",
                          operation="CreateMultipartUpload", bucket=self.bucket, key=self.key)
        self._upload_id = upload_id
        for number in range(len(self._parts)):
            self._run(lambda number=number: self._part(number), self._part_over)

    def _part(self, number: int) -> None:
        if self._live.cancelled:
            raise Cancelled()
        offset, length = self._parts[number]
        body = _slices(self._views, offset, length)
        headers = [*self._part_headers]
        value = None
        if self._checksum is not None:
            value = _checksum(self._checksum, body)
            headers.append((f"x-amz-checksum-{self._checksum}", value))
        answer = self._send("UploadPart", "PUT", {"partNumber": str(number + 1), "uploadId": self._upload_id},
                            headers, body)
        etag = answer.header("ETag")
        if not etag:
            raise S3Error(f"UploadPart {number + 1} of s3://{self.bucket}/{self.key}: the answer has no ETag",
                          operation="UploadPart", bucket=self.bucket, key=self.key)
        self._answers[number] = (etag, value)
        self._part_over(None)

    def _part_over(self, error: BaseException | None) -> None:
        last, failure = self._part_ended(error)
        if last and failure is None:
            self._complete_or_abort()
        elif last:
            self._abort_and_finish(failure)

    def _complete_or_abort(self) -> None:
        try:
            self._complete()
        except BaseException as e:  # noqa: BLE001 - reaches the caller's future
            self._abort_and_finish(e)

    def _complete(self) -> None:
        root = ET.Element("CompleteMultipartUpload", xmlns=_XMLNS)
        for number, (etag, value) in enumerate(self._answers, 1):  # type: ignore[misc]
            part = ET.SubElement(root, "Part")
            ET.SubElement(part, "PartNumber").text = str(number)
            ET.SubElement(part, "ETag").text = etag
            if value is not None:
                ET.SubElement(part, "Checksum" + _CHECKSUM_NAMES[self._checksum]).text = value
        body = ET.tostring(root, encoding="utf-8", xml_declaration=True)
        answer = self._send("CompleteMultipartUpload", "POST", {"uploadId": self._upload_id},
                            [("Content-Type", "application/xml"), *self._part_headers], [memoryview(body)])
        self.etag = text(self._xml("CompleteMultipartUpload", answer), "ETag") or answer.header("ETag")
        self._finish(None)

    def _created_or_failed(self, error: BaseException) -> None:
        """Creating the upload failed (a cancel while its answer was on the way leaves an upload
        that ``s3dcp gc`` lists, as with the CRT)."""
        self._finish(error)

    def _abort_and_finish(self, error: BaseException) -> None:
        try:  # a fresh Live: the upload's own is cancelled, and the abort must still go out
            self._send("AbortMultipartUpload", "DELETE", {"uploadId": self._upload_id}, self._part_headers,
                       live=Live())
        except BaseException:  # noqa: BLE001 - the failure that matters is the upload's; gc lists leftovers
            pass
        self._finish(error)

def _slices(views: Sequence[memoryview], offset: int, length: int) -> list[memoryview]:
    """The pieces of ``views`` (back to back) covering ``[offset, offset + length)``."""
    out = []
    for view in views:
        n = view.nbytes
        if offset >= n:
            offset -= n
            continue
        take = min(n - offset, length)
        out.append(view[offset:offset + take])
        length -= take
        offset = 0
        if length == 0:
            break
    return out


def _checksum(algorithm: str, body: Sequence[memoryview]) -> str:
    from awscrt import checksums  # releases the GIL while it runs

    if algorithm == "crc32c":
        crc = 0
        for view in body:
            crc = checksums.crc32c(view, crc)
        return base64.b64encode(crc.to_bytes(4, "big")).decode()
    crc = 0
    for view in body:
        crc = checksums.crc64nvme(view, crc)
    return base64.b64encode(crc.to_bytes(8, "big")).decode()
