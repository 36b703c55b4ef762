"""Deleting checkpoints by reference: nothing a committed checkpoint (or a save about to commit)
references is deleted.

**Deleting.** Nothing referenced is deleted. :func:`references` reads every committed
``.metadata`` under a parent prefix, and every pending-references marker, and collects the keys
they use; retention (:class:`s3dcp.CheckpointManager`), ``s3dcp rm`` (:func:`delete_checkpoint`)
and ``s3dcp gc`` all go through it. Deleting a checkpoint removes its metadata first (it is no
longer loadable), then only those of its objects nothing references, and frees objects of
earlier-deleted checkpoints that only it still referenced. :func:`materialize` copies the
referenced objects into the checkpoint (server-side) so it stands alone.

The order of reads and deletes that keeps a concurrent incremental save safe is in
:mod:`s3dcp.saving.referenced`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple

from ..errors import MetadataFormatError, NoSuchKeyError
from ..format.layout import METADATA_NAME, PENDING_NAME, is_data_object, parse_object_name
from ..format.references import object_names, pending_names
from ..s3.client import S3Client
from ..saving.referenced import References, references
from ..uri import S3Uri, object_key, parent_prefix
from .gc import DEFAULT_OLDER_THAN_S

__all__ = ["held_for_references", "DeleteResult", "delete_checkpoint", "Released", "release_unreferenced"]

log = logging.getLogger("s3dcp")


def held_for_references(client: S3Client, bucket: str, by_dir: dict) -> dict[str, set[str]]:
    """The directories of ``by_dir`` (listing prefix -> its objects, as
    :func:`s3dcp.lifecycle.directories.scan_directories` gives) that are deleted checkpoints kept only for
    their references — no ``.metadata``, and every data object referenced by a committed
    sibling — each with the sibling directories that reference them. :meth:`CheckpointManager.list`
    does not show them; ``s3dcp ls`` shows them as kept. Reads references only when there is
    such a candidate."""
    candidates = {d: objs for d, objs in by_dir.items()
                  if all(o.key.rpartition("/")[2] != METADATA_NAME for o in objs)
                  and any(is_data_object(o.key.rpartition("/")[2]) for o in objs)}
    held: dict[str, set[str]] = {}
    cache: dict[str, References] = {}
    for directory, objs in candidates.items():
        parent = directory.rstrip("/").rpartition("/")[0]
        parent = f"{parent}/" if parent else ""
        if parent not in cache:
            cache[parent] = references(client, bucket, parent)
        refs = cache[parent]
        data = [o for o in objs if is_data_object(o.key.rpartition("/")[2])]
        if all(refs.users(o.key) for o in data):
            held[directory] = set().union(*(refs.users(o.key) for o in data))
    return held


def _own_references(client: S3Client, uri: S3Uri, names: set[str]) -> set[str]:
    """Keys outside ``uri`` that its metadata and its pending-references marker (those of
    ``names`` present) reference; empty for one that is missing or unreadable."""
    keys: set[str] = set()
    for name in sorted(names & {METADATA_NAME, PENDING_NAME}):
        source = str(uri.child(name))
        try:
            raw = client.get(uri.bucket, uri.key(name)).result()
            used = pending_names(raw, source) if name == PENDING_NAME else object_names(raw, source)
            keys |= {object_key(uri, n) for n in used}
        except (NoSuchKeyError, MetadataFormatError):
            continue
    return {k for k in keys if not k.startswith(uri.dir_prefix)}


@dataclass
class DeleteResult:
    """What :func:`delete_checkpoint` did. Unpacks as ``(deleted objects, deleted bytes)``."""

    deleted_objects: int = 0
    deleted_bytes: int = 0
    kept: list[str] = field(default_factory=list)  # keys of its objects other checkpoints reference
    kept_bytes: int = 0
    # .metadata / marker keys under the parent that could not be read (another writer's, say): what
    # they reference is unknown, so every data object was kept (``kept``), referenced or not
    unreadable: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # objects of deleted checkpoints only it referenced
    # objects of uncommitted siblings only it referenced, kept: their save showed life within gc's
    # age rule (``older_than_s``), so it may still be writing them; ``s3dcp gc`` judges them later
    kept_recent: list[str] = field(default_factory=list)

    def __iter__(self):
        return iter((self.deleted_objects, self.deleted_bytes))


def delete_checkpoint(client: S3Client, uri: S3Uri, *, on_deleted: Callable[[int], None] | None = None,
                      older_than_s: float = DEFAULT_OLDER_THAN_S, now: float | None = None) -> DeleteResult:
    """Delete the checkpoint at ``uri``, keeping what other checkpoints reference.

    Order: read what its metadata (and a pending-references marker) references; delete the
    ``.metadata`` (from then on it is neither committed, loadable, nor a valid base: a save
    on it that has not passed its commit check refuses to commit, and a half-finished deletion
    reads as incomplete, never as a corrupt checkpoint); only then read the references of
    every sibling, committed and pending (the order the protocol in :mod:`s3dcp.saving.referenced`
    needs); delete its data objects that none of them references; delete its own marker, if a
    save here never finished; then delete objects of earlier-deleted siblings that only this
    checkpoint still referenced — but never one of a directory without a commit whose save showed
    life within ``older_than_s`` (gc's age rule, by ``now``): a save in progress there may be
    writing it (``kept_recent``). Objects that s3dcp did not write, and deeper directories, are
    left alone. When a sibling's metadata or marker cannot be read, no data object is deleted
    (``s3dcp gc`` removes them once that is fixed)."""
    objects, _ = client.list(uri.bucket, uri.dir_prefix, delimiter="/").result()
    metadata = [o for o in objects if o.key.rpartition("/")[2] == METADATA_NAME]
    data = [o for o in objects if is_data_object(o.key.rpartition("/")[2])]
    markers = [o for o in objects if o.key.rpartition("/")[2] == PENDING_NAME]
    result = DeleteResult()
    own_refs = _own_references(client, uri, {o.key.rpartition("/")[2] for o in metadata + markers})
    if metadata:
        client.delete(uri.bucket, [o.key for o in metadata]).result()
        result.deleted_objects += len(metadata)
        result.deleted_bytes += sum(o.size for o in metadata)
        if on_deleted:
            on_deleted(len(metadata))
    refs = references(client, uri.bucket, parent_prefix(uri))
    if refs.unreadable:
        result.kept = sorted(o.key for o in data)
        result.kept_bytes = sum(o.size for o in data)
        result.unreadable = list(refs.unreadable)
        log.warning("deleted %s's metadata but kept its %d data object(s): %s cannot be read, so what it "
                    "references is unknown", uri, len(data), ", ".join(refs.unreadable))
        return result
    doomed = [o for o in data if not refs.users(o.key)]
    kept = [o for o in data if refs.users(o.key)]
    for i in range(0, len(doomed), 1000):
        batch = doomed[i:i + 1000]
        client.delete(uri.bucket, [o.key for o in batch]).result()
        if on_deleted:
            on_deleted(len(batch))
    result.deleted_objects += len(doomed)
    result.deleted_bytes += sum(o.size for o in doomed)
    result.kept = sorted(o.key for o in kept)
    result.kept_bytes = sum(o.size for o in kept)
    if markers:  # a save here that never finished: it will not commit with its objects gone
        client.delete(uri.bucket, [o.key for o in markers]).result()
        result.deleted_objects += len(markers)
        result.deleted_bytes += sum(o.size for o in markers)
        refs = references(client, uri.bucket, parent_prefix(uri))
        if refs.unreadable:
            return result
    result.released, result.kept_recent = release_unreferenced(client, uri.bucket, own_refs, refs,
                                                                older_than_s=older_than_s, now=now)
    if kept:
        log.info("deleted %s; kept %d of its object(s) (%d bytes) that other checkpoints reference", uri,
                 len(kept), result.kept_bytes)
    return result


class Released(NamedTuple):
    """What :func:`release_unreferenced` deleted, and what it kept for a save that may be running."""

    deleted: list[str]
    kept_recent: list[str]


def release_unreferenced(client: S3Client, bucket: str, keys: Iterable[str], refs: References, *,
                         older_than_s: float = DEFAULT_OLDER_THAN_S, now: float | None = None) -> Released:
    """Delete those of ``keys`` (objects in sibling directories) that no committed checkpoint
    references and whose directory is no committed checkpoint: leftovers of deleted bases. Not
    those whose save showed life within ``older_than_s`` of ``now`` (gc's rule: its newest object,
    upload start or uploaded part): a directory without a commit may be a save in progress, and
    metadata (damaged, crafted, or a base's) naming its objects must not delete them under it."""
    candidates = sorted(k for k in keys
                        if not refs.users(k) and f"{k.rpartition('/')[0]}/" not in refs.committed
                        and is_data_object(k.rpartition("/")[2]) and k.startswith(refs.parent))
    now = time.time() if now is None else now
    recent = _recent(client, bucket, candidates, now - older_than_s, now)
    doomed = [k for k in candidates if k not in recent]
    if doomed:
        client.delete(bucket, doomed).result()
    if recent:
        log.warning("kept %d object(s) of saves active in the last %.0f s that nothing committed references (a "
                    "save may still be writing them; s3dcp gc removes them once they are older): %s", len(recent),
                    older_than_s, ", ".join(sorted(recent)[:5]))
    return Released(doomed, sorted(recent))


def _recent(client: S3Client, bucket: str, keys: list[str], cutoff: float, now: float) -> set[str]:
    """Those of ``keys`` whose save (the token in the object's name, per directory) has an object,
    an unfinished upload's start or an uploaded part newer than ``cutoff``: one LIST of objects and
    one of uploads per directory, ListParts only for old uploads, as gc judges a save."""
    by_dir: dict[str, list[str]] = {}
    for k in keys:
        by_dir.setdefault(f"{k.rpartition('/')[0]}/", []).append(k)
    recent: set[str] = set()
    for directory, ks in by_dir.items():
        objects, _ = client.list(bucket, directory, delimiter="/").result()
        uploads = [u for u in client.list_uploads(bucket, directory).result() if "/" not in u.key[len(directory):]]
        newest: dict[str, float] = {}
        for key, stamp in [(o.key, o.last_modified) for o in objects] + [(u.key, u.initiated) for u in uploads]:
            parsed = parse_object_name(key.rpartition("/")[2])
            if parsed:
                newest[parsed.token] = max(newest.get(parsed.token, float("-inf")), now if stamp is None else stamp)
        for u in uploads:  # an old upload may still be receiving parts
            parsed = parse_object_name(u.key.rpartition("/")[2])
            if parsed and newest[parsed.token] < cutoff:
                newest[parsed.token] = max(newest[parsed.token],
                                           client.upload_activity(bucket, u.key, u.upload_id).result() or cutoff - 1)
        for k in ks:
            parsed = parse_object_name(k.rpartition("/")[2])
            if newest.get(parsed.token, float("-inf")) >= cutoff:
                recent.add(k)
    return recent
