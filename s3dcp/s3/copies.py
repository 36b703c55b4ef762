"""Server-side copy inside one bucket: one CopyObject, or a multipart upload of UploadPartCopy ranges.

    S3Client.copy ──► ≤ threshold: CopyObject
                  └─► above: CreateMultipartUpload ──► UploadPartCopy × N ──► CompleteMultipartUpload
                                                                └─ any part fails ──► AbortMultipartUpload

Owns the order of those requests, the part ranges and the check that a 200 answer is not an
error. It must not send a request itself: it is handed ``send`` (:meth:`S3Client._default
<s3dcp.s3.client.S3Client._default>`) and ``abort_upload``, and never imports :mod:`s3dcp.s3.client`.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from concurrent.futures import Future
from typing import Callable, Sequence
from urllib.parse import quote

from ..errors import S3Error
from .responses import text, xml_result
from .streams import chain, gather

__all__ = ["copy_object"]


def copy_object(send: Callable[..., Future], abort_upload: Callable[[str, str, str], Future], bucket: str,
                source_key: str, key: str, size: int, *, part_size_bytes: int, multipart_threshold_bytes: int,
                sse_headers: Sequence[tuple[str, str]], bucket_headers: Sequence[tuple[str, str]]) -> "Future[int]":
    """Copy ``source_key`` (``size`` bytes) to ``key`` (see :meth:`s3dcp.s3.client.S3Client.copy`).
    Parts are ``part_size_bytes`` long, more when 10,000 parts would not do. Resolves to ``size``."""
    source = quote(f"{bucket}/{source_key}", safe="/-_.~")
    copy_headers = [("x-amz-copy-source", source), *sse_headers, *bucket_headers]
    outer: Future = Future()

    def check(status, headers, body):  # CopyObject and UploadPartCopy may fail with a 200
        root = xml_result(status, headers, body)
        if root.tag.rsplit("}", 1)[-1] == "Error":
            raise S3Error(f"copy of s3://{bucket}/{source_key} failed: {text(root, 'Message')}",
                          operation="CopyObject", bucket=bucket, key=key, code=text(root, "Code"))
        return root

    if size <= multipart_threshold_bytes:
        f = send("CopyObject", "PUT", bucket, key, result=check, body=b"", extra_headers=copy_headers)
        f.add_done_callback(lambda f: chain(f, outer, lambda _: outer.set_result(size)))
        return outer

    part = max(part_size_bytes, -(-size // 10_000))
    ranges = [(lo, min(size, lo + part)) for lo in range(0, size, part)]

    def created(root) -> None:
        upload_id = text(root, "UploadId")
        parts = [send("UploadPartCopy", "PUT", bucket, key, result=check, body=b"",
                      query={"partNumber": str(n + 1), "uploadId": upload_id},
                      extra_headers=[*copy_headers[:1], ("x-amz-copy-source-range", f"bytes={lo}-{hi - 1}"),
                                     *bucket_headers])
                 for n, (lo, hi) in enumerate(ranges)]
        gather(parts, lambda roots: roots).add_done_callback(lambda g: copied(g, upload_id))

    def copied(g: Future, upload_id: str) -> None:
        if g.exception() is not None:
            abort_upload(bucket, key, upload_id).add_done_callback(lambda _: outer.set_exception(g.exception()))
            return
        root = ET.Element("CompleteMultipartUpload")
        for n, part_root in enumerate(g.result()):
            p = ET.SubElement(root, "Part")
            ET.SubElement(p, "PartNumber").text = str(n + 1)
            ET.SubElement(p, "ETag").text = text(part_root, "ETag")
        body = ET.tostring(root, encoding="utf-8", xml_declaration=True)
        done = send("CompleteMultipartUpload", "POST", bucket, key, query={"uploadId": upload_id}, result=check,
                    body=body, extra_headers=[("Content-Type", "application/xml"), *bucket_headers])
        done.add_done_callback(lambda f: chain(f, outer, lambda _: outer.set_result(size)))

    # body=b"": sends Content-Length: 0, which GCS requires on this POST (HTTP 411 without it)
    start = send("CreateMultipartUpload", "POST", bucket, key, query={"uploads": ""}, result=xml_result,
                 body=b"", extra_headers=[*sse_headers, *bucket_headers])
    start.add_done_callback(lambda f: chain(f, outer, created))
    return outer
