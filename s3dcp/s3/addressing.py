"""Where a request goes and what every request of a kind carries, from an S3Config.

    Addressing(config): host and path of a bucket or key (path-style or virtual-hosted, per
    bucket: a dotted name over TLS goes path-style on AWS, a directory bucket to its zonal
    endpoint), the headers of server-side encryption, of the expected bucket owner and of
    requester pays, the wire checksum

Owns how a configuration becomes request lines and headers; :mod:`s3dcp.s3.client` and the
socket transfers build their requests from it. It must not send anything.
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit

from ..config import S3Config
from ..uri import directory_bucket_zone
from . import compat

__all__ = ["Addressing"]


class Addressing:
    """The request lines and common headers of ``config`` (a resolved S3Config)."""

    def __init__(self, config: S3Config) -> None:
        self.config = config
        parts = urlsplit(config.endpoint_url)
        self.tls = parts.scheme == "https"
        hostname = parts.hostname or ""
        host = f"[{hostname}]" if ":" in hostname else hostname  # an IPv6 literal, with or without a port
        self.host = host if parts.port is None else f"{host}:{parts.port}"
        # AWS's own regional endpoint (not one set by hand): where directory buckets have zonal ones
        self._aws_regional = parts.port is None and hostname == f"s3.{config.region}.amazonaws.com"

    def path_style(self, bucket: str) -> bool:
        """Whether requests for ``bucket`` name it in the path (``/bucket/key``), not in the host.
        As configured, except on AWS with ``addressing_style="auto"``: a name with dots over TLS
        goes path-style (``my.bucket.s3.<region>.amazonaws.com`` is not covered by S3's wildcard
        certificate), as boto3 switches; a directory bucket is always virtual-hosted there."""
        if self._zonal_host(bucket) is not None:
            return False
        if self.config.use_path_style:
            return True
        return (self.config.addressing_style or "auto") == "auto" and self.tls and "." in bucket

    def _zonal_host(self, bucket: str) -> str | None:
        """The zonal endpoint of an S3 Express One Zone directory bucket on AWS (None otherwise:
        another bucket, or an endpoint set by hand, which is used as it is)."""
        zone = directory_bucket_zone(bucket)
        if zone is None or not self._aws_regional:
            return None
        return f"{bucket}.s3express-{zone}.{self.config.region}.amazonaws.com"

    def path(self, bucket: str, key: str) -> str:
        quoted = quote(key, safe="/-_.~")
        return f"/{bucket}/{quoted}" if self.path_style(bucket) else f"/{quoted}"

    def bucket_path(self, bucket: str) -> str:
        return f"/{bucket}" if self.path_style(bucket) else "/"

    def host_for(self, bucket: str) -> str:
        zonal = self._zonal_host(bucket)
        if zonal is not None:
            return zonal
        return self.host if self.path_style(bucket) else f"{bucket}.{self.host}"

    def wire_checksum(self) -> str | None:
        """The checksum every uploaded part carries, or None where the store takes none (the item
        checksums in the metadata still verify every load)."""
        return self.config.checksum if compat.wire_checksums(self.config.compat) else None

    def put_checksum(self):
        """The CRT's checksum config for uploads (a trailer of the wire checksum), or None."""
        from awscrt.s3 import S3ChecksumAlgorithm, S3ChecksumConfig, S3ChecksumLocation

        name = self.wire_checksum()
        if name is None:
            return None
        algorithm = S3ChecksumAlgorithm.CRC32C if name == "crc32c" else S3ChecksumAlgorithm.CRC64NVME
        return S3ChecksumConfig(algorithm=algorithm, location=S3ChecksumLocation.TRAILER)

    def sse_headers(self) -> list[tuple[str, str]]:
        c = self.config
        if c.sse is None:
            return []
        headers = [("x-amz-server-side-encryption", c.sse)]
        if c.sse_kms_key_id:
            headers.append(("x-amz-server-side-encryption-aws-kms-key-id", c.sse_kms_key_id))
        return headers

    def bucket_headers(self) -> list[tuple[str, str]]:
        """What every request to a bucket carries: the expected owner's account, and who pays
        (``requester_pays``: the bucket's owner makes requesters pay, and S3 refuses a request
        that does not accept it with 403)."""
        owner = self.config.expected_bucket_owner
        headers = [("x-amz-expected-bucket-owner", owner)] if owner else []
        if self.config.requester_pays:
            headers.append(("x-amz-request-payer", "requester"))
        return headers
