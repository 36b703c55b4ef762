from __future__ import annotations

from ..config import S3Config


class UsageError(Exception):
    """A request the command refuses as asked (exit 2)."""


def _client(args):
    from ..s3.client import S3Client

    return S3Client(S3Config(endpoint_url=args.endpoint_url, region=args.region))
