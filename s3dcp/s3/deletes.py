"""Deleting many keys: DeleteObjects requests of at most 1,000 keys each.

    S3Client.delete ──► DeleteObjects × ceil(keys / 1,000) (Quiet, Content-MD5) ──► every batch's errors checked

Owns the request bodies and the check of each answer (a 200 may list keys that failed). It must
not send a request itself: it is handed ``send`` (:meth:`S3Client._default
<s3dcp.s3.client.S3Client._default>`), and never imports :mod:`s3dcp.s3.client`.
"""

from __future__ import annotations

import base64
import hashlib
import xml.etree.ElementTree as ET
from concurrent.futures import Future
from typing import Callable, Iterable, Sequence

from ..errors import S3Error
from .responses import children, text, xml_result
from .streams import chain, gather

__all__ = ["delete_objects"]

_BATCH = 1000  # S3's DeleteObjects limit


def delete_objects(send: Callable[..., Future], bucket: str, keys: Iterable[str],
                   bucket_headers: Sequence[tuple[str, str]]) -> "Future[None]":
    """Delete ``keys`` (see :meth:`s3dcp.s3.client.S3Client.delete`); missing keys are not errors."""
    keys = list(keys)
    batches = [_delete_batch(send, bucket, keys[i:i + _BATCH], bucket_headers) for i in range(0, len(keys), _BATCH)]
    return gather(batches, lambda results: None)


def _delete_batch(send: Callable[..., Future], bucket: str, keys: list[str],
                  bucket_headers: Sequence[tuple[str, str]]) -> Future:
    root = ET.Element("Delete")
    ET.SubElement(root, "Quiet").text = "true"
    for k in keys:
        ET.SubElement(ET.SubElement(root, "Object"), "Key").text = k
    body = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    md5 = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()
    outer: Future = Future()
    f = send("DeleteObjects", "POST", bucket, "", query={"delete": ""}, body=body, result=xml_result,
             extra_headers=[("Content-MD5", md5), ("Content-Type", "application/xml"), *bucket_headers])

    def handle(resp) -> None:
        errors = [(text(e, "Key"), text(e, "Code"), text(e, "Message")) for e in children(resp, "Error")]
        if errors:
            key, code, message = errors[0]
            raise S3Error(f"DeleteObjects failed for {len(errors)} key(s), first: {message}",
                          operation="DeleteObjects", bucket=bucket, key=key, code=code)
        outer.set_result(None)

    f.add_done_callback(lambda f: chain(f, outer, handle))
    return outer
