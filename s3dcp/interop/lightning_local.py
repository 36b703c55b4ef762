"""S3CheckpointIO's local copies: each Lightning checkpoint also kept in a directory of the node,
and loaded from there when it is complete and intact (S3 otherwise).

    <local_dir>/<checkpoint file name>/rank-0/   the objects, .metadata and the marker, as the
                                                 manager's local tier keeps them (format/local.py)

Lightning saves through its CheckpointIO on global rank 0 alone, so one rank's copy is the
whole checkpoint; every item read from it is verified against its checksum, and a corrupt copy
is read from S3 instead (:class:`s3dcp.interop.lightning.S3CheckpointIO`).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from ..format.local import LOCAL_METADATA_NAME
from ..lifecycle.tiers import scan
from ..loading.tiered import TieredClient
from ..loading.reader import S3StorageReader
from ..saving.local_copy import LocalCopy
from ..uri import object_key, parse_s3_uri

__all__ = ["copy_for", "commit", "reader_for", "remove"]


def _name(uri: str) -> str:
    return uri.rstrip("/").rpartition("/")[2]


def _step(name: str) -> int:
    m = re.search(r"step=(\d+)", name)
    return int(m.group(1)) if m else 0


def copy_for(local_dir: str | os.PathLike | None, uri: str) -> LocalCopy | None:
    if local_dir is None:
        return None
    name = _name(uri)
    return LocalCopy(local_dir, name, uri, _step(name), required=False)  # S3 holds every one


def commit(copy: LocalCopy | None, metadata: Any) -> None:
    """The save returned: complete the copy (metadata, then the marker)."""
    if copy is None:
        return
    from ..format.metadata import encode_metadata

    if copy.rank is None:  # written in DCP's process executor's child
        copy.rank = 0
    marker = copy.prepare(encode_metadata(metadata), metadata.storage_data.values(),
                          save_id=metadata.storage_meta.save_id, world_size=1, in_s3=True, saved_at=time.time())
    if marker is not None:  # one rank: nobody else to agree with
        copy.seal(marker)


def reader_for(local_dir: str | os.PathLike | None, uri: str, client) -> S3StorageReader | None:
    """A reader of the complete local copy of ``uri``, or None (no local_dir, no complete copy)."""
    if local_dir is None:
        return None
    name = _name(uri)
    found = scan(Path(local_dir), uri, lambda d: _step(name) if d == name else None).get((_step(name), 0))
    if found is None:
        return None
    marker, rank_dir = found
    s3_uri = parse_s3_uri(uri)
    metadata = (rank_dir / LOCAL_METADATA_NAME).read_bytes()
    tiered = TieredClient(client, s3_uri.bucket, {n: object_key(s3_uri, n) for n in marker.objects}, metadata,
                          s3_uri.key(LOCAL_METADATA_NAME))
    for n in marker.objects:
        tiered.add_file(n, rank_dir / n)
    return S3StorageReader(uri, config=client.config, client=tiered)


def remove(local_dir: str | os.PathLike | None, uri: str) -> None:
    if local_dir is not None:
        shutil.rmtree(Path(local_dir) / _name(uri), ignore_errors=True)
