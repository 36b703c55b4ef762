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
checksums are stored (below). Columns (see :mod:`s3dcp.metadata_columns`):

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
trailer CRC; a bad object raises MetadataFormatError. ``state_dict_metadata`` is always built in
full: DCP's load planner matches every chunk box against the rank's tensors. ``storage_data`` is
either a plain dict (``lazy=False``) or a :class:`LazyStorageData` mapping that builds an
ItemLocation only when the storage reader asks for it (one rank reads only its own items).

Compatibility: a reader ignores header fields and columns it does not know, so a later writer may
add optional ones (say an ``sd.inherited`` u1 column for incremental checkpoints) without a new
version; a change old readers cannot ignore bumps ``version``, which they refuse by name.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from . import metadata as m
from .errors import MetadataFormatError
from .layout import ItemLocation
from .metadata_columns import ColumnReader, ColumnWriter

__all__ = ["MAGIC", "VERSION", "encode", "decode", "header_of", "LazyStorageData"]

MAGIC = b"\x89S3DCPMD"
VERSION = 2
_HEAD = struct.Struct("<8sQ")
_TRAILER = struct.Struct("<I")
_MAX_COUNT = 2**32  # no ndim, chunk position or per-item count is this large; sums of them cannot wrap


# ---------------------------------------------------------------------------------------------
# Encoding


def encode(md: Metadata) -> bytes:
    """Encode ``md`` (already type-checked at the top level by :func:`s3dcp.metadata.encode_metadata`)."""
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
            raise TypeError(f"state_dict_metadata key {fqn!r} is a {m._type_name(fqn)}, not a str")
        fqns.append(fqn)
        if isinstance(item, BytesStorageMetadata):
            sdm_props.append(0), sdm_layout.append(0), size_len.append(0), chunk_of.append(None), chunks_of.append(None)
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise TypeError(f"{where}: cannot encode storage metadata of type {m._type_name(item)}")
        p = item.properties
        key = (m.dtype_to_str(p.dtype), m._to_name(m._LAYOUTS, p.layout, "layout"), bool(p.requires_grad),
               m._to_name(m._MEMORY_FORMATS, p.memory_format, "memory_format"), bool(p.pin_memory))
        sdm_props.append(props.setdefault(key, len(props)) + 1)
        size = _ints(item.size, f"{where}.size")
        size_len.append(len(size))
        size_vals += size
        chunks = list(item.chunks)
        boxes = [(_ints(c.offsets, f"{where}.chunks[{j}].offsets"), _ints(c.sizes, f"{where}.chunks[{j}].sizes"))
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
                lay_ndim.append(lkey[0]), lay_count.append(lkey[1])
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
        "format": m.FORMAT_NAME,
        "version": VERSION,
        "dcp_version": md.version,
        "planner_data": m._encode_tree(md.planner_data, "planner_data"),
        "storage_meta": m._encode_storage_meta(md.storage_meta),
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
        raise TypeError(f"storage_data must be dict[MetadataIndex, ItemLocation] or None, got {m._type_name(sd)}")
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
                            f"got {m._type_name(key)} -> {m._type_name(loc)}")
        where = f"storage_data[{key!r}]"
        fqn = key.fqn
        if type(fqn) is not str:
            raise TypeError(f"{where}: fqn is a {m._type_name(fqn)}, not a str")
        f = fqn_ids.get(fqn)
        if f is None:
            f = fqn_ids[fqn] = len(fqns)
            fqns.append(fqn)
        r_fqn.append(f)
        offset = None if key.offset is None else _ints(key.offset, f"{where}.offset")
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
            raise TypeError(f"{where}.object_name is a {m._type_name(loc.object_name)}, not a str")
        r_obj.append(names.setdefault(loc.object_name, len(names)))
        r_off.append(loc.offset)
        r_len.append(loc.length)
        r_ck.append(loc.checksum)
        if loc.dtype is not None and type(loc.dtype) is not str:
            raise TypeError(f"{where}.dtype is a {m._type_name(loc.dtype)}, not a str")
        r_dtype.append(0 if loc.dtype is None else dtypes.setdefault(loc.dtype, len(dtypes)) + 1)
        if loc.shape is None:
            shape_kind.append(1)
        else:
            shape = _ints(loc.shape, f"{where}.shape")
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
            raise TypeError(f"storage_data: {name.removeprefix('sd.')} {bad!r} is a {m._type_name(bad)}, not an int")
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
        raise TypeError(f"storage_data: checksum {bad!r} is a {m._type_name(bad)}, not a str")
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


