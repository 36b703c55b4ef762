"""Garbage collection of what failed saves leave behind.

A save that dies (an exception on any rank, a killed process, a lost node) never writes its
metadata object, so its data objects are not a checkpoint: loading refuses them. They still
cost storage, and an interrupted multipart upload keeps its parts until it is aborted.
:func:`gc` removes both, and nothing else:

- the data objects of one save (one token, see :func:`s3dcp.layout.object_name`) go only
  when no committed metadata references them and the newest of them is older than
  ``older_than_s``, so a save still being written (which keeps adding objects) is left alone;
- a committed checkpoint's referenced objects and its metadata are never touched;
- multipart uploads under the prefix started more than ``older_than_s`` ago are aborted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .client import ObjectInfo, S3Client
from .config import S3Config
from .errors import MetadataFormatError
from .layout import parse_object_name
from .metadata import decode_metadata
from .uri import parse_s3_uri

__all__ = ["gc", "GcReport"]

log = logging.getLogger("s3dcp")

_METADATA = ".metadata"


@dataclass
class GcReport:
    """What :func:`gc` removed (or, with ``dry_run``, would remove)."""

    deleted: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    aborted_uploads: list[tuple[str, str]] = field(default_factory=list)  # (key, upload id)
    kept_recent: list[str] = field(default_factory=list)  # unreferenced but too young to judge
    unreadable_metadata: list[str] = field(default_factory=list)  # left alone, to be looked at


def gc(
    uri: str,
    *,
    older_than_s: float = 3600.0,
    config: S3Config | None = None,
    client: S3Client | None = None,
    dry_run: bool = False,
    now: float | None = None,
) -> GcReport:
    """Remove leftovers of failed saves anywhere under ``uri`` (a run or a checkpoint).

    Args:
        uri: ``s3://bucket/prefix``; every checkpoint below it is examined.
        older_than_s: only leftovers whose newest object (or upload start) is older than this.
        dry_run: report, delete nothing.
        now: the current time in seconds since the epoch (tests pass one).
    """
    target = parse_s3_uri(uri)
    client = client or S3Client(config)
    now = time.time() if now is None else now
    cutoff = now - older_than_s
    report = GcReport()

    objects, _ = client.list(target.bucket, target.dir_prefix).result()
    by_dir: dict[str, list[ObjectInfo]] = {}
    for obj in objects:
        directory, _, _name = obj.key.rpartition("/")
        by_dir.setdefault(directory, []).append(obj)

    doomed: list[ObjectInfo] = []
    for directory, entries in by_dir.items():
        names = {o.key.rpartition("/")[2]: o for o in entries}
        referenced: set[str] = set()
        if _METADATA in names:
            try:
                referenced = _referenced(client, target.bucket, names[_METADATA].key)
            except MetadataFormatError:
                report.unreadable_metadata.append(names[_METADATA].key)
                continue  # never delete next to metadata we cannot read
        by_token: dict[str, list[ObjectInfo]] = {}
        for name, obj in names.items():
            parsed = parse_object_name(name)
            if parsed and name not in referenced:
                by_token.setdefault(parsed.token, []).append(obj)
        for group in by_token.values():
            newest = max((o.last_modified or now) for o in group)
            if newest < cutoff:
                doomed.extend(group)
            else:
                report.kept_recent.extend(o.key for o in group)

    report.deleted = sorted(o.key for o in doomed)
    report.deleted_bytes = sum(o.size for o in doomed)
    for upload in client.list_uploads(target.bucket, target.dir_prefix).result():
        if upload.initiated is not None and upload.initiated < cutoff:
            report.aborted_uploads.append((upload.key, upload.upload_id))

    if not dry_run:
        client.delete(target.bucket, report.deleted).result()
        for key, upload_id in report.aborted_uploads:
            client.abort_upload(target.bucket, key, upload_id).result()
    log.info("gc %s: %s %d object(s) (%d bytes) and %d multipart upload(s)", target,
             "would delete" if dry_run else "deleted", len(report.deleted), report.deleted_bytes,
             len(report.aborted_uploads))
    return report


def _referenced(client: S3Client, bucket: str, metadata_key: str) -> set[str]:
    raw = client.get(bucket, metadata_key).result()
    metadata = decode_metadata(raw, source=f"s3://{bucket}/{metadata_key}")
    return {loc.object_name for loc in (metadata.storage_data or {}).values()}
