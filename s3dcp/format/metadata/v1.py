"""Metadata format version 1: one JSON document, starting with ``{``.

Simple to read with any tool, but at 1,000+ ranks it is hundreds of MB that every rank parses in
full. It looks like this (version 2 reuses its vocabulary for the header)::

     "state_dict_metadata": {"model.w": {"type": "tensor",
                                         "properties": {"dtype": "bfloat16", "layout": "strided",
                                                        "requires_grad": false,
                                                        "memory_format": "contiguous_format",
                                                        "pin_memory": false},
                                         "size": [4, 8],
                                         "chunks": [{"offsets": [0, 0], "sizes": [4, 8]}]},
                             "step": {"type": "bytes"}},
     "storage_data": [{"index": {"fqn": "model.w", "offset": [0, 0], "index": 0},
                       "location": {"object_name": "__0_0.data", "offset": 0, "length": 64,
                                    "checksum": "crc32c:1a2b3c4d", "dtype": "bfloat16",
                                    "shape": [4, 8], "block_size": 0, "block_checksums": []}}],
     "planner_data": <tagged tree>, "storage_meta": {"checkpoint_id": ..., "save_id": ...,
                                                     "load_id": ..., "modules": [...]}}

``planner_data`` is a tagged tree (:mod:`s3dcp.format.metadata.tree`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from ..layout import ItemLocation
from .common import FORMAT_NAME, _encode_storage_meta
from .dtypes import _LAYOUTS, _MEMORY_FORMATS, _to_name, dtype_to_str
from .fields import _type_name
from .tree import encode_tree


def encode(md: Metadata) -> bytes:
    """Encode ``md`` as one JSON document, pure ASCII (the caller has checked ``md``'s type)."""
    sdm = {}
    for fqn, item in md.state_dict_metadata.items():
        if type(fqn) is not str:  # json.dumps would silently turn an int key into a string
            raise TypeError(f"state_dict_metadata key {fqn!r} is a {_type_name(fqn)}, not a str")
        sdm[fqn] = _encode_storage(item, f"state_dict_metadata[{fqn!r}]")
    doc = {
        "format": FORMAT_NAME,
        "version": 1,
        "dcp_version": md.version,
        "state_dict_metadata": sdm,
        "storage_data": _encode_storage_data(md.storage_data),
        "planner_data": encode_tree(md.planner_data, "planner_data"),
        "storage_meta": _encode_storage_meta(md.storage_meta),
    }
    # ensure_ascii keeps any str (even a lone surrogate) lossless; allow_nan=False proves the
    # tagged tree left no bare nan/inf behind.
    return json.dumps(doc, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _encode_storage(item: Any, where: str) -> dict:
    if isinstance(item, BytesStorageMetadata):
        return {"type": "bytes"}
    if not isinstance(item, TensorStorageMetadata):
        raise TypeError(f"{where}: cannot encode storage metadata of type {_type_name(item)}")
    p = item.properties
    return {
        "type": "tensor",
        "properties": {
            "dtype": dtype_to_str(p.dtype),
            "layout": _to_name(_LAYOUTS, p.layout, "layout"),
            "requires_grad": bool(p.requires_grad),
            "memory_format": _to_name(_MEMORY_FORMATS, p.memory_format, "memory_format"),
            "pin_memory": bool(p.pin_memory),
        },
        "size": list(item.size),
        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in item.chunks],
    }


def _encode_storage_data(sd: Any) -> list | None:
    if sd is None:
        return None
    if not isinstance(sd, Mapping):  # a dict, or the lazy mapping a v2 decode gives
        raise TypeError(
            f"storage_data must be dict[MetadataIndex, ItemLocation] or None, got {_type_name(sd)}"
        )
    out = []
    for key, loc in sd.items():
        if not isinstance(key, MetadataIndex) or not isinstance(loc, ItemLocation):
            raise TypeError(
                f"storage_data[{key!r}]: expected MetadataIndex -> ItemLocation, "
                f"got {_type_name(key)} -> {_type_name(loc)}"
            )
        out.append({
            "index": {
                "fqn": key.fqn,
                "offset": None if key.offset is None else list(key.offset),
                "index": key.index,
            },
            "location": {
                "object_name": loc.object_name,
                "offset": loc.offset,
                "length": loc.length,
                "checksum": loc.checksum,
                "dtype": loc.dtype,
                "shape": None if loc.shape is None else list(loc.shape),
                "block_size": loc.block_size,
                "block_checksums": list(loc.block_checksums),
            },
        })
    return out
