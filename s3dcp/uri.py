"""``s3://bucket/prefix`` parsing and key building. Pure: no I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["S3Uri", "parse_s3_uri", "checkpoint_uri", "is_s3_uri", "natural_order", "object_key", "parent_prefix",
           "directory_bucket_zone"]

# S3's bucket naming rules (general purpose buckets): 3-63 chars, lowercase letters, digits,
# dots and hyphens, starting and ending with a letter or digit. Underscores are tolerated
# because some S3-compatible stores (and legacy us-east-1 buckets) allow them.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
# S3 Express One Zone directory buckets: ``<base name>--<zone id>--x-s3`` (``ckpt--usw2-az1--x-s3``)
_DIRECTORY_BUCKET_RE = re.compile(r"^[a-z0-9].*--([a-z0-9][a-z0-9-]*)--x-s3$")


@dataclass(frozen=True)
class S3Uri:
    """A bucket and a key prefix (no leading or trailing '/'; may be empty)."""

    bucket: str
    prefix: str

    def key(self, name: str) -> str:
        """The full key of object ``name`` under this prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def child(self, name: str) -> "S3Uri":
        return S3Uri(self.bucket, self.key(name.strip("/")))

    @property
    def dir_prefix(self) -> str:
        """The listing prefix of everything under this URI (ends with '/' unless empty)."""
        return f"{self.prefix}/" if self.prefix else ""

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def directory_bucket_zone(bucket: str) -> str | None:
    """The zone id of an S3 Express One Zone directory bucket (``usw2-az1`` of
    ``ckpt--usw2-az1--x-s3``), or None for any other bucket; by its name, as boto3 tells them."""
    match = _DIRECTORY_BUCKET_RE.match(bucket)
    return match[1] if match else None


def is_s3_uri(value: object) -> bool:
    return isinstance(value, str) and value.startswith("s3://")


def parse_s3_uri(uri: object) -> S3Uri:
    """Parse ``s3://bucket[/prefix]``; raise :class:`ConfigError` saying what is wrong."""
    if not isinstance(uri, str):
        raise ConfigError(f"checkpoint path must be an 's3://bucket/prefix' string, got {type(uri).__name__}: {uri!r}")
    if not uri.startswith("s3://"):
        raise ConfigError(f"checkpoint path {uri!r} is not an S3 URI: expected 's3://bucket/prefix'")
    rest = uri[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ConfigError(f"checkpoint path {uri!r} has no bucket: expected 's3://bucket/prefix'")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise ConfigError(
            f"checkpoint path {uri!r}: {bucket!r} is not a valid bucket name "
            "(3-63 characters: lowercase letters, digits, '.', '-')"
        )
    prefix = prefix.strip("/")
    if "//" in prefix:
        raise ConfigError(f"checkpoint path {uri!r} has an empty path segment ('//')")
    if any(seg in (".", "..") for seg in prefix.split("/")):
        raise ConfigError(f"checkpoint path {uri!r} has a '.' or '..' segment")
    if len(prefix.encode()) > 900:
        raise ConfigError(f"checkpoint path {uri!r} is too long for S3 keys (prefix over 900 bytes)")
    return S3Uri(bucket, prefix)


def checkpoint_uri(uri: object, *, what: str = "a checkpoint") -> S3Uri:
    """:func:`parse_s3_uri` for where something is saved, refusing a bucket's root by name: a
    checkpoint there lists as ``.``, sits among every other object of the bucket, and is most
    often an empty run-name variable (``f"s3://bucket/{run}"``)."""
    parsed = parse_s3_uri(uri)
    if not parsed.prefix:
        raise ConfigError(
            f"{uri!r} is the root of bucket {parsed.bucket!r}: {what} needs a folder of its own, as in "
            f"s3://{parsed.bucket}/<run>/step-1000 (is a run-name variable empty?)")
    return parsed


def parent_prefix(uri: S3Uri) -> str:
    """The listing prefix of the directory holding the checkpoint ``uri`` (``"run/"`` for
    ``run/step-1000``; ``""`` at the bucket's root)."""
    parent = uri.prefix.rpartition("/")[0]
    return f"{parent}/" if parent else ""


def object_key(uri: S3Uri, object_name: str) -> str:
    """The S3 key of an item's object, named in the metadata of the checkpoint at ``uri``.

    A plain name (``"__0_0.tok.distcp"``) is an object of the checkpoint itself; a reference
    of an incremental checkpoint names an object of a sibling checkpoint as
    ``"../<sibling>/<name>"`` (see :mod:`s3dcp.format.references`). Anything else (deeper paths,
    ``.`` or empty segments, a way out of the parent prefix) is refused, so metadata can never
    point a load at an arbitrary key of the bucket.
    """
    from .errors import MetadataFormatError

    parts = object_name.split("/")
    if len(parts) == 1 and parts[0] not in ("", ".", ".."):
        return uri.key(object_name)
    if len(parts) == 3 and parts[0] == ".." and all(p not in ("", ".", "..") for p in parts[1:]) and uri.prefix:
        return f"{parent_prefix(uri)}{parts[1]}/{parts[2]}"
    raise MetadataFormatError(
        f"{uri}: object name {object_name!r} in the metadata is neither an object of the checkpoint nor "
        "'../<sibling checkpoint>/<object>'; refusing to read or delete outside the run's prefix")


def natural_order(name: str) -> list:
    """Sort key for the names under a prefix that puts ``step-9`` before ``step-10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
