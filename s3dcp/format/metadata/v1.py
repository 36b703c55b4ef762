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
import re
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ...errors import MetadataFormatError
from ..layout import ItemLocation
from .common import (
    _DTYPES,
    _LAYOUTS,
    _MEMORY_FORMATS,
    FORMAT_NAME,
    _bool,
    _check_version,
    _decode_storage_meta,
    _dict,
    _encode_storage_meta,
    _get,
    _int,
    _ints,
    _json_type,
    _list,
    _named,
    _opt,
    _reject_constant,
    _short,
    _size,
    _str,
    _to_name,
    _type_name,
    dtype_to_str,
)
from .tree import decode_tree, encode_tree


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


def decode(data: bytes) -> Metadata:
    """Decode a format-1 document; the caller (:func:`~s3dcp.format.metadata.decode_metadata`) names the source."""
    if not data.strip():
        raise MetadataFormatError("not s3dcp metadata: the object is empty")
    # Parsing is bounded by the object's size, except that an array or object costs ~60 bytes of
    # memory for its 2 or 3 bytes of text ("[],"), and decoding copies the tree once more. What
    # s3dcp writes has one per >= 30 bytes; refuse a document made of them before parsing it.
    containers = data.count(b"[") + data.count(b"{")
    if containers > max(_MIN_CONTAINERS, len(data) // _BYTES_PER_CONTAINER):
        raise MetadataFormatError(
            f"corrupt s3dcp metadata: {containers} JSON arrays and objects in {len(data)} bytes, more than "
            "s3dcp writes (one per 30 bytes or more); the object is damaged or crafted")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:  # a pickle, for one, starts with byte 0x80
        msg = f"not s3dcp metadata: not UTF-8 JSON text (bad byte at offset {e.start})"
        raise MetadataFormatError(msg) from None
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise MetadataFormatError(f"not s3dcp metadata: not valid JSON ({e})") from None
    if type(doc) is not dict or "format" not in doc:
        raise MetadataFormatError(f"not s3dcp metadata: a JSON {_json_type(doc)} without a 'format' field")
    if doc["format"] != FORMAT_NAME:
        msg = f"not s3dcp metadata: format is {_short(doc['format'])}, expected {FORMAT_NAME!r}"
        raise MetadataFormatError(msg)
    # The version is checked before anything else is read: a newer layout may differ anywhere.
    _check_version(_get(doc, "version", "metadata", _int), 1)

    sdm = _get(doc, "state_dict_metadata", "metadata", _dict)
    storage_meta = _get(doc, "storage_meta", "metadata")
    return Metadata(
        state_dict_metadata={k: _decode_storage(v, f"state_dict_metadata[{k!r}]") for k, v in sdm.items()},
        planner_data=decode_tree(_get(doc, "planner_data", "metadata"), "planner_data"),
        storage_data=_decode_storage_data(_get(doc, "storage_data", "metadata")),
        storage_meta=None if storage_meta is None else _decode_storage_meta(storage_meta),
        version=_get(doc, "dcp_version", "metadata", _opt(_str)),
    )


_MIN_CONTAINERS = 2**18
_BYTES_PER_CONTAINER = 12

_V1_PREFIX = re.compile(rb'\s*\{\s*"format"\s*:\s*"s3dcp-metadata"\s*,\s*"version"\s*:\s*(\d{1,9})\s*[,}]')


def version_of(data: bytes) -> int | None:
    """The version a JSON document claims: from its first fields when s3dcp wrote it, else by parsing it all."""
    match = _V1_PREFIX.match(bytes(data[:200]))
    if match:
        return int(match.group(1))
    try:  # JSON in another field order: parse it all
        doc = json.loads(bytes(data))
    except (ValueError, RecursionError):
        return None
    version = doc.get("version") if type(doc) is dict and doc.get("format") == FORMAT_NAME else None
    return version if type(version) is int else None


def _decode_storage(node: Any, where: str) -> TensorStorageMetadata | BytesStorageMetadata:
    kind = _get(node, "type", where)
    if kind == "bytes":
        return BytesStorageMetadata()
    if kind != "tensor":
        raise MetadataFormatError(f"{where}.type: unknown storage type {_short(kind)}")
    p, pw = _get(node, "properties", where), f"{where}.properties"
    properties = TensorProperties(
        dtype=_get(p, "dtype", pw, _named(_DTYPES, "dtype")),
        layout=_get(p, "layout", pw, _named(_LAYOUTS, "layout")),
        requires_grad=_get(p, "requires_grad", pw, _bool),
        memory_format=_get(p, "memory_format", pw, _named(_MEMORY_FORMATS, "memory_format")),
        pin_memory=_get(p, "pin_memory", pw, _bool),
    )
    chunks = _get(node, "chunks", where, _list)
    return TensorStorageMetadata(
        properties=properties,
        size=_get(node, "size", where, _size),
        chunks=[
            ChunkStorageMetadata(
                offsets=_get(c, "offsets", f"{where}.chunks[{i}]", _size),
                sizes=_get(c, "sizes", f"{where}.chunks[{i}]", _size),
            )
            for i, c in enumerate(chunks)
        ],
    )


def _decode_storage_data(node: Any) -> dict[MetadataIndex, ItemLocation] | None:
    if node is None:
        return None
    out: dict[MetadataIndex, ItemLocation] = {}
    for i, entry in enumerate(_list(node, "storage_data")):
        w = f"storage_data[{i}]"
        idx, iw = _get(entry, "index", w), f"{w}.index"
        loc, lw = _get(entry, "location", w), f"{w}.location"
        key = MetadataIndex(
            fqn=_get(idx, "fqn", iw, _str),
            offset=_get(idx, "offset", iw, _opt(_ints)),
            index=_get(idx, "index", iw, _opt(_int)),
        )
        if key in out:  # a dict would silently keep only the last one
            raise MetadataFormatError(f"{w}: duplicate entry for {key.fqn!r} at offset {key.offset}")
        out[key] = ItemLocation(
            object_name=_get(loc, "object_name", lw, _str),
            offset=_get(loc, "offset", lw, _int),
            length=_get(loc, "length", lw, _int),
            checksum=_get(loc, "checksum", lw, _opt(_str)),
            dtype=_get(loc, "dtype", lw, _opt(_str)),
            shape=_get(loc, "shape", lw, _opt(_ints)),
            block_size=_get(loc, "block_size", lw, _int),
            block_checksums=tuple(_str(c, f"{lw}.block_checksums[{j}]")
                                  for j, c in enumerate(_get(loc, "block_checksums", lw, _list))),
        )
    return out
