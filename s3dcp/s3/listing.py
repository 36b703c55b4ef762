"""Listings that take more than one request: every page of ListObjectsV2, ListMultipartUploads
and ListParts, and the values they describe (:class:`ObjectInfo`, :class:`UploadInfo`).

    S3Client.list / list_uploads / upload_activity ──► page ──send──► XML ──► values ──► next page or result

Owns walking the pages (markers, continuation tokens) and turning each page's XML into values.
A page that names a marker or token the walk has already followed is refused (a broken or
hostile server would otherwise be listed forever).
It must not send a request itself: it is handed ``send``, :meth:`S3Client._default
<s3dcp.s3.client.S3Client._default>` (one small request, a future of ``result(status, headers,
body)``), and never imports :mod:`s3dcp.s3.client`. No call blocks: the next page is asked for
from the callback of the last.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import S3Error
from .responses import children, parse_iso, text, xml_result
from .streams import chain

__all__ = ["ObjectInfo", "UploadInfo", "UploadParts", "list_objects", "list_uploads", "upload_activity"]


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str | None = None
    last_modified: float | None = None  # seconds since the epoch


@dataclass(frozen=True)
class UploadInfo:
    """An unfinished multipart upload."""

    key: str
    upload_id: str
    initiated: float | None = None  # seconds since the epoch


def list_objects(send: Callable[..., Future], bucket: str, prefix: str, delimiter: str | None, page_size: int,
                 headers: Sequence[tuple[str, str]], *,
                 first_page_only: bool = False) -> "Future[tuple[list[ObjectInfo], list[str]]]":
    """All objects under ``prefix`` and the common prefixes (with a ``delimiter``), every page
    (or only the first: ``first_page_only``)."""
    objects: list[ObjectInfo] = []
    prefixes: list[str] = []
    outer: Future = Future()
    seen: set = set()

    def page(token: str | None) -> None:
        query = {"list-type": "2", "prefix": prefix, "max-keys": str(page_size)}
        if delimiter:
            query["delimiter"] = delimiter
        if token:
            query["continuation-token"] = token
        f = send("ListObjectsV2", "GET", bucket, "", query=query, result=xml_result, extra_headers=headers)
        f.add_done_callback(lambda f: chain(f, outer, handle))

    def handle(root) -> None:
        for c in children(root, "Contents"):
            objects.append(ObjectInfo(key=text(c, "Key"), size=int(text(c, "Size") or 0),
                                      etag=text(c, "ETag"), last_modified=parse_iso(text(c, "LastModified"))))
        for p in children(root, "CommonPrefixes"):
            prefixes.append(text(p, "Prefix"))
        token = text(root, "NextContinuationToken")
        if text(root, "IsTruncated") == "true" and token and not first_page_only:
            _once(seen, token, "ListObjectsV2", bucket, prefix, "continuation token")
            page(token)
        else:
            outer.set_result((objects, prefixes))

    page(None)
    return outer


def list_uploads(send: Callable[..., Future], bucket: str, prefix: str,
                 headers: Sequence[tuple[str, str]]) -> "Future[list[UploadInfo]]":
    """Unfinished multipart uploads under ``prefix``, every page."""
    uploads: list[UploadInfo] = []
    outer: Future = Future()
    seen: set = {("", "")}

    def page(key_marker: str, upload_marker: str) -> None:
        query = {"uploads": "", "prefix": prefix}
        if key_marker:
            query["key-marker"] = key_marker
        if upload_marker:
            query["upload-id-marker"] = upload_marker
        f = send("ListMultipartUploads", "GET", bucket, "", query=query, result=xml_result, extra_headers=headers)
        f.add_done_callback(lambda f: chain(f, outer, handle))

    def handle(root) -> None:
        for u in children(root, "Upload"):
            uploads.append(UploadInfo(key=text(u, "Key"), upload_id=text(u, "UploadId"),
                                      initiated=parse_iso(text(u, "Initiated"))))
        if text(root, "IsTruncated") == "true":
            markers = (text(root, "NextKeyMarker"), text(root, "NextUploadIdMarker"))
            _once(seen, markers, "ListMultipartUploads", bucket, prefix, "key and upload id markers")
            page(*markers)
        else:
            outer.set_result(uploads)

    page("", "")
    return outer


@dataclass(frozen=True)
class UploadParts:
    """What an unfinished multipart upload holds so far (ListParts, every page)."""

    parts: int = 0
    bytes: int = 0  # stored, and billed, until the upload is completed or aborted
    newest: float | None = None  # when its last part arrived (seconds since the epoch)


def upload_activity(send: Callable[..., Future], bucket: str, key: str, upload_id: str,
                    headers: Sequence[tuple[str, str]]) -> "Future[UploadParts]":
    """The parts an unfinished multipart upload has received (count, bytes, the newest one's
    time), from ListParts, every page."""
    found = {"parts": 0, "bytes": 0, "newest": None}
    outer: Future = Future()
    seen: set = set()

    def page(marker: str) -> None:
        query = {"uploadId": upload_id}
        if marker:
            query["part-number-marker"] = marker
        f = send("ListParts", "GET", bucket, key, query=query, result=xml_result, extra_headers=headers)
        f.add_done_callback(lambda f: chain(f, outer, handle))

    def handle(root) -> None:
        for part in children(root, "Part"):
            found["parts"] += 1
            found["bytes"] += int(text(part, "Size") or 0)
            stamp = parse_iso(text(part, "LastModified"))
            if stamp is not None and (found["newest"] is None or stamp > found["newest"]):
                found["newest"] = stamp
        marker = text(root, "NextPartNumberMarker")
        if text(root, "IsTruncated") == "true" and marker:
            _once(seen, marker, "ListParts", bucket, key, "part number marker")
            page(marker)
        else:
            outer.set_result(UploadParts(**found))

    page("")
    return outer


def _once(seen: set, marker, operation: str, bucket: str, key: str, what: str) -> None:
    """Note ``marker`` as followed; refuse one followed before (the walk would never end)."""
    if marker in seen:
        raise S3Error(f"a {operation} page names {what} {marker!r}, which this listing has already followed: "
                      f"it would never end; the server (or a proxy before it) is broken", operation=operation,
                      bucket=bucket, key=key or None)
    seen.add(marker)
