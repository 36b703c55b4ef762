"""Is a decoded Metadata one a load can trust? Semantic checks, after the structural ones of a decode.

A decode (:func:`s3dcp.format.metadata.decode_metadata`) proves the object is well formed: every
field has its type, every index is in range, nothing is larger than the object can hold. That is
not enough to load from it: a damaged or crafted object can be well formed and still describe
bytes that do not match its tensors, and a load would then fill a tensor partly, or from the
wrong bytes, and call it a success. :func:`validate_metadata` checks what a load relies on:

- every chunk box of ``state_dict_metadata`` has as many offsets and sizes as its tensor has
  dimensions, none negative, and lies inside the tensor, and the boxes tile the tensor exactly:
  their volumes add up to the tensor's, and (:func:`s3dcp.format.layout.check_tiling`, the
  export's check) no two overlap, so there is no hole either — a load would otherwise leave the
  hole's elements as the destination held them and call it a success;
- every chunk (and every bytes item) has a storage location;
- the location of a tensor chunk stores the tensor's dtype, the chunk's shape, and exactly
  ``element size x element count`` bytes;
- every location's offset and length are non-negative and end before 2^63; a checksum names an
  algorithm s3dcp knows; per-block checksums cover the item exactly
  (``ceil(length / block_size)`` of them), so a partial read can verify every block it fetches.

It costs O(chunks + items) and runs vectorised over a version-2 lazy ``storage_data`` (no
ItemLocation is built); chunk boxes shared by tensors of one layout are checked once per layout.
A version-1 object or a plain dict is checked item by item (it was built in full already).
Decoding does not call it, so :func:`decode_metadata` keeps giving back exactly what was written
(also for a Metadata no load could use); a reader calls it once per load, at plan time.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from ...errors import MetadataFormatError
from ..context import At, quoted
from ..layout import check_tiling
from ..integrity import algorithm_of
from .dtypes import dtype_to_str
from .locations import check_item
from .rows import Rows
from .storage import LazyStorageData

__all__ = ["validate_metadata"]

_END = 2**63  # offsets and ends of stored bytes stay below this
_HUGE = 2**62  # element counts at or past this are refused before any arithmetic with them


def validate_metadata(md: Metadata, *, source: str = "<metadata>") -> None:
    """Raise MetadataFormatError naming ``source`` and the first problem if a load from ``md`` could
    read bytes that do not belong to the tensor (or bytes item) it fills; see the module docstring."""
    try:
        sdm = md.state_dict_metadata
        _check_chunks(sdm)
        sd = md.storage_data
        if sd is None:
            if sdm:
                raise MetadataFormatError("metadata.storage_data: missing, so nothing can be loaded")
            return
        if isinstance(sd, LazyStorageData):
            _check_rows(sdm, sd._rows)
        else:
            _check_dict(sdm, sd)
    except MetadataFormatError as e:
        raise MetadataFormatError(f"{source}: {e}") from None


def _check_chunks(sdm: dict) -> None:
    seen: dict[tuple, None] = {}  # (size, id of the chunk list's first and last box, length): checked
    for fqn, item in sdm.items():
        if isinstance(item, BytesStorageMetadata):
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise MetadataFormatError(f"state_dict_metadata[{quoted(fqn)}]: not tensor or bytes storage metadata")
        size, chunks = tuple(item.size), item.chunks
        where = At("state_dict_metadata[", quoted(fqn), "]")
        if any(d < 0 for d in size):
            raise MetadataFormatError(f"{where}.size: {size} has a negative dimension")
        key = (size, id(chunks[0]), id(chunks[-1]), len(chunks)) if chunks else (size,)
        if key in seen:  # v2 shares the boxes of one layout between its tensors
            continue
        _check_boxes(where, size, chunks)
        seen[key] = None


def _check_boxes(where: str, size: tuple, chunks: list) -> None:
    """The boxes lie inside the tensor, none twice, and their volumes add up to the tensor's: every
    element is loaded from some chunk (DCP's save planner refuses any other plan)."""
    ndim = len(size)
    for j, c in enumerate(chunks):  # lengths first: a ragged box would make the arrays below fail
        if len(c.offsets) != ndim or len(c.sizes) != ndim:
            raise MetadataFormatError(
                f"{where}.chunks[{j}]: {len(c.offsets)} offsets and {len(c.sizes)} sizes for a {ndim}-d tensor")
    try:
        offs = np.array([tuple(c.offsets) for c in chunks], np.int64).reshape(len(chunks), ndim)
        lens = np.array([tuple(c.sizes) for c in chunks], np.int64).reshape(len(chunks), ndim)
        dims = np.array(size, np.int64).reshape(ndim)
    except OverflowError:
        raise MetadataFormatError(f"{where}: a chunk offset or size does not fit in 64 bits") from None
    bad = (offs < 0) | (lens < 0) | (offs > dims) | (lens > dims - offs)
    if bad.any():
        j = int(np.flatnonzero(bad.any(axis=1))[0])
        raise MetadataFormatError(
            f"{where}.chunks[{j}]: offsets {tuple(chunks[j].offsets)} sizes {tuple(chunks[j].sizes)} do not lie "
            f"inside the tensor's size {size}")
    numel = math.prod(size)
    if numel >= _HUGE:  # exact, in Python ints (no tensor of 2^62 elements is ever loaded anyway)
        volume = sum(math.prod(c.sizes) for c in chunks)
    else:  # every box is inside, so every volume is at most numel < 2^62; the sum in Python ints
        volume = sum(np.prod(lens, axis=1).tolist())
    if volume != numel:
        raise MetadataFormatError(
            f"{where}.chunks: {len(chunks)} chunks hold {volume} elements, the tensor of size {size} has {numel}")
    nonempty = offs[lens.all(axis=1)] if ndim else offs[:min(len(chunks), 1)]
    if len(nonempty) > 1 and len(np.unique(nonempty, axis=0)) != len(nonempty):
        raise MetadataFormatError(f"{where}.chunks: two chunks at the same offsets")
    if len(nonempty) > 1:  # volumes that add up can still hide an overlap beside a hole: the export's exact check
        check_tiling(size, [(c.offsets, c.sizes) for c in chunks], At(where, ".chunks"))


def _numel(shape: tuple) -> int:
    n = math.prod(shape)
    return n if n < _HUGE else _HUGE


def _check_location(where: str, loc: Any, element_size: int | None = -1) -> None:
    """One location by the rule every reader of locations uses (:func:`s3dcp.format.layout.check_location`:
    non-negative numbers, a tensor's length its elements' bytes, bytes items bounded, block
    checksums covering the item), plus what only a whole-metadata check asks: ends below 2^63 and
    known checksum algorithms. ``element_size`` -1: the size of ``loc.dtype``'s elements."""
    check_item(loc, where, element_size)
    if loc.offset + loc.length >= _END:
        raise MetadataFormatError(f"{where}: bytes at offset {loc.offset}, length {loc.length} end past 2^63")
    if loc.checksum is not None:
        _algorithm(where, loc.checksum)
    for c in loc.block_checksums:
        _algorithm(where, c)


def _algorithm(where: str, checksum: str) -> None:
    try:
        algorithm_of(checksum)
    except ValueError as e:
        raise MetadataFormatError(f"{where}.checksum: {e}") from None


def _check_tensor_location(where: str, item: TensorStorageMetadata, chunk_sizes: tuple, loc: Any) -> None:
    dtype = dtype_to_str(item.properties.dtype)
    if loc.dtype != dtype:
        raise MetadataFormatError(f"{where}.dtype: {loc.dtype!r}, but the tensor is {dtype}")
    if loc.shape is None or tuple(loc.shape) != chunk_sizes:
        raise MetadataFormatError(f"{where}.shape: {loc.shape}, but the chunk's sizes are {chunk_sizes}")
    _check_location(where, loc, item.properties.dtype.itemsize)  # its length: the chunk's bytes


def _check_dict(sdm: dict, sd: Any) -> None:
    checked = set()  # the keys of state_dict_metadata's items: checked against their tensors
    for fqn, item in sdm.items():
        if isinstance(item, BytesStorageMetadata):
            key = MetadataIndex(fqn)
            if key not in sd:
                raise MetadataFormatError(f"storage_data: no location for the bytes item {quoted(fqn)}")
            _check_location(At("storage_data[", quoted(fqn), "]"), sd[key], None)
            checked.add(key)
            continue
        for c in item.chunks:
            key = MetadataIndex(fqn, c.offsets)
            loc = sd.get(key)
            where = At("storage_data[", quoted(fqn), " at ", tuple(c.offsets), "]")
            if loc is None:
                raise MetadataFormatError(f"{where}: no location for this chunk of state_dict_metadata")
            _check_tensor_location(where, item, tuple(c.sizes), loc)
            checked.add(key)
    for key, loc in sd.items():  # locations no item names: never read, but not trusted either
        if key not in checked:
            _check_location(At("storage_data[", quoted(key.fqn), " at ", None if key.offset is None else tuple(key.offset),
                               "]"), loc)


def _check_rows(sdm: dict, rows: Rows) -> None:
    """The same checks as :func:`_check_dict`, over the columns of a lazy version-2 ``storage_data``."""
    n = rows.n
    offset, length = rows.offset, rows.length
    for name, col in (("offset", offset), ("length", length)):
        if col.size and (col.dtype == object or int(col.min()) < 0 or int(col.max()) >= _END):
            if col.dtype != object:
                raise _first_row_error(rows, int(np.flatnonzero((col < 0) | (col >= _END))[0]), name)
            raise MetadataFormatError(f"storage_data: an item's {name} is negative or past 2^63")
    if n and float((offset.astype(np.float64) + length.astype(np.float64)).max()) >= float(_END) / 2:
        ends = [int(o) + int(x) for o, x in zip(offset.tolist(), length.tolist())]  # exact, only when near the edge
        if max(ends) >= _END:
            raise MetadataFormatError("storage_data: an item ends past 2^63")
    _check_row_checksums(rows)
    _check_row_blocks(rows)

    fqns, n_sdm = rows.fqns, len(rows.chunk_offsets)
    items = list(sdm.values())
    is_tensor = np.zeros(len(fqns), bool)
    is_tensor[:n_sdm] = [isinstance(v, TensorStorageMetadata) for v in items]
    keyed = ~rows.odd & is_tensor[rows.fqn]
    # Every chunk (first of its offsets) of every tensor has a row; decode already refused two rows for one.
    covered = np.zeros(int(rows.base[-1]), bool)
    k_rows = np.flatnonzero(keyed)
    gid = rows.base[rows.fqn[k_rows]] + rows.chunk[k_rows]
    covered[gid] = True
    for f in range(n_sdm):
        if not is_tensor[f]:
            continue
        lo, hi = int(rows.base[f]), int(rows.base[f + 1])
        need = covered[lo:hi] if rows.first[f] is None else covered[lo:hi] | ~rows.first[f]
        if not need.all():
            j = int(np.flatnonzero(~need)[0])
            raise MetadataFormatError(
                f"storage_data[{quoted(fqns[f])} at {tuple(rows.chunk_offsets[f][j])}]: no location for this chunk of "
                "state_dict_metadata")
    bytes_with_rows = {int(rows.fqn[r]) for r, o in rows.odd_keys.items() if o is None}
    for f in range(n_sdm):
        if not is_tensor[f] and f not in bytes_with_rows:
            raise MetadataFormatError(f"storage_data: no location for the bytes item {quoted(fqns[f])}")

    # dtype, shape and length of the rows of tensor chunks.
    dtype_ids = {name: i for i, name in enumerate(rows.dtypes)}
    want_dtype = np.full(len(fqns), -1, np.int64)
    itemsize = np.zeros(len(fqns), np.int64)
    numel_of: dict[int, np.ndarray] = {}
    numels = []
    for f in range(n_sdm):
        shapes = rows.chunk_shapes[f]
        if not is_tensor[f]:
            numels.append(np.zeros(0, np.int64))
            continue
        dtype = items[f].properties.dtype
        want_dtype[f] = dtype_ids.get(dtype_to_str(dtype), -1)
        itemsize[f] = dtype.itemsize
        arr = numel_of.get(id(shapes))
        if arr is None:  # once per layout: its tensors share the list
            arr = numel_of[id(shapes)] = np.array([_numel(s) for s in shapes], np.int64)
        numels.append(arr)
    numel = np.concatenate(numels + [np.zeros(0, np.int64)])
    r = k_rows
    f_r = rows.fqn[r]
    bad = np.flatnonzero(rows.dtype[r] != want_dtype[f_r])
    if bad.size:
        raise _row_error(rows, sdm, int(r[bad[0]]), "dtype")
    bad = np.flatnonzero(rows.shape_kind[r] != 0)  # 0: the chunk's own sizes; anything else differs from them
    if bad.size:
        raise _row_error(rows, sdm, int(r[bad[0]]), "shape")
    expected = itemsize[f_r] * numel[gid]  # < 2^62 x 16 would wrap: _HUGE caps numel, itemsize <= 16
    bad = np.flatnonzero((length[r].astype(np.int64) != expected) | (numel[gid] >= _HUGE))
    if bad.size:
        raise _row_error(rows, sdm, int(r[bad[0]]), "length")


def _row_error(rows: Rows, sdm: dict, row: int, field: str) -> MetadataFormatError:
    """The message of :func:`_check_tensor_location` for one row (built only for the row that failed)."""
    key, loc = rows.key(row), rows.location(row)
    f = int(rows.fqn[row])
    where = f"storage_data[{quoted(key.fqn)} at {tuple(key.offset)}]"
    try:
        _check_tensor_location(where, sdm[key.fqn], tuple(rows.chunk_shapes[f][rows.chunk[row]]), loc)
    except MetadataFormatError as e:
        return e
    return MetadataFormatError(f"{where}.{field}: does not match the chunk")


def _first_row_error(rows: Rows, row: int, field: str) -> MetadataFormatError:
    """The per-item rule's message for the row the vectorised check found first."""
    key, loc = rows.key(row), rows.location(row)
    where = f"storage_data[{quoted(key.fqn)} at {None if key.offset is None else tuple(key.offset)}]"
    try:
        _check_location(where, loc)
    except MetadataFormatError as e:
        return e
    return MetadataFormatError(f"{where}.{field}: not a valid {field}")


def _check_row_checksums(rows: Rows) -> None:
    for name, sums in (("checksum", rows.checksum), ("block_checksums", rows.block_checksums)):
        if sums.fmt is not None:
            _algorithm(f"storage_data.{name}", sums.fmt.split(":", 1)[0] + ":")
        else:
            for s in sums.table[1:]:
                _algorithm(f"storage_data.{name}", s)


def _check_row_blocks(rows: Rows) -> None:
    size = rows.block_size
    if size.size and (size.dtype == object or int(size.min()) < 0):
        if size.dtype != object:
            raise _first_row_error(rows, int(np.flatnonzero(size < 0)[0]), "block_size")
        raise MetadataFormatError("storage_data: an item's block_size is negative")
    blocks = np.diff(rows.block_start)
    has = np.flatnonzero(blocks)
    if not has.size:
        return
    b = size[has].astype(np.int64)
    length = rows.length[has].astype(np.int64)
    bad = (b <= 0) | (blocks[has] != -(-length // np.maximum(b, 1)))
    if bad.any():
        raise _first_row_error(rows, int(has[np.flatnonzero(bad)[0]]), "block_size")
