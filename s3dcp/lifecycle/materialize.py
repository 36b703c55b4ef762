"""Making an incremental checkpoint self-contained: server-side copies of what it references
(:func:`materialize`, ``s3dcp materialize``)."""

from __future__ import annotations

import logging
from concurrent.futures import wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..errors import CheckpointError, CheckpointNotFoundError, NoSuchKeyError
from ..format.layout import METADATA_NAME, new_save_id, object_sizes, parse_object_name
from ..format.references import split_reference
from ..s3.client import S3Client
from ..saving.referenced import references
from ..uri import object_key, parent_prefix, parse_s3_uri
from .deletion import release_unreferenced

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["MaterializeResult", "materialize"]

log = logging.getLogger("s3dcp")


@dataclass
class MaterializeResult:
    """What :func:`materialize` did."""

    uri: str
    copied_objects: int = 0
    copied_bytes: int = 0
    items: int = 0  # items that were references
    released: list[str] = field(default_factory=list)


def materialize(uri: str, *, client: S3Client | None = None, config=None,
                **copy_options) -> MaterializeResult:
    """Make the checkpoint at ``uri`` self-contained: copy every object it references into
    its own directory with server-side copies (``CopyObject``, ``UploadPartCopy`` above the
    multipart threshold: no bytes pass through this machine), then replace its metadata by one
    that names the copies. The checkpoint stays committed and loadable throughout (the new
    metadata is one atomic PUT, written after every copy exists). Objects of deleted bases
    that only this checkpoint referenced are deleted afterwards. ``copy_options`` go to
    :meth:`s3dcp.s3.client.S3Client.copy` (``multipart_threshold_bytes``)."""
    from ..format.metadata import decode_metadata, encode_metadata

    target = parse_s3_uri(uri)
    client = client or S3Client(config)
    source = str(target.child(METADATA_NAME))
    try:
        raw = client.get(target.bucket, target.key(METADATA_NAME)).result()
    except NoSuchKeyError as e:
        raise CheckpointNotFoundError(f"no committed checkpoint at {target} (no {METADATA_NAME})") from e
    metadata: Metadata = decode_metadata(raw, source=source)
    storage = dict((metadata.storage_data or {}).items())  # a plain dict (v2 decodes lazily, read-only)
    metadata.storage_data = storage
    referenced = sorted({loc.object_name for loc in storage.values() if split_reference(loc.object_name)[0]})
    result = MaterializeResult(str(target))
    if not referenced:
        return result
    token = new_save_id()
    renamed: dict[str, str] = {}
    for i, name in enumerate(referenced):
        parsed = parse_object_name(split_reference(name)[1])
        renamed[name] = f"__{parsed.rank if parsed else 0}_{i}.{token}.distcp"
    heads = {name: client.head(target.bucket, object_key(target, name)) for name in referenced}
    wait(list(heads.values()))
    missing = [name for name, f in heads.items() if f.exception() is not None]
    if missing:
        raise CheckpointError(f"materialize {target}: {len(missing)} referenced object(s) cannot be read, first "
                              f"{object_key(target, missing[0])}: {heads[missing[0]].exception()}; nothing was "
                              "changed") from heads[missing[0]].exception()
    # Each copy is the prefix the checkpoint uses, up to its last item there: the source may hold
    # more (items of its own checkpoint this one changed), and an incremental save based on this
    # one checks its own objects at exactly where their last item ends. A prefix is a ranged
    # (UploadPartCopy) copy; the whole object, one CopyObject.
    ends = object_sizes(loc for loc in storage.values() if loc.object_name in renamed)
    futures = {}
    for name, new in renamed.items():
        options = dict(copy_options)
        if ends[name] < heads[name].result().size:
            options["multipart_threshold_bytes"] = 0
        futures[name] = client.copy(target.bucket, object_key(target, name), target.key(new), ends[name], **options)
    wait(list(futures.values()))
    failed = [(name, f.exception()) for name, f in futures.items() if f.exception() is not None]
    if failed:
        client.delete(target.bucket, [target.key(renamed[n]) for n in futures if futures[n].exception() is None])
        name, err = failed[0]
        raise CheckpointError(f"materialize {target}: copying {object_key(target, name)} failed ({err}); "
                              "nothing was changed") from err
    result.copied_objects = len(renamed)
    result.copied_bytes = sum(f.result() for f in futures.values())
    for index, loc in storage.items():
        if loc.object_name in renamed:
            storage[index] = replace(loc, object_name=renamed[loc.object_name])
            result.items += 1
    client.put(target.bucket, target.key(METADATA_NAME), encode_metadata(metadata),
               single_request=True, content_type="application/json").result()
    refs = references(client, target.bucket, parent_prefix(target))
    if not refs.unreadable:
        result.released = release_unreferenced(client, target.bucket, (object_key(target, n) for n in referenced),
                                               refs).deleted
    log.info("materialized %s: %d object(s), %d bytes copied server-side for %d item(s)", target,
             result.copied_objects, result.copied_bytes, result.items)
    return result
