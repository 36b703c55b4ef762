"""S3's times, and by how much this machine's clock is off when S3 refuses a request's time.

    an answer RequestTimeTooSkewed ──clock_skew_error──► ClockSkewError: "ahead by N s" (its
        RequestTime less its ServerTime, else now less its Date)
    a 403 without a body (a HEAD's) whose Date is more than 15 minutes off ──► the same
    the CRT's AWS_ERROR_S3_REQUEST_TIME_TOO_SKEWED (retried, then reported without the answer)
        ──with_measured_skew──► one HeadBucket ──its answer's Date──► ClockSkewError: "ahead by N s"

S3 refuses a request signed more than 15 minutes from its own clock; every request fails alike
until the clock is set right, and the one thing to say is by how much it is off. Owns the
parsing of S3's times (:func:`parse_iso`, :func:`parse_http_date`), :func:`clock_skew_error`
and :func:`with_measured_skew`; the error is classified by
:func:`s3dcp.s3.responses.translate_error` and the HeadBucket sent by
:class:`s3dcp.s3.client.S3Client`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from datetime import datetime, timezone
from typing import Callable

from ..errors import ClockSkewError

__all__ = ["clock_skew_error", "skew_from_answer", "with_measured_skew", "parse_iso", "parse_http_date"]

_CRT_SKEW = "AWS_ERROR_S3_REQUEST_TIME_TOO_SKEWED"  # the CRT's error, which carries no answer
ALLOWED_SKEW_S = 15 * 60  # how far S3 lets a request's time be from its own


def skew_from_answer(fields: dict, headers: dict) -> float | None:
    """Seconds this machine's clock is ahead of S3's (negative: behind), from an answer: the time
    the request was signed with (``RequestTime``) less ``ServerTime``, else now less the
    answer's ``Date`` (``headers`` by lower-case name); None if it says neither."""
    signed, server = _amz_time(fields.get("RequestTime")), parse_iso(fields.get("ServerTime") or "")
    if signed is not None and server is not None:
        return signed - server
    date = parse_http_date(headers.get("date"))
    return None if date is None else time.time() - date


def _amz_time(value: str | None) -> float | None:
    """A request time as S3 echoes it: ``20250101T000000Z`` (x-amz-date), ISO 8601 or an HTTP date."""
    if not value:
        return None
    try:
        return datetime.strptime(value, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return parse_iso(value) or parse_http_date(value)


def parse_iso(value: str) -> float | None:
    """Seconds since the epoch of an ISO 8601 time (``2025-01-01T00:00:00.000Z``), or None."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def parse_http_date(value: str | None) -> float | None:
    """Seconds since the epoch of an HTTP date (``Wed, 01 Jan 2025 00:00:00 GMT``), or None."""
    if not value:
        return None
    from email.utils import parsedate_to_datetime

    try:
        return parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


def clock_skew_error(skew_s: float | None, *, operation: str, bucket: str | None, key: str | None,
                     status: int | None = None, request_id: str | None = None) -> ClockSkewError:
    """The error of a request whose time S3 refused, saying by how much the clock is off."""
    if skew_s is None:
        off = "is off from S3's by more than the 15 minutes S3 allows (no answer said the server's time)"
    else:
        off = f"is {'ahead of' if skew_s > 0 else 'behind'} S3's by {abs(skew_s):.0f} s (S3 allows 15 minutes)"
    return ClockSkewError(
        f"{operation} failed: S3 refused the request's time (RequestTimeTooSkewed): this machine's clock {off}; "
        "set the clock right (NTP: chronyd, systemd-timesyncd) — the credentials are not the problem",
        skew_s=skew_s, operation=operation, bucket=bucket, key=key, status=status, code="RequestTimeTooSkewed",
        request_id=request_id)


def with_measured_skew(refine: Callable | None, probe: Callable[[], Future]) -> Callable:
    """``refine`` (a request's own, or None), then, where the CRT reported a refused request
    time without its answer, a future of that error with the skew that ``probe()`` (a future
    of the headers of one more answer, or of its failure) shows by its ``Date``."""

    def refined(failure: BaseException):
        if refine is not None:
            failure = refine(failure)
        cause = failure.__cause__
        if not (isinstance(failure, ClockSkewError) and getattr(cause, "name", None) == _CRT_SKEW):
            return failure
        out: Future = Future()

        def measured(f: Future) -> None:
            better = failure  # whatever goes wrong here, the call's future gets its error
            try:
                error = f.exception()
                headers = f.result() if error is None else getattr(error.__cause__, "headers", None)
                skew = skew_from_answer({}, {name.lower(): value for name, value in headers or ()})
                if skew is not None:
                    better = clock_skew_error(skew, operation=failure.operation, bucket=failure.bucket,
                                              key=failure.key)
                    better.__cause__ = cause
            finally:
                out.set_result(better)

        try:
            probe().add_done_callback(measured)
        except Exception:  # noqa: BLE001 - no probe, no measure: the error as it is
            return failure
        return out

    return refined