def _ints(value: Any, where: str) -> tuple[int, ...]:
    t = tuple(value)
    if not set(map(type, t)) <= {int}:
        raise TypeError(f"{where}: {value!r} is not a sequence of ints")
    return t


# ---------------------------------------------------------------------------------------------
# Decoding


def header_of(data: bytes | memoryview) -> dict:
    """The JSON header of a version-2 object (not checked beyond being a JSON object with our format)."""
    view = memoryview(data)
    if len(view) < _HEAD.size + _TRAILER.size:
        raise MetadataFormatError(f"truncated s3dcp metadata: {len(view)} bytes, shorter than the fixed header")
    _, head_len = _HEAD.unpack_from(view)
    if _HEAD.size + head_len + _TRAILER.size > len(view):
        raise MetadataFormatError(
            f"truncated s3dcp metadata: the header says {head_len} header bytes, the object has {len(view)} in all")
    try:
        header = json.loads(bytes(view[_HEAD.size:_HEAD.size + head_len]).decode("utf-8"),
                            parse_constant=m._reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MetadataFormatError(f"corrupt s3dcp metadata header: not valid JSON ({e})") from None
    if type(header) is not dict or header.get("format") != m.FORMAT_NAME:
        raise MetadataFormatError(f"corrupt s3dcp metadata header: format is not {m.FORMAT_NAME!r}")
    return header


def decode(data: bytes | memoryview, *, lazy: bool) -> Metadata:
    """Decode a version-2 object (``data`` starts with :data:`MAGIC`); see the module docstring."""
    view = memoryview(data)
    header = header_of(view)
    head_end = _HEAD.size + _HEAD.unpack_from(view)[1]
    # The version is checked before anything else is read: a newer layout may differ anywhere.
    m._check_version(m._get(header, "version", "metadata", m._int), VERSION)
    (crc,) = _TRAILER.unpack_from(view, len(view) - _TRAILER.size)
    if zlib.crc32(view[:-_TRAILER.size]) != crc:
        raise MetadataFormatError("corrupt s3dcp metadata: the CRC32 of its bytes does not match its trailer "
                                  "(truncated or damaged object)")
    cols = ColumnReader(m._get(header, "columns", "metadata"), view[head_end:-_TRAILER.size])
    fqns = m._get(header, "fqns", "metadata", m._list)
    for i, f in enumerate(fqns):
        m._str(f, f"metadata.fqns[{i}]")
    if len(set(fqns)) != len(fqns):
        raise MetadataFormatError("metadata.fqns: duplicate names")
    n_sdm = m._get(header, "state_dict_entries", "metadata", m._int)
    if not 0 <= n_sdm <= len(fqns):
        raise MetadataFormatError(f"metadata.state_dict_entries: {n_sdm} is not in 0..{len(fqns)}")
    chunks = _Chunks(header, cols, fqns[:n_sdm])
    storage = m._get(header, "storage_data", "metadata")
    storage_meta = m._get(header, "storage_meta", "metadata")
    rows = None if storage is None else _Rows(storage, cols, fqns, chunks)
    return Metadata(
        state_dict_metadata=chunks.state_dict_metadata,
        planner_data=m._decode_tree(m._get(header, "planner_data", "metadata"), "planner_data"),
        storage_data=None if rows is None else (LazyStorageData(rows) if lazy else rows.to_dict()),
        storage_meta=None if storage_meta is None else m._decode_storage_meta(storage_meta),
        version=m._get(header, "dcp_version", "metadata", m._opt(m._str)),
    )


def _bounded(arr: np.ndarray, limit: int, where: str) -> np.ndarray:
    """``arr`` as int64 after checking every value is in ``0..limit-1`` (``limit`` <= 2**62)."""
    if arr.size and (arr.dtype == object or int(arr.max()) >= limit or int(arr.min()) < 0):
        raise MetadataFormatError(f"{where}: a value is outside 0..{limit - 1}")
    return arr.astype(np.int64, copy=False)


def _ragged(cols: ColumnReader, name: str, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lengths, start of each, flat values) of the ragged column pair ``name.len`` / ``name``."""
    lengths = _bounded(cols.ints(name + ".len", n), _MAX_COUNT, f"metadata.columns[{name + '.len'!r}]")
    starts = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    return lengths, starts, cols.ints(name, int(starts[-1]))


class _Sizes:
    """Interns torch.Size and tuple values: ~920k chunk boxes hold a few thousand distinct ones."""

    def __init__(self) -> None:
        self._sizes: dict[tuple, torch.Size] = {}

    def rows(self, flat: np.ndarray, count: int, ndim: int) -> list[torch.Size]:
        cache, out = self._sizes, []
        for t in map(tuple, flat.reshape(count, ndim).tolist()):
            s = cache.get(t)
            if s is None:
                s = cache[t] = torch.Size(t)
            out.append(s)
        return out


class _Chunks:
    """state_dict_metadata of a v2 object, built in full, and each fqn's chunk boxes for storage keys."""

    def __init__(self, header: dict, cols: ColumnReader, fqns: list[str]) -> None:
        n = len(fqns)
        table = []
        for i, p in enumerate(m._get(header, "properties", "metadata", m._list)):
            w = f"metadata.properties[{i}]"
            if type(p) is not list or len(p) != 5:
                raise MetadataFormatError(f"{w}: expected [dtype, layout, requires_grad, memory_format, pin_memory]")
            table.append((m._from_name(m._DTYPES, p[0], "dtype"), m._from_name(m._LAYOUTS, p[1], "layout"),
                          m._bool(p[2], w), m._from_name(m._MEMORY_FORMATS, p[3], "memory_format"), m._bool(p[4], w)))
        props = _bounded(cols.ints("sdm.properties", n), len(table) + 1, "metadata.columns['sdm.properties']")
        lay_ndim = cols.ints("layout.ndim")
        n_layouts = len(lay_ndim)
        lay_ndim = _bounded(lay_ndim, _MAX_COUNT, "metadata.columns['layout.ndim']")
        lay_count = _bounded(cols.ints("layout.count", n_layouts), _MAX_COUNT, "metadata.columns['layout.count']")
        total = sum(a * b for a, b in zip(lay_ndim.tolist(), lay_count.tolist()))
        lay_offs, lay_sizes = cols.ints("layout.offsets", total), cols.ints("layout.sizes", total)
        layout = _bounded(cols.ints("sdm.layout", n), n_layouts + 1, "metadata.columns['sdm.layout']")
        size_len, size_start, size_vals = _ragged(cols, "sdm.size", n)
        odd = m._get(header, "odd_chunks", "metadata", m._dict)

        sizes = _Sizes()
        boxes: list[tuple[list, list, list]] = []  # per layout: offsets, sizes, sizes as tuples
        start = 0
        for ndim, count in zip(lay_ndim.tolist(), lay_count.tolist()):
            o = sizes.rows(lay_offs[start:start + ndim * count], count, ndim)
            s = sizes.rows(lay_sizes[start:start + ndim * count], count, ndim)
            boxes.append((o, s, [tuple(x) for x in s], len(set(o)) != len(o)))
            start += ndim * count

        self.offsets: list[list | None] = []  # per fqn: chunk offsets (None: bytes item)
        self.shapes: list[list | None] = []   # per fqn: chunk sizes as tuples
        self.has_dups: list[bool] = []         # per fqn: two chunks with equal offsets (never from DCP)
        self.state_dict_metadata: dict[str, Any] = {}
        props_l, layout_l, size_l, start_l = props.tolist(), layout.tolist(), size_len.tolist(), size_start.tolist()
        for pos, fqn in enumerate(fqns):
            w = f"state_dict_metadata[{fqn!r}]"
            if props_l[pos] == 0:
                if layout_l[pos] or size_l[pos]:
                    raise MetadataFormatError(f"{w}: a bytes item with a size or chunks")
                self.state_dict_metadata[fqn] = BytesStorageMetadata()
                self.offsets.append(None), self.shapes.append(None), self.has_dups.append(False)
                continue
            size = torch.Size(size_vals[start_l[pos]:start_l[pos] + size_l[pos]].tolist())
            if layout_l[pos]:
                o, s, t, dups = boxes[layout_l[pos] - 1]
            else:
                o, s = self._odd(odd, pos, w, sizes)
                t, dups = [tuple(x) for x in s], len(set(o)) != len(o)
            dtype, lay, grad, mf, pin = table[props_l[pos] - 1]
            self.state_dict_metadata[fqn] = TensorStorageMetadata(
                TensorProperties(dtype, lay, grad, mf, pin), size, list(map(ChunkStorageMetadata, o, s)))
            self.offsets.append(o), self.shapes.append(t), self.has_dups.append(dups)
        unknown = set(odd) - {str(p) for p in range(n) if layout_l[p] == 0 and props_l[p]}
        if unknown:
            raise MetadataFormatError(f"metadata.odd_chunks: entries {sorted(unknown)[:5]} belong to no tensor")

    @staticmethod
    def _odd(odd: dict, pos: int, where: str, sizes: _Sizes) -> tuple[list, list]:
        boxes = odd.get(str(pos))
        if type(boxes) is not list:
            raise MetadataFormatError(f"metadata.odd_chunks: missing the chunks of {where}")
        o, s = [], []
        for j, box in enumerate(boxes):
            if type(box) is not list or len(box) != 2:
                raise MetadataFormatError(f"{where}.chunks[{j}]: expected [offsets, sizes]")
            o.append(m._size(box[0], f"{where}.chunks[{j}].offsets"))
            s.append(m._size(box[1], f"{where}.chunks[{j}].sizes"))
        return o, s


class _Rows:
    """The storage_data columns of a v2 object, validated; builds keys and locations on request."""

    def __init__(self, node: Any, cols: ColumnReader, fqns: list[str], chunks: _Chunks) -> None:
        w = "metadata.storage_data"
        n = self.n = m._get(node, "rows", w, m._int)
        self.fqns = fqns
        self.names = [m._str(s, f"{w}.object_names[{i}]") for i, s in enumerate(m._get(node, "object_names", w, m._list))]
        self.dtypes = [None] + [m._str(s, f"{w}.dtypes[{i}]") for i, s in enumerate(m._get(node, "dtypes", w, m._list))]
        c = lambda name: f"metadata.columns[{name!r}]"  # noqa: E731
        n_sdm = len(chunks.offsets)
        self.chunk_offsets, self.chunk_shapes, self.has_dups = chunks.offsets, chunks.shapes, chunks.has_dups
        self.fqn = _bounded(cols.ints("sd.fqn", n), len(fqns), c("sd.fqn"))
        self.chunk = _bounded(cols.ints("sd.chunk", n), _MAX_COUNT, c("sd.chunk"))
        odd = _bounded(cols.ints("sd.chunk.null", n), 2, c("sd.chunk.null")).astype(bool)
        # Rows keyed by a chunk: the fqn has that chunk, and no two rows name the same one.
        n_chunks = np.array([0 if o is None else len(o) for o in chunks.offsets] + [0] * (len(fqns) - n_sdm), np.int64)
        keyed = ~odd
        f_k, j_k = self.fqn[keyed], self.chunk[keyed]
        if f_k.size and (j_k >= n_chunks[f_k]).any():
            raise MetadataFormatError(f"{c('sd.chunk')}: a row names a chunk its fqn does not have")
        base = np.zeros(len(fqns) + 1, np.int64)
        np.cumsum(n_chunks, out=base[1:])
        self.base = base
        gid = base[f_k] + j_k
        if gid.size and np.bincount(gid).max() > 1:
            raise MetadataFormatError(f"{w}: two entries for the same chunk (duplicate key)")
        self.odd = odd
        # Rows with their own key offset (bytes items: None); few.
        odd_rows = np.flatnonzero(odd).tolist()
        key_null = _bounded(cols.ints("sd.key.null", len(odd_rows)), 2, c("sd.key.null")).tolist()
        key_len, key_start, key_vals = _ragged(cols, "sd.key", len(odd_rows))
        self.odd_keys: dict[int, torch.Size | None] = {}
        for k, row in enumerate(odd_rows):
            self.odd_keys[row] = None if key_null[k] else torch.Size(
                key_vals[key_start[k]:key_start[k + 1]].tolist())
        index_null = _bounded(cols.ints("sd.index.null", n), 2, c("sd.index.null")).astype(bool)
        self.index = cols.ints("sd.index", n)
        self.index_null = index_null if index_null.any() else None
        self.obj = _bounded(cols.ints("sd.object", n), len(self.names), c("sd.object"))
        self.offset, self.length = cols.ints("sd.offset", n), cols.ints("sd.length", n)
        self.dtype = _bounded(cols.ints("sd.dtype", n), len(self.dtypes), c("sd.dtype"))
        kind = _bounded(cols.ints("sd.shape.kind", n), 3, c("sd.shape.kind"))
        if (odd & (kind == 0)).any():
            raise MetadataFormatError(f"{c('sd.shape.kind')}: a row without a chunk says its shape is the chunk's")
        self.shape_kind = kind
        explicit = np.flatnonzero(kind == 2)
        shape_len, shape_start, shape_vals = _ragged(cols, "sd.shape", len(explicit))
        self.shapes = {row: tuple(shape_vals[shape_start[k]:shape_start[k + 1]].tolist())
                       for k, row in enumerate(explicit.tolist())}
        self.block_size = cols.ints("sd.block_size", n)
        blocks = _bounded(cols.ints("sd.blocks", n), _MAX_COUNT, c("sd.blocks"))
        self.block_start = np.zeros(n + 1, np.int64)
        np.cumsum(blocks, out=self.block_start[1:])
        self.checksum = _Checksums(node, "checksum", cols, "sd.checksum", n)
        self.block_checksums = _Checksums(node, "block_checksum", cols, "sd.block_checksum", int(self.block_start[-1]))
        if self.block_checksums.has_null():
            raise MetadataFormatError(f"{c('sd.block_checksum')}: a block without a checksum")
        self._index: dict | None = None
        self._odd_checked()

    def _odd_checked(self) -> None:
        """Own-offset keys must be unique and differ from every chunk key (a dict holds each key once)."""
        seen = set()
        for row, offset in self.odd_keys.items():
            f = int(self.fqn[row])
            key = (f, offset)
            first = self._first_chunk(f, offset)
            if key in seen or first is not None:
                raise MetadataFormatError(
                    f"metadata.storage_data: two entries for {self.fqns[f]!r} at offset {offset} (duplicate key)")
            seen.add(key)
        # A chunk row must name the first chunk with its offsets, or two rows could hold one key.
        for f, offsets in enumerate(self.chunk_offsets):
            if self.has_dups[f]:
                mask = (self.fqn == f) & ~self.odd
                for row, j in zip(np.flatnonzero(mask).tolist(), self.chunk[mask].tolist()):
                    if offsets.index(offsets[j]) != j:
                        raise MetadataFormatError(
                            f"metadata.storage_data: two entries for {self.fqns[f]!r} at offset {tuple(offsets[j])}")

    def _first_chunk(self, f: int, offset: Any) -> int | None:
        offsets = self.chunk_offsets[f] if f < len(self.chunk_offsets) else None
        if offsets is None or offset is None:
            return None
        if self._index is None:
            self._index = {}
        table = self._index.get(f)
        if table is None:
            table = self._index[f] = {}
            for j, o in enumerate(offsets):
                table.setdefault(o, j)
        return table.get(offset)

    # -- one row, for LazyStorageData
    def row_of(self, key: Any) -> int:
        """Row of ``key`` (a MetadataIndex), or -1. Tries ``key.index`` as the chunk position first,
        as DCP's own lookups do: the load planner sets it to the chunk's position."""
        if type(key) is not MetadataIndex:
            return -1
        if self._fqn_ids is None:
            self._build_lookup()
        f = self._fqn_ids.get(key.fqn)
        if f is None:
            return -1
        offsets = self.chunk_offsets[f] if f < len(self.chunk_offsets) else None
        j = None
        if offsets is not None and key.offset is not None:
            hint = key.index
            if type(hint) is int and 0 <= hint < len(offsets) and offsets[hint] == key.offset and not self.has_dups[f]:
                j = hint
            else:
                j = self._first_chunk(f, tuple(key.offset))
        if j is not None:
            row = int(self._row_by_chunk[self.base[f] + j])
            if row >= 0:
                return row
        return self._odd_rows.get((f, None if key.offset is None else tuple(key.offset)), -1)

    _fqn_ids: dict | None = None

    def _build_lookup(self) -> None:
        self._fqn_ids = {f: i for i, f in enumerate(self.fqns)}
        by_chunk = np.full(int(self.base[-1]), -1, np.int64)
        keyed = np.flatnonzero(~self.odd)
        by_chunk[self.base[self.fqn[keyed]] + self.chunk[keyed]] = keyed
        self._row_by_chunk = by_chunk
        self._odd_rows = {(int(self.fqn[r]), None if o is None else tuple(o)): r for r, o in self.odd_keys.items()}

    def key(self, i: int) -> MetadataIndex:
        f = int(self.fqn[i])
        offset = self.odd_keys[i] if self.odd[i] else self.chunk_offsets[f][self.chunk[i]]
        index = None if self.index_null is not None and self.index_null[i] else int(self.index[i])
        return MetadataIndex(self.fqns[f], offset, index)

    def location(self, i: int) -> ItemLocation:
        kind = self.shape_kind[i]
        if kind == 0:
            shape = self.chunk_shapes[int(self.fqn[i])][self.chunk[i]]
        else:
            shape = None if kind == 1 else self.shapes[i]
        b0, b1 = int(self.block_start[i]), int(self.block_start[i + 1])
        return ItemLocation(
            object_name=self.names[self.obj[i]], offset=int(self.offset[i]), length=int(self.length[i]),
            checksum=self.checksum.one(i), dtype=self.dtypes[self.dtype[i]], shape=shape,
            block_size=int(self.block_size[i]), block_checksums=tuple(self.block_checksums.many(b0, b1)),
        )

    # -- every row, vectorised, for the eager dict
    def keys(self) -> list[MetadataIndex]:
        fqn = self.fqn.tolist()
        names = list(map(self.fqns.__getitem__, fqn))
        offs = self.chunk_offsets
        offsets = [None if z else offs[f][j] for f, j, z in zip(fqn, self.chunk.tolist(), self.odd.tolist())]
        for row, o in self.odd_keys.items():
            offsets[row] = o
        index = self.index.tolist()
        if self.index_null is not None:
            index = [None if z else v for v, z in zip(index, self.index_null.tolist())]
        return list(map(MetadataIndex, names, offsets, index))

    def locations(self) -> list[ItemLocation]:
        n = self.n
        fqn, chunk, kind = self.fqn.tolist(), self.chunk.tolist(), self.shape_kind.tolist()
        shapes_of = self.chunk_shapes
        shapes = [shapes_of[f][j] if k == 0 else None for f, j, k in zip(fqn, chunk, kind)]
        for row, s in self.shapes.items():
            shapes[row] = s
        blocks: list[tuple] = [()] * n
        starts = self.block_start
        flat = self.block_checksums.all()
        for row in np.flatnonzero(starts[1:] != starts[:-1]).tolist():
            blocks[row] = tuple(flat[starts[row]:starts[row + 1]])
        return list(map(
            ItemLocation, map(self.names.__getitem__, self.obj.tolist()), self.offset.tolist(),
            self.length.tolist(), self.checksum.all(), map(self.dtypes.__getitem__, self.dtype.tolist()), shapes,
            self.block_size.tolist(), blocks,
        ))

    def to_dict(self) -> dict[MetadataIndex, ItemLocation]:
        return dict(zip(self.keys(), self.locations()))


class _Checksums:
    """A checksum column: raw integers printed as ``alg:hex``, or indexes into a string table."""

    def __init__(self, node: Any, field: str, cols: ColumnReader, name: str, n: int) -> None:
        spec = m._get(node, field, "metadata.storage_data", m._dict)
        where = f"metadata.storage_data.{field}"
        self.values = cols.ints(name, n)
        if "strings" in spec:
            self.table = [None] + [m._str(s, f"{where}.strings[{i}]") for i, s in enumerate(m._list(spec["strings"], where))]
            _bounded(self.values, len(self.table), f"metadata.columns[{name!r}]")
            self.values = self.values.astype(np.int64, copy=False)
            self.fmt = None
            self.null = None
            return
        alg = m._get(spec, "algorithm", where, m._str)
        digits = m._get(spec, "hex_digits", where, m._int)
        if not 0 < digits <= 16:
            raise MetadataFormatError(f"{where}.hex_digits: {digits} is not in 1..16")
        if self.values.size and (self.values.dtype == object or int(self.values.max()) >= 16**digits):
            raise MetadataFormatError(f"metadata.columns[{name!r}]: a checksum wider than {digits} hex digits")
        self.fmt = f"{alg}:%0{digits}x"
        null = _bounded(cols.ints(name + ".null", n), 2, f"metadata.columns[{name + '.null'!r}]")
        self.null = null.astype(bool) if null.any() else None

    def has_null(self) -> bool:
        return self.null is not None or (self.fmt is None and bool((self.values == 0).any()))

    def one(self, i: int) -> str | None:
        if self.fmt is None:
            return self.table[self.values[i]]
        return None if self.null is not None and self.null[i] else self.fmt % int(self.values[i])

    def many(self, start: int, end: int) -> list:
        if start == end:
            return []
        if self.fmt is None:
            return [self.table[v] for v in self.values[start:end].tolist()]
        return list(map(self.fmt.__mod__, self.values[start:end].tolist()))

    def all(self) -> list:
        if self.fmt is None:
            return list(map(self.table.__getitem__, self.values.tolist()))
        out = list(map(self.fmt.__mod__, self.values.tolist()))
        if self.null is not None:
            for i in np.flatnonzero(self.null).tolist():
                out[i] = None
        return out


class LazyStorageData(Mapping):
    """``Metadata.storage_data`` of a v2 checkpoint: a read-only mapping MetadataIndex -> ItemLocation
    that builds each location when it is looked up.

    It behaves as the dict a full decode gives: same keys in the same order, ``len``, ``in``,
    ``get``, iteration, ``==`` with a dict. Lookups build a row index on first use (vectorised,
    ~tens of ms at a million items); a location is built once and kept. Pickling or deep-copying
    it gives a plain dict, so nothing outside s3dcp ever has to know this class.
    """

    def __init__(self, rows: _Rows) -> None:
        self._rows = rows
        self._cache: dict[int, ItemLocation] = {}

    def __len__(self) -> int:
        return self._rows.n

    def __iter__(self) -> Iterator[MetadataIndex]:
        key = self._rows.key
        return (key(i) for i in range(self._rows.n))

    def __contains__(self, key: object) -> bool:
        return self._rows.row_of(key) >= 0

    def __getitem__(self, key: MetadataIndex) -> ItemLocation:
        row = self._rows.row_of(key)
        if row < 0:
            raise KeyError(key)
        loc = self._cache.get(row)
        if loc is None:
            loc = self._cache[row] = self._rows.location(row)
        return loc

    def items(self):  # one pass over the rows, no lookups
        return dict(zip(self._rows.keys(), self._rows.locations())).items() if self._rows.n else {}.items()

    def values(self):
        return self._rows.locations()

    def __reduce__(self):
        return (dict, (self._rows.to_dict(),))

    def __repr__(self) -> str:
        return f"<LazyStorageData: {self._rows.n} items>"
