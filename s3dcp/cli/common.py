"""What every ``s3dcp`` command shares: :class:`UsageError` (exit 2) and the S3 client that
``--endpoint-url`` and ``--region`` describe."""

from __future__ import annotations

from ..config import S3Config

__all__ = ["UsageError", "s3_client"]


class UsageError(Exception):
    """A request the command refuses as asked (exit 2)."""


def s3_client(args):
    """An S3Client for the command's ``--endpoint-url`` and ``--region`` (the rest from the environment)."""
    from ..s3.client import S3Client

    return S3Client(S3Config(endpoint_url=args.endpoint_url, region=args.region))
