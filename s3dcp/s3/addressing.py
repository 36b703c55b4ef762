"""Where a request goes and what every request of a kind carries, from an S3Config.

    Addressing(config): host and path of a bucket or key (path-style or virtual-hosted), the
    headers of server-side encryption and of the expected bucket owner, the wire checksum

Owns how a configuration becomes request lines and headers; :mod:`s3dcp.s3.client` and the
socket transfers build their requests from it. It must not send anything.
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit

from ..config import S3Config
from . import compat

__all__ = ["Addressing"]


class Addressing:
    """The request lines and common headers of ``config`` (a resolved S3Config)."""

    def __init__(self, config: S3Config) -> None:
        self.config = config
        parts = urlsplit(config.endpoint_url)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
        if ":" in (parts.hostname or "") and parts.port is not None:  # IPv6 literal
            self.host = f"[{parts.hostname}]:{parts.port}"

    def path(self, bucket: str, key: str) -> str:
        quoted = quote(key, safe="/-_.~")
        return f"/{bucket}/{quoted}" if self.config.use_path_style else f"/{quoted}"

    def bucket_path(self, bucket: str) -> str:
        return f"/{bucket}" if self.config.use_path_style else "/"

    def host_for(self, bucket: str) -> str:
        return self.host if self.config.use_path_style else f"{bucket}.{self.host}"

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

    def owner_headers(self) -> list[tuple[str, str]]:
        owner = self.config.expected_bucket_owner
        return [("x-amz-expected-bucket-owner", owner)] if owner else []
