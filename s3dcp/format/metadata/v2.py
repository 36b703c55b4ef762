"""Metadata format version 2: a JSON header and typed binary columns, decoded lazily where it pays.

Why: at 1,024 ranks x 900 tensors a checkpoint has ~920k chunks. Version 1 (one JSON document)
is ~290 MB there and every rank spends ~35 s parsing it; DCP's pickle is 170 MB and ~21 s. Most of
it is numbers that repeat (chunk boxes are the same for every tensor of one shape) or that only
one rank needs (where each item lives). Version 2 stores those numbers as columns and builds Python
objects only for what is asked for.

Layout of the object (all integers little-endian)::

    magic     8 bytes  b"\\x89S3DCPMD"  (0x89: never the first byte of JSON text, so v1 and v2 are told apart)
    length    8 bytes  u64, length of the header
    header    JSON (UTF-8, ASCII in practice): {"format": "s3dcp-metadata", "version": 2, ...}
    body      the columns' bytes, where the header's "columns" entries say
    crc32     4 bytes  zlib.crc32 of everything before it (truncation and bit rot are caught)

The header holds everything that is small or not numeric, in the same vocabulary as version 1:
``dcp_version``, ``planner_data`` (the tagged tree), ``storage_meta``, and tables that columns
index into: ``fqns`` (state_dict_metadata keys in order, then fqns only storage keys use),
``properties`` (distinct TensorProperties as ``[dtype, layout, requires_grad, memory_format,
pin_memory]``), and under ``storage_data``: ``object_names`` (interned; any string, so a later
incremental checkpoint may point at ``"../step-1000/__0_0.tok.distcp"``), ``dtypes``, and how
checksums are stored (below). Columns (see :mod:`s3dcp.format.metadata.columns`):

    state_dict_metadata, one value per entry:
      sdm.properties   0 = bytes item, k = properties[k-1]
      sdm.size.len, sdm.size         ragged: ndim, then the flat global sizes
      sdm.layout       k = chunk layout k-1; 0 = bytes item, or chunk boxes of mixed ndim kept in
                       the header's "odd_chunks" {position: [[offsets, sizes], ...]}
    chunk layouts (distinct chunk lists: every tensor of one shape shares one, e.g. 6 for 921k chunks):
      layout.ndim, layout.count, layout.offsets, layout.sizes (flat, count x ndim each)
    storage_data, one value per item, in the dict's order:
      sd.fqn           index into fqns
      sd.chunk, sd.chunk.null   the key's offset is chunk #n of its fqn's chunk list (stored once,
                       there); null rows keep their offset in sd.key.len/sd.key.null/sd.key
      sd.index, sd.index.null   MetadataIndex.index
      sd.object        index into object_names;  sd.offset, sd.length  byte range
      sd.checksum      the item checksum (see below)
      sd.dtype         0 = None, k = dtypes[k-1]
      sd.shape.kind    0 = same as the chunk's sizes, 1 = None, 2 = in sd.shape.len/sd.shape
      sd.block_size, sd.blocks  per-block checksum size and count;  sd.block_checksum  flat

A checksum column is raw integers when every value has the form ``algorithm:hex`` of one algorithm
and one width (``crc32c:1a2b3c4d`` -> u4, ``crc64nvme`` -> u8; header ``{"algorithm": "crc32c",
"hex_digits": 8}``, plus a ``.null`` column for items without one); otherwise it falls back to an
interned string table (``{"strings": [...]}``, column value 0 = None). Every item keeps its checksum.

Decoding validates everything before returning: lengths, bounds, types, duplicate keys, the
trailer CRC; a bad object raises MetadataFormatError. It is bounded by the object's size: every
declared count is charged to a :class:`~s3dcp.format.metadata.budget.DecodeBudget` before
anything of that size is inflated or built (layouts and compression let a small object declare a
lot). Whether the decoded Metadata is one a load can trust (each chunk's location holds its dtype,
shape and byte count) is :func:`~s3dcp.format.metadata.validate.validate_metadata`'s question. ``state_dict_metadata`` is always built in
full: DCP's load planner matches every chunk box against the rank's tensors. ``storage_data`` is
either a plain dict (``lazy=False``) or a :class:`LazyStorageData` mapping that builds an
ItemLocation only when the storage reader asks for it (one rank reads only its own items).

Compatibility: a reader ignores header fields and columns it does not know, so a later writer may
add optional ones (say an ``sd.inherited`` u1 column for incremental checkpoints) without a new
version; a change old readers cannot ignore bumps ``version``, which they refuse by name.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..layout import ItemLocation
from .columns import ColumnWriter
from .common import FORMAT_NAME, _encode_storage_meta
from .dtypes import _LAYOUTS, _MEMORY_FORMATS, _to_name, dtype_to_str
from .fields import _type_name
from .plain_v2 import _HEAD, _TRAILER, MAGIC, VERSION, header_of
from .storage import LazyStorageData
from .tree import encode_tree

__all__ = ["MAGIC", "VERSION", "encode", "header_of", "LazyStorageData"]  # decoding: plain_v2.py



# ---------------------------------------------------------------------------------------------
# Encoding


def encode(md: Metadata) -> bytes:
    """Encode ``md`` (already type-checked at the top level by :func:`s3dcp.format.metadata.encode_metadata`)."""
    cols = ColumnWriter()
    sdm = md.state_dict_metadata
    fqns: list[str] = []
    props: dict[tuple, int] = {}
    layouts: dict[tuple, int] = {}
    lay_ndim: list[int] = []
    lay_count: list[int] = []
    lay_offs: list[int] = []
    lay_sizes: list[int] = []
    sdm_props, sdm_layout, size_len, size_vals = [], [], [], []
    odd_chunks: dict[str, list] = {}
    chunk_of: list[dict | None] = []  # per fqn: {offsets: first chunk position}
    chunks_of: list[list | None] = []
    for pos, (fqn, item) in enumerate(sdm.items()):
        where = f"state_dict_metadata[{fqn!r}]"
        if type(fqn) is not str:
            raise TypeError(f"state_dict_metadata key {fqn!r} is a {_type_name(fqn)}, not a str")
        fqns.append(fqn)
        if isinstance(item, BytesStorageMetadata):
            for column in (sdm_props, sdm_layout, size_len):
                column.append(0)
            chunk_of.append(None)
            chunks_of.append(None)
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise TypeError(f"{where}: cannot encode storage metadata of type {_type_name(item)}")
        p = item.properties
        key = (dtype_to_str(p.dtype), _to_name(_LAYOUTS, p.layout, "layout"), bool(p.requires_grad),
               _to_name(_MEMORY_FORMATS, p.memory_format, "memory_format"), bool(p.pin_memory))
        sdm_props.append(props.setdefault(key, len(props)) + 1)
        size = _ints(item.size, where, ".size")
        size_len.append(len(size))
        size_vals += size
        chunks = list(item.chunks)
        boxes = [(_ints(c.offsets, where, ".chunks[{}].offsets", j), _ints(c.sizes, where, ".chunks[{}].sizes", j))
                 for j, c in enumerate(chunks)]
        ndims = {len(o) for o, _ in boxes} | {len(s) for _, s in boxes}
        if len(ndims) > 1:  # boxes of mixed ndim: nothing DCP writes, kept exactly anyway
            odd_chunks[str(pos)] = [[list(o), list(s)] for o, s in boxes]
            sdm_layout.append(0)
        else:
            flat_o = tuple(v for o, _ in boxes for v in o)
            flat_s = tuple(v for _, s in boxes for v in s)
            lkey = (ndims.pop() if ndims else 0, len(boxes), flat_o, flat_s)
            lid = layouts.get(lkey)
            if lid is None:
                lid = layouts[lkey] = len(layouts)
                lay_ndim.append(lkey[0])
                lay_count.append(lkey[1])
                lay_offs += flat_o
                lay_sizes += flat_s
            sdm_layout.append(lid + 1)
        first: dict[tuple, int] = {}
        for j, (o, _) in enumerate(boxes):
            first.setdefault(o, j)
        chunk_of.append(first)
        chunks_of.append(boxes)
    cols.ints("sdm.properties", sdm_props)
    cols.ints("sdm.layout", sdm_layout)
    cols.ints("sdm.size.len", size_len)
    cols.ints("sdm.size", size_vals)
    cols.ints("layout.ndim", lay_ndim)
    cols.ints("layout.count", lay_count)
    cols.ints("layout.offsets", lay_offs)
    cols.ints("layout.sizes", lay_sizes)

    storage = None if md.storage_data is None else _encode_rows(md.storage_data, fqns, chunk_of, chunks_of, cols)
    header = {
        "format": FORMAT_NAME,
        "version": VERSION,
        "dcp_version": md.version,
        "planner_data": encode_tree(md.planner_data, "planner_data"),
        "storage_meta": _encode_storage_meta(md.storage_meta),
        "fqns": fqns,
        "state_dict_entries": len(sdm),
        "properties": [list(k) for k in props],
        "odd_chunks": odd_chunks,
        "storage_data": storage,
        "columns": cols.header(),
    }
    head = json.dumps(header, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")
    out = b"".join([_HEAD.pack(MAGIC, len(head)), head, cols.body()])
    return out + _TRAILER.pack(zlib.crc32(out))


def _encode_rows(sd: Any, fqns: list[str], chunk_of: list, chunks_of: list, cols: ColumnWriter) -> dict:
    if not isinstance(sd, Mapping):
        raise TypeError(f"storage_data must be dict[MetadataIndex, ItemLocation] or None, got {_type_name(sd)}")
    n_sdm = len(fqns)
    fqn_ids = {f: i for i, f in enumerate(fqns)}
    names: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    r_fqn, r_chunk, r_chunk_null, key_len, key_null, key_vals = [], [], [], [], [], []
    r_index, r_index_null, r_obj, r_off, r_len, r_ck, r_dtype = [], [], [], [], [], [], []
    shape_kind, shape_len, shape_vals, r_bsize, r_blocks, blocks = [], [], [], [], [], []
    for key, loc in sd.items():
        if not isinstance(key, MetadataIndex) or not isinstance(loc, ItemLocation):
            raise TypeError(f"storage_data[{key!r}]: expected MetadataIndex -> ItemLocation, "
                            f"got {_type_name(key)} -> {_type_name(loc)}")
        fqn = key.fqn
        if type(fqn) is not str:
            raise TypeError(f"storage_data[{key!r}]: fqn is a {_type_name(fqn)}, not a str")
        f = fqn_ids.get(fqn)
        if f is None:
            f = fqn_ids[fqn] = len(fqns)
            fqns.append(fqn)
        r_fqn.append(f)
        offset = None if key.offset is None else _ints(key.offset, key, ".offset")
        j = chunk_of[f].get(offset) if f < n_sdm and chunk_of[f] is not None and offset is not None else None
        r_chunk.append(j or 0)
        r_chunk_null.append(j is None)
        if j is None:
            key_null.append(offset is None)
            key_len.append(0 if offset is None else len(offset))
            key_vals += offset or ()
        r_index.append(key.index or 0)
        r_index_null.append(key.index is None)
        if type(loc.object_name) is not str:
            raise TypeError(f"storage_data[{key!r}].object_name is a {_type_name(loc.object_name)}, not a str")
        r_obj.append(names.setdefault(loc.object_name, len(names)))
        r_off.append(loc.offset)
        r_len.append(loc.length)
        r_ck.append(loc.checksum)
        if loc.dtype is not None and type(loc.dtype) is not str:
            raise TypeError(f"storage_data[{key!r}].dtype is a {_type_name(loc.dtype)}, not a str")
        r_dtype.append(0 if loc.dtype is None else dtypes.setdefault(loc.dtype, len(dtypes)) + 1)
        if loc.shape is None:
            shape_kind.append(1)
        else:
            shape = _ints(loc.shape, key, ".shape")
            if j is not None and shape == chunks_of[f][j][1]:
                shape_kind.append(0)
            else:
                shape_kind.append(2)
                shape_len.append(len(shape))
                shape_vals += shape
        r_bsize.append(loc.block_size)
        r_blocks.append(len(loc.block_checksums))
        blocks += loc.block_checksums
    for name, values in [("sd.index", r_index), ("sd.offset", r_off), ("sd.length", r_len), ("sd.block_size", r_bsize)]:
        if not set(map(type, values)) <= {int}:
            bad = next(v for v in values if type(v) is not int)
            raise TypeError(f"storage_data: {name.removeprefix('sd.')} {bad!r} is a {_type_name(bad)}, not an int")
    for name, values in [
        ("sd.fqn", r_fqn), ("sd.chunk", r_chunk), ("sd.chunk.null", r_chunk_null), ("sd.key.len", key_len),
        ("sd.key.null", key_null), ("sd.key", key_vals), ("sd.index", r_index), ("sd.index.null", r_index_null),
        ("sd.object", r_obj), ("sd.offset", r_off), ("sd.length", r_len), ("sd.dtype", r_dtype),
        ("sd.shape.kind", shape_kind), ("sd.shape.len", shape_len), ("sd.shape", shape_vals),
        ("sd.block_size", r_bsize), ("sd.blocks", r_blocks),
    ]:
        cols.ints(name, values)
    return {
        "rows": len(r_fqn),
        "object_names": list(names),
        "dtypes": list(dtypes),
        "checksum": _encode_checksums(cols, "sd.checksum", r_ck),
        "block_checksum": _encode_checksums(cols, "sd.block_checksum", blocks),
    }


def _encode_checksums(cols: ColumnWriter, name: str, values: list) -> dict:
    """Raw integers when every present value is ``alg:<n lowercase hex digits>`` of one alg and n."""
    present = [v for v in values if v is not None]
    if not set(map(type, present)) <= {str}:
        bad = next(v for v in present if type(v) is not str)
        raise TypeError(f"storage_data: checksum {bad!r} is a {_type_name(bad)}, not a str")
    if present:
        alg, sep, digits = present[0].partition(":")
        fmt = f"{alg}:%0{len(digits)}x"
        if sep and alg and 0 < len(digits) <= 16:
            k = len(alg) + 1
            try:
                nums = [int(v[k:], 16) for v in present]
            except ValueError:
                nums = None
            # int() also takes "A", "+a", " a", "a_b": only an exact re-spelling keeps the raw form.
            if nums is not None and max(nums) < 16 ** len(digits) and list(map(fmt.__mod__, nums)) == present:
                it = iter(nums)
                cols.ints(name, [0 if v is None else next(it) for v in values])
                cols.ints(name + ".null", [v is None for v in values])
                return {"algorithm": alg, "hex_digits": len(digits)}
    table: dict[str, int] = {}
    cols.ints(name, [0 if v is None else table.setdefault(v, len(table)) + 1 for v in values])
    return {"strings": list(table)}


def _ints(value: Any, owner: Any, field: str, *args: Any) -> tuple[int, ...]:
    """``value`` as a tuple of ints. The error names ``owner`` (an fqn path or a storage key) and
    ``field.format(*args)``, built only then: this runs for every one of a million chunks."""
    t = tuple(value)
    if type(value) is not torch.Size and not set(map(type, t)) <= {int}:  # a Size holds only ints
        where = owner if type(owner) is str else f"storage_data[{owner!r}]"
        raise TypeError(f"{where}{field.format(*args)}: {value!r} is not a sequence of ints")
    return t


