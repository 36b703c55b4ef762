"""Garbage collection of what failed saves leave behind.

A save that dies (an exception on any rank, a killed process, a lost node) never writes its
metadata object, so its data objects are not a checkpoint: loading refuses them. They still
cost storage, and an interrupted multipart upload keeps its parts until it is aborted.
:func:`gc` removes both, and nothing else.

Leftovers are judged per *save*: every data object name carries the save's identity, chosen
by the coordinator and the same on every rank (:func:`s3dcp.format.layout.object_name`), and so does
the key of each of its unfinished multipart uploads. In each checkpoint directory:

- a save's unreferenced objects and uploads go together, and only when the newest sign of
  life of that save — an object's modification time, an upload's start or its newest part —
  is older than ``older_than_s``. A slow rank still uploading keeps the objects that faster
  ranks finished long ago, so its commit never points at deleted keys (and the commit checks
  anyway: :meth:`s3dcp.S3StorageWriter.finish`);
- objects that committed metadata references, and the metadata, are never touched — also
  objects of a deleted checkpoint that an incremental sibling still references: references are
  collected from every committed checkpoint under each directory's parent prefix
  (:func:`s3dcp.saving.referenced.references`); nothing is deleted under a parent prefix where some
  metadata cannot be read;
- an unfinished upload whose key is not a data object name is judged alone, by its own age;
- a pending-references marker (:mod:`s3dcp.saving.referenced`) older than ``older_than_s`` belongs to
  an incremental save that died between writing it and committing: gc ignores it when
  collecting references and deletes it. A younger one counts as references.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..config import S3Config
from ..format.layout import PENDING_NAME, parse_object_name
from ..s3.client import S3Client, UploadInfo
from ..saving.referenced import References, references
from ..uri import parse_s3_uri

__all__ = ["gc", "GcReport", "DEFAULT_OLDER_THAN_S"]

DEFAULT_OLDER_THAN_S = 3600.0  # a save showing no sign of life for this long is a failed one

log = logging.getLogger("s3dcp")


@dataclass
class GcReport:
    """What :func:`gc` removed (or, with ``dry_run``, would remove)."""

    deleted: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    aborted_uploads: list[tuple[str, str]] = field(default_factory=list)  # (key, upload id)
    kept_recent: list[str] = field(default_factory=list)  # keys of unreferenced objects too young to judge
    kept_recent_uploads: list[tuple[str, str]] = field(default_factory=list)  # uploads of saves too young
    unreadable_metadata: list[str] = field(default_factory=list)  # left alone, to be looked at
    stale_markers: list[str] = field(default_factory=list)  # pending-references markers of saves that died


@dataclass
class _Save:
    """One save's leftovers in one directory: objects, uploads, and its newest sign of life."""

    objects: list = field(default_factory=list)
    uploads: list[UploadInfo] = field(default_factory=list)
    newest: float = float("-inf")

    def saw(self, stamp: float | None, now: float) -> None:
        self.newest = max(self.newest, now if stamp is None else stamp)


def gc(
    uri: str,
    *,
    older_than_s: float = DEFAULT_OLDER_THAN_S,
    config: S3Config | None = None,
    client: S3Client | None = None,
    dry_run: bool = False,
    now: float | None = None,
) -> GcReport:
    """Remove leftovers of failed saves anywhere under ``uri`` (a run or a checkpoint).

    Args:
        uri: ``s3://bucket/prefix``; every checkpoint below it is examined.
        older_than_s: only saves whose newest object, upload start or uploaded part is older
            than this.
        dry_run: report, delete nothing.
        now: the current time in seconds since the epoch (tests pass one).
    """
    target = parse_s3_uri(uri)
    client = client or S3Client(config)
    now = time.time() if now is None else now
    cutoff = now - older_than_s
    report = GcReport()

    objects, _ = client.list(target.bucket, target.dir_prefix).result()
    uploads = client.list_uploads(target.bucket, target.dir_prefix).result()
    by_dir: dict[str, dict[str, object]] = {}
    for obj in objects:
        directory, _, name = obj.key.rpartition("/")
        by_dir.setdefault(directory, {})[name] = obj
    stale = frozenset(o.key for o in objects if o.key.rpartition("/")[2] == PENDING_NAME
                      and (now if o.last_modified is None else o.last_modified) < cutoff)
    report.stale_markers = sorted(stale)

    saves: dict[tuple[str, str], _Save] = {}  # (directory, save id) -> its leftovers
    unreadable: set[str] = set()
    parents: dict[str, References] = {}  # parent listing prefix -> what its committed checkpoints use

    def refs_of(directory: str) -> References:
        parent = directory.rpartition("/")[0]
        parent = f"{parent}/" if parent else ""
        if parent not in parents:
            parents[parent] = references(client, target.bucket, parent, ignore=stale)
            report.unreadable_metadata.extend(parents[parent].unreadable)
        return parents[parent]

    for directory, names in by_dir.items():
        refs = refs_of(directory)
        if refs.unreadable:
            unreadable.add(directory)
            continue  # never delete where metadata we cannot read may reference it
        for name, obj in names.items():
            parsed = parse_object_name(name)
            if parsed and not refs.users(obj.key):
                save = saves.setdefault((directory, parsed.token), _Save())
                save.objects.append(obj)
                save.saw(obj.last_modified, now)

    for upload in uploads:
        directory, _, name = upload.key.rpartition("/")
        if directory in unreadable or refs_of(directory).unreadable:
            continue
        parsed = parse_object_name(name)
        save = saves.setdefault((directory, parsed.token) if parsed else (directory, f"upload:{upload.upload_id}"),
                                _Save())
        save.uploads.append(upload)
        save.saw(upload.initiated, now)
        if save.newest < cutoff:  # started long ago: has it received a part since?
            save.saw(client.upload_activity(target.bucket, upload.key, upload.upload_id).result() or cutoff - 1,
                     now)

    doomed = []
    for save in saves.values():
        if save.newest < cutoff:
            doomed.extend(save.objects)
            report.aborted_uploads.extend((u.key, u.upload_id) for u in save.uploads)
        else:
            report.kept_recent.extend(o.key for o in save.objects)
            report.kept_recent_uploads.extend((u.key, u.upload_id) for u in save.uploads)

    report.deleted = sorted(o.key for o in doomed)
    report.deleted_bytes = sum(o.size for o in doomed)
    report.kept_recent.sort()
    if not dry_run:
        client.delete(target.bucket, report.deleted).result()
        if report.stale_markers:
            client.delete(target.bucket, report.stale_markers).result()
        for key, upload_id in report.aborted_uploads:
            client.abort_upload(target.bucket, key, upload_id).result()
    log.info("gc %s: %s %d object(s) (%d bytes) and %d multipart upload(s); kept %d object(s) and %d "
             "upload(s) of saves active in the last %.0f s", target,
             "would delete" if dry_run else "deleted", len(report.deleted), report.deleted_bytes,
             len(report.aborted_uploads), len(report.kept_recent), len(report.kept_recent_uploads), older_than_s)
    return report
