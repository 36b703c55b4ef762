"""What both metadata format versions share: names and the version check.

- the format's name and versions (:data:`FORMAT_NAME`, :data:`FORMAT_VERSION`, the versions read);
- (torch's dtypes, layouts and memory formats by name: :mod:`s3dcp.format.metadata.names`
  without torch, :mod:`s3dcp.format.metadata.dtypes` with it);
- ``storage_meta``, which both versions store as the same JSON object;
- (checked access to decoded JSON is :mod:`s3dcp.format.metadata.fields`'s).
"""

from __future__ import annotations

import os
from typing import Any

from ...errors import MetadataFormatError
from ..context import At
from .fields import _get, _list, _opt, _str
from .plain import StoredMeta

FORMAT_NAME = "s3dcp-metadata"
FORMAT_VERSION = 2  # the version every s3dcp since 2 reads; encode_metadata writes 3 only where it pays
_READS = (1, 2, 3)


def _check_version(version: int, container: int) -> None:
    """Refuse a version this s3dcp cannot read, or one stored in the other version's container."""
    if version > max(_READS):
        raise MetadataFormatError(
            f"written by a newer s3dcp (format version {version}); "
            f"this s3dcp reads versions {_READS[0]} to {_READS[-1]} — upgrade s3dcp"
        )
    if version not in _READS:
        raise MetadataFormatError(f"unsupported format version {version}; this s3dcp reads versions {_READS}")
    if version != container:
        kind = "JSON text" if version == 1 else "binary (it starts with byte 0x89)"
        raise MetadataFormatError(f"corrupt s3dcp metadata: format version {version} is {kind}, this object is not")


def _encode_storage_meta(sm: Any) -> dict | None:
    if sm is None:
        return None
    return {
        # A PathLike is stored as its str: the path is what matters, not the Python class.
        "checkpoint_id": None if sm.checkpoint_id is None else os.fsdecode(sm.checkpoint_id),
        "save_id": sm.save_id,
        "load_id": sm.load_id,
        "modules": list(sm.modules),
    }


def _decode_storage_meta(node: Any) -> StoredMeta:
    w = "storage_meta"
    modules = _get(node, "modules", w, _list)
    return StoredMeta(
        checkpoint_id=_get(node, "checkpoint_id", w, _opt(_str)),
        save_id=_get(node, "save_id", w, _opt(_str)),
        load_id=_get(node, "load_id", w, _opt(_str)),
        modules=[_str(m, At(w, ".modules[", i, "]")) for i, m in enumerate(modules)],
    )
