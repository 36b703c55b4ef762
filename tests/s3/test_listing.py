"""Listings that a broken or hostile server answers with a page naming a marker the walk has
already followed: each fails with an S3Error naming it, after a few requests, instead of listing
forever. The pages come from the fault proxy's "answer" rule; each rule answers at most
``_TIMES`` requests and then lets them through to the real server, so a regression ends in a
complete (wrong) listing and a failed assertion, never a hang."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from s3dcp.errors import S3Error
from s3dcp.s3.client import S3Client

from fault_proxy import FaultProxy, Rule

_TIMES = 20
_XML = '<?xml version="1.0" encoding="UTF-8"?>\n'


def _page(tag: str, inner: str) -> bytes:
    return f'{_XML}<{tag} xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{inner}</{tag}>'.encode()


OBJECTS = _page("ListBucketResult", "<IsTruncated>true</IsTruncated><Contents><Key>k</Key><Size>1</Size></Contents>"
                "<NextContinuationToken>again</NextContinuationToken>")
UPLOADS = _page("ListMultipartUploadsResult", "<IsTruncated>true</IsTruncated><NextKeyMarker>k</NextKeyMarker>"
                "<NextUploadIdMarker>u</NextUploadIdMarker><Upload><Key>k</Key><UploadId>u</UploadId></Upload>")
UPLOADS_NO_MARKERS = _page("ListMultipartUploadsResult", "<IsTruncated>true</IsTruncated>")
PARTS = _page("ListPartsResult", "<IsTruncated>true</IsTruncated><NextPartNumberMarker>1</NextPartNumberMarker>"
              "<Part><PartNumber>1</PartNumber><Size>5</Size></Part>")


@pytest.fixture
def proxy(s3_server):
    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port) as p:
        yield p


@pytest.mark.parametrize("name, query, body, call, named", [
    ("objects", "list-type=2", OBJECTS, lambda c, b: c.list(b, "p/"), "continuation token 'again'"),
    ("uploads", "uploads", UPLOADS, lambda c, b: c.list_uploads(b, "p/"), "markers ('k', 'u')"),
    ("uploads from the start", "uploads", UPLOADS_NO_MARKERS, lambda c, b: c.list_uploads(b, "p/"),
     "markers ('', '')"),
    ("parts", "uploadId=", PARTS, lambda c, b: c.upload_activity(b, "p/k", "u1"), "part number marker '1'"),
])
def test_a_page_naming_a_followed_marker_again_ends_the_listing(proxy, bucket, s3_config, name, query, body, call,
                                                                 named):
    rule = proxy.add_rule(Rule("answer", method="GET", query_has=query, status=200, body=body, times=_TIMES))
    client = S3Client(s3_config.replace(endpoint_url=proxy.endpoint_url, max_retries=0))
    try:
        with pytest.raises(S3Error, match="already followed") as got:
            call(client, bucket).result(timeout=60)
    finally:
        client.close()
    assert named in str(got.value) and got.value.bucket == bucket
    assert rule.fired <= 2  # the first page, and the one naming it again
