"""Metadata format version 1 read back: one JSON document (see :mod:`s3dcp.format.metadata.v1`)."""

from __future__ import annotations

import json
import re
from typing import Any

from ...errors import MetadataFormatError
from ..context import At, quoted
from ..layout import ItemLocation
from .budget import DecodeBudget
from .common import FORMAT_NAME, _check_version, _decode_storage_meta
from .fields import check_containers, _bool, _dict, _get, _int, _ints, _json_type, _list, _opt, _reject_constant, _short, _str
from .names import check_name
from .plain import ChunkLayout, PlainBytes, PlainMetadata, PlainTensor, Properties, StorageKey, StorageList
from .tree import decode_tree

__all__ = ["decode", "version_of"]


def decode(data: bytes) -> PlainMetadata:
    """Decode a format-1 document; the caller (:func:`~s3dcp.format.metadata.decode_plain`) names the source."""
    if not data.strip():
        raise MetadataFormatError("not s3dcp metadata: the object is empty")
    check_containers(data, "corrupt s3dcp metadata")  # before parsing: see fields.check_containers
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
    budget = DecodeBudget(len(data))  # what the document holds is parsed already: this counts what is built
    budget.names("state_dict_metadata", list(sdm), "fqns")
    return PlainMetadata(
        version=1,
        state_dict={k: _decode_storage(v, At("state_dict_metadata[", quoted(k), "]"), budget) for k, v in sdm.items()},
        planner_data=decode_tree(_get(doc, "planner_data", "metadata"), "planner_data"),
        storage=_decode_storage_data(_get(doc, "storage_data", "metadata"), budget),
        storage_meta=None if storage_meta is None else _decode_storage_meta(storage_meta),
        dcp_version=_get(doc, "dcp_version", "metadata", _opt(_str)),
    )


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


_BYTES = PlainBytes()


def _decode_storage(node: Any, where: Any, budget: DecodeBudget) -> PlainTensor | PlainBytes:
    kind = _get(node, "type", where)
    if kind == "bytes":
        return _BYTES
    if kind != "tensor":
        raise MetadataFormatError(f"{where}.type: unknown storage type {_short(kind)}")
    p, pw = _get(node, "properties", where), At(where, ".properties")
    properties = Properties(
        dtype=check_name("dtype", _get(p, "dtype", pw)),
        layout=check_name("layout", _get(p, "layout", pw)),
        requires_grad=_get(p, "requires_grad", pw, _bool),
        memory_format=check_name("memory_format", _get(p, "memory_format", pw)),
        pin_memory=_get(p, "pin_memory", pw, _bool),
    )
    chunks = _get(node, "chunks", where, _list)
    budget.objects(At(where, ".chunks"), len(chunks), "chunks")
    size = _get(node, "size", where, _ints)
    offsets, sizes = [], []
    for i, c in enumerate(chunks):
        cw = At(where, ".chunks[", i, "]")
        offsets.append(_get(c, "offsets", cw, _ints))
        sizes.append(_get(c, "sizes", cw, _ints))
    return PlainTensor(properties, size, ChunkLayout(offsets, sizes))


def _decode_storage_data(node: Any, budget: DecodeBudget) -> StorageList | None:
    if node is None:
        return None
    keys: dict[tuple, StorageKey] = {}
    locations: list[ItemLocation] = []
    entries = _list(node, "storage_data")
    budget.objects("storage_data", 2 * len(entries), "storage items (a key and a location each)")
    for i, entry in enumerate(entries):
        w = At("storage_data[", i, "]")
        idx, iw = _get(entry, "index", w), At(w, ".index")
        loc, lw = _get(entry, "location", w), At(w, ".location")
        key = StorageKey(
            fqn=_get(idx, "fqn", iw, _str),
            offset=_get(idx, "offset", iw, _opt(_ints)),
            index=_get(idx, "index", iw, _opt(_int)),
        )
        if key[:2] in keys:  # a dict would silently keep only the last one (DCP's keys compare fqn and offset)
            raise MetadataFormatError(f"{w}: duplicate entry for {quoted(key.fqn)} at offset {_offset_text(key.offset)}")
        keys[key[:2]] = key
        locations.append(ItemLocation(
            object_name=_get(loc, "object_name", lw, _str),
            offset=_get(loc, "offset", lw, _int),
            length=_get(loc, "length", lw, _int),
            checksum=_get(loc, "checksum", lw, _opt(_str)),
            dtype=_get(loc, "dtype", lw, _opt(_str)),
            shape=_get(loc, "shape", lw, _opt(_ints)),
            block_size=_get(loc, "block_size", lw, _int),
            block_checksums=tuple(_str(c, At(lw, ".block_checksums[", j, "]"))
                                  for j, c in enumerate(_get(loc, "block_checksums", lw, _list))),
        ))
    return StorageList(list(keys.values()), locations)


def _offset_text(offset: tuple | None) -> str:
    """An offset as DCP's MetadataIndex prints it (``torch.Size([0, 4])``), so messages stay as they were."""
    return "None" if offset is None else f"torch.Size({list(offset)})"
