"""What every ``s3dcp`` command shares: :class:`UsageError` (exit 2), the S3 client that
``--endpoint-url`` and ``--region`` describe, and a checkpoint's metadata read without torch."""

from __future__ import annotations

from ..config import S3Config

__all__ = ["UsageError", "s3_client", "plain_metadata"]


class UsageError(Exception):
    """A request the command refuses as asked (exit 2)."""


def s3_client(args):
    """An S3Client for the command's ``--endpoint-url`` and ``--region`` (the rest from the environment)."""
    from ..s3.client import S3Client

    return S3Client(S3Config(endpoint_url=args.endpoint_url, region=args.region))


def plain_metadata(client, uri):
    """The checkpoint's metadata as plain values (one GET of ``.metadata``, decoded without torch):
    a :class:`~s3dcp.format.metadata.PlainMetadata`, or the typed error a load would give
    (incomplete, not found, S3 errors, MetadataFormatError)."""
    from ..format.layout import METADATA_NAME
    from ..format.metadata import decode_plain
    from ..loading.fetch import fetch_metadata_bytes

    return decode_plain(fetch_metadata_bytes(client, uri), source=str(uri.child(METADATA_NAME)))
