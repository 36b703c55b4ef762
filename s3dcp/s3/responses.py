"""Reading S3's answers: errors translated into the s3dcp hierarchy, XML bodies, and what the
CRT's ``on_headers`` takes from an answer (its ETag; the object size a ranged read must find).

Errors are classified here, once, by HTTP status and S3 error code — never by message text —
and keep the CRT's exception as ``__cause__``. Those a setting causes say which to change: a
bucket in another region names its region (``x-amz-bucket-region``, or the body's ``Region``),
a refused request time says by how much the clock is off (:mod:`s3dcp.s3.clock`).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Callable

from ..errors import (
    AccessDeniedError,
    WrongRegionError,
    IntegrityError,
    NoSuchBucketError,
    NoSuchKeyError,
    PreconditionFailedError,
    S3ConnectionError,
    S3Error,
    S3ServerError,
    ThrottlingError,
)

from .clock import ALLOWED_SKEW_S, clock_skew_error, parse_http_date, parse_iso, skew_from_answer

__all__ = ["translate_error", "xml_result", "children", "text", "parse_iso", "parse_http_date", "etag_of_answer",
           "object_size_check", "size_mismatch"]

_THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
     "RequestThrottled", "503 SlowDown"}
)
_STATUS_TEXT = {403: "access denied (HTTP 403)", 404: "not found (HTTP 404)", 412: "precondition failed (HTTP 412)"}
# Answers the CRT classifies itself and then reports without their status, headers or body
# (observed with awscrt 0.38: 503 and 429 SlowDown -> SLOW_DOWN; 500, 502, 504 -> INTERNAL_ERROR;
# 400 RequestTimeout -> REQUEST_TIMEOUT).
_CRT_STATUS_ERRORS = {
    "AWS_ERROR_S3_SLOW_DOWN": (
        ThrottlingError, "the server kept answering SlowDown (HTTP 503/429: throttling); retries were exhausted"),
    "AWS_ERROR_S3_INTERNAL_ERROR": (
        S3ServerError, "the server kept answering with an HTTP 5xx error; retries were exhausted"),
    "AWS_ERROR_S3_REQUEST_TIMEOUT": (
        S3ConnectionError, "the server kept timing out waiting for the request (RequestTimeout); "
        "retries were exhausted"),
}
# Answers of stores that lack flexible checksums or conditional writes (docs/compatibility.md)
_UPLOAD_OPERATIONS = frozenset({"PutObject", "UploadPart", "CreateMultipartUpload", "CompleteMultipartUpload"})
_UNSUPPORTED_STATUSES = frozenset({400, 411, 501})
_UNSUPPORTED_CODES = frozenset({None, "InvalidArgument", "InvalidRequest", "NotImplemented", "MissingContentLength"})
_COMPAT_ADVICE = (" — this store may not accept S3's flexible checksums (aws-chunked trailers), If-None-Match on "
                  "PUT, or multipart requests without Content-Length: set S3Config(compat=\"gcs\") for Google "
                  "Cloud Storage or compat=\"basic\" for other stores (see docs/compatibility.md)")
# S3's answers to a request sent to another region than the bucket's: a redirect (301, or 307 while
# a new bucket's name propagates), or a 400 that names the bucket's region (body or header)
_REDIRECT_STATUSES = frozenset({301, 307})
_REDIRECT_CODES = frozenset({"PermanentRedirect", "TemporaryRedirect"})
_REGION_CODES = frozenset({"AuthorizationHeaderMalformed", "IllegalLocationConstraintException"})
_AUTH_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
     "TokenRefreshRequired", "AllAccessDisabled"}
)


def translate_error(error: BaseException, *, operation: str, bucket: str | None, key: str | None) -> BaseException:
    """Map a CRT failure to the s3dcp hierarchy by HTTP status and S3 error code.

    Returns the new exception with ``__cause__`` set; anything that is not a CRT error (an
    exception raised by our own callbacks) is returned unchanged.
    """
    from awscrt.exceptions import AwsCrtError
    from awscrt.s3 import S3ResponseError

    if isinstance(error, S3ResponseError):
        status = error.status_code
        headers = {name.lower(): value for name, value in (error.headers or [])}
        fields = _error_fields(error.body)
        code = fields.get("Code")
        request_id = fields.get("RequestId") or headers.get("x-amz-request-id")
        message = fields.get("Message") or _STATUS_TEXT.get(status, f"HTTP {status}")
        op = error.operation_name or operation
        region = headers.get("x-amz-bucket-region") or fields.get("Region") or None
        if status in _REDIRECT_STATUSES or code in _REDIRECT_CODES or (
                region and (code in _REGION_CODES or (status == 400 and code is None))):
            new = _wrong_region(region, status, code, op, bucket, key, request_id)
        elif code == "RequestTimeTooSkewed" or (status == 403 and code is None and _skewed(headers)):
            # a HEAD's 403 has no body to say why: a Date further off than S3 allows says it
            new = clock_skew_error(skew_from_answer(fields, headers), operation=op, bucket=bucket, key=key or None,
                                   status=status, request_id=request_id)
        else:
            cls, advice = _classify(status, code, op, key)
            new = cls(f"{op} failed: {message}{advice}", operation=op, bucket=bucket, key=key or None,
                      status=status, code=code, request_id=request_id)
    elif isinstance(error, AwsCrtError):
        if error.name == "AWS_ERROR_S3_REQUEST_TIME_TOO_SKEWED":  # retried by the CRT, reported without the answer
            new = clock_skew_error(None, operation=operation, bucket=bucket, key=key or None)
        elif error.name == "AWS_ERROR_S3_MISSING_ETAG":
            new = S3Error(
                f"{operation} failed: the server answered without an ETag header ({error.name}), which the CRT "
                "needs (CompleteMultipartUpload names every uploaded part by its ETag; a read in parts asks for the "
                "same object by it); S3 always sends one, so something in between (a proxy, a gateway) may drop "
                "response headers", operation=operation, bucket=bucket, key=key or None)
        elif "CHECKSUM_MISMATCH" in error.name:
            new = IntegrityError(f"{operation} s3://{bucket}/{key}: the data failed its wire checksum "
                                 f"({error.name}); the object or the connection corrupted it")
        elif error.name.startswith("AWS_AUTH_"):
            # Signing failed before anything was sent: the credential chain found nothing usable.
            new = AccessDeniedError(
                f"{operation} could not be signed: {error.name} ({error.message}) — no usable credentials; "
                "pass access_key_id and secret_access_key in S3Config, set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or name a profile that has credentials",
                operation=operation, bucket=bucket, key=key or None)
        elif error.name in _CRT_STATUS_ERRORS:
            cls, text = _CRT_STATUS_ERRORS[error.name]
            new = cls(f"{operation} failed: {text} ({error.name})", operation=operation,
                      bucket=bucket, key=key or None)
        else:
            new = S3ConnectionError(
                f"{operation} failed without an HTTP answer: {error.name} ({error.message}); "
                "check that the endpoint is reachable and the server is running",
                operation=operation, bucket=bucket, key=key or None)
    else:
        return error
    new.__cause__ = error
    return new


def _skewed(headers: dict) -> bool:
    skew = skew_from_answer({}, headers)
    return skew is not None and abs(skew) > ALLOWED_SKEW_S


def _wrong_region(region, status, code, operation, bucket, key, request_id) -> WrongRegionError:
    """The bucket is in another region than the one configured: not followed (docs/aws.md says
    why), named, with the setting to change."""
    if region:
        where = (f"s3://{bucket} is in region {region}: set S3Config(region={region!r}) or AWS_REGION={region} "
                 f"(and, if you set endpoint_url, that region's endpoint, https://s3.{region}.amazonaws.com)")
    else:
        where = (f"s3://{bucket} is in another region than the one configured, and S3 did not say which: set "
                 "S3Config(region=...) or AWS_REGION to the bucket's (`aws s3api head-bucket` shows it)")
    return WrongRegionError(f"{operation} failed: {where}", bucket_region=region, operation=operation,
                            bucket=bucket, key=key or None, status=status, code=code, request_id=request_id)


def _classify(status: int | None, code: str | None, operation: str, key: str | None):
    if status == 403 or code in _AUTH_CODES:
        return AccessDeniedError, " — check the access key, secret and permissions for this bucket"
    if code == "NoSuchBucket":
        return NoSuchBucketError, " — create the bucket or fix the bucket name"
    if code == "NoSuchKey" or (status == 404 and operation in ("HeadObject", "GetObject") and key):
        return NoSuchKeyError, ""
    if status == 404 and operation == "HeadBucket":
        return NoSuchBucketError, " — create the bucket or fix the bucket name"
    if status == 412 or code == "PreconditionFailed":
        return PreconditionFailedError, ""
    if status in (429, 503) or code in _THROTTLE_CODES:
        return ThrottlingError, " — the server is throttling requests; retries were exhausted"
    if status in _UNSUPPORTED_STATUSES and code in _UNSUPPORTED_CODES and operation in _UPLOAD_OPERATIONS:
        return S3Error, _COMPAT_ADVICE
    if status is not None and status >= 500:
        return S3ServerError, " — the server kept failing; retries were exhausted"
    return S3Error, ""


def _error_fields(body: bytes | None) -> dict[str, str]:
    if not body:
        return {}
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return {}
    return {_local(child.tag): (child.text or "") for child in root}


def xml_result(status, headers, body: bytes):
    """A ``_default`` result maker: the response body parsed as XML."""
    try:
        return ET.fromstring(body)
    except ET.ParseError as e:
        raise S3Error(f"the server sent a response that is not XML ({e})") from e


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def children(root, name: str):
    return [c for c in root if _local(c.tag) == name]


def text(node, name: str) -> str:
    for c in node:
        if _local(c.tag) == name:
            return c.text or ""
    return ""


def size_mismatch(bucket: str, key: str, total: int | None, expected: int) -> IntegrityError:
    """A read told the object holds ``expected`` bytes found ``total``."""
    return IntegrityError(f"s3://{bucket}/{key} holds {total} bytes, not the {expected} the reader was told "
                          "(replaced or truncated since its size was taken)")


def object_size_check(bucket: str, key: str, expected: int) -> Callable:
    """An ``on_headers`` callback for a ranged GET of an object believed to hold ``expected``
    bytes. The CRT answers with the first part's headers, whose ``Content-Range`` names the whole
    object's size (``bytes 0-99/1000``); raising here stops the request before any body."""
    def on_headers(status_code, headers, **_):
        total = None
        for name, value in headers:
            if name.lower() == "content-range":
                tail = value.rpartition("/")[2].strip()
                total = int(tail) if tail.isdigit() else None
        if total != expected:
            raise size_mismatch(bucket, key, total, expected)

    return on_headers


def etag_of_answer() -> tuple[list, Callable]:
    """An ``on_headers`` callback for the CRT that keeps the answer's ETag, and the list it
    keeps it in (``[None]`` until an answer names one)."""
    etag: list[str | None] = [None]

    def on_headers(status_code, headers, **_):
        for name, value in headers:
            if name.lower() == "etag":
                etag[0] = value

    return etag, on_headers
