"""The objects of a save's own checkpoint directory that a commit leaves behind or replaces: a
failed commit's own objects (deleted), and, with ``overwrite=True``, the replaced checkpoint's
objects that no sibling references any more (deleted after the new commit)
(:meth:`S3StorageWriter.finish <s3dcp.saving.writer.S3StorageWriter.finish>`).

Best effort throughout: what cannot be deleted is left to ``s3dcp gc``, and said.
"""

from __future__ import annotations

import logging

from ..errors import MetadataFormatError, NoSuchKeyError, S3DCPError
from ..format.layout import METADATA_NAME
from ..format.metadata import decode_metadata
from ..format.references import is_reference
from ..s3.client import S3Client
from ..uri import S3Uri, parent_prefix
from .referenced import references

__all__ = ["delete_own", "delete_replaced", "own_names", "replaced_objects"]

log = logging.getLogger("s3dcp")


def own_names(locations) -> set[str]:
    """The names of a checkpoint's own objects (not references into a base)."""
    return {loc.object_name for loc in locations if not is_reference(loc.object_name)}


def replaced_objects(client: S3Client, uri: S3Uri) -> set[str]:
    """The data objects of the committed checkpoint at ``uri`` a save replaces (overwrite=True),
    read from its metadata before the new commit; empty when there is none or it cannot be
    read (then nothing is deleted)."""
    try:
        raw = client.get(uri.bucket, uri.key(METADATA_NAME)).result()
        old = decode_metadata(raw, source=str(uri.child(METADATA_NAME)))
    except NoSuchKeyError:
        return set()
    except MetadataFormatError:
        log.warning("overwrite of %s: the replaced metadata cannot be read; its data objects are "
                    "left in place (`s3dcp gc` removes them once unreferenced)", uri, exc_info=True)
        return set()
    return own_names((old.storage_data or {}).values())


def delete_own(client: S3Client, uri: S3Uri, names: set[str]) -> None:
    """Delete a failed commit's own objects ``names``."""
    try:
        client.delete(uri.bucket, [uri.key(n) for n in sorted(names)]).result()
    except S3DCPError:
        log.warning("could not delete the %d object(s) of the failed commit of %s; `s3dcp gc` will",
                    len(names), uri, exc_info=True)


def delete_replaced(client: S3Client, uri: S3Uri, names: list[str]) -> None:
    """Delete the replaced checkpoint's objects ``names`` that no sibling references."""
    try:
        # incremental checkpoints next to this one may reference the replaced objects
        refs = references(client, uri.bucket, parent_prefix(uri))
        if refs.unreadable:
            log.warning("overwrite of %s: kept the replaced checkpoint's objects: %s cannot be read", uri,
                        ", ".join(refs.unreadable))
            return
        client.delete(uri.bucket, [uri.key(n) for n in names if not refs.users(uri.key(n))]).result()
    except S3DCPError:
        log.warning("committed %s, but could not delete %d object(s) of the checkpoint it replaced; "
                    "`s3dcp gc` will", uri, len(names), exc_info=True)
