"""``storage_data`` of a version-2 metadata object: the validated columns, without torch.

:class:`Rows` checks the storage columns once (bounds, chunk references, no duplicate keys) and
then builds keys and ItemLocation values from them, one row at a time or all rows at once,
vectorised. Keys are plain :class:`~s3dcp.format.metadata.plain.StorageKey` tuples unless the
caller passes its own constructor and offsets: the DCP side
(:class:`s3dcp.format.metadata.storage.LazyStorageData`, a full decode's dict) builds DCP's
MetadataIndex keys with torch.Size offsets the same way. Both paths build the same values; the
tests compare them row by row.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ...errors import MetadataFormatError
from ..context import At, quoted
from ..layout import ItemLocation
from .budget import DecodeBudget
from .columns import MAX_COUNT, ColumnReader, bounded
from .fields import _dict, _get, _int, _list, _str
from .plain import StorageKey

__all__ = ["Rows"]


_MIN_ROW_BYTES = 15  # a row has a value in each of 15 columns (sd.fqn ... sd.checksum), each at least a byte


class Rows:
    """The storage_data columns of a v2 object, validated; builds keys and locations on request."""

    def __init__(self, node: Any, cols: ColumnReader, fqns: list[str], chunks: Any, budget: DecodeBudget) -> None:
        w = "metadata.storage_data"
        n = self.n = _get(node, "rows", w, _int)
        if n < 0:
            raise MetadataFormatError(f"{w}.rows: {n} is negative")
        budget.fits(f"{w}.rows", n, _MIN_ROW_BYTES, "storage items")
        self.fqns = fqns
        self.names = [_str(s, At(w, ".object_names[", i, "]")) for i, s in enumerate(_get(node, "object_names", w, _list))]
        self.dtypes = [None] + [_str(s, At(w, ".dtypes[", i, "]")) for i, s in enumerate(_get(node, "dtypes", w, _list))]
        budget.names(At(w, ".object_names"), self.names, "object names")
        budget.names(At(w, ".dtypes"), self.dtypes[1:], "dtype names")
        c = lambda name: f"metadata.columns[{name!r}]"  # noqa: E731
        n_sdm = len(chunks.offsets)
        self.chunk_offsets, self.chunk_shapes, self.has_dups = chunks.offsets, chunks.shapes, chunks.has_dups
        self.first = chunks.first
        self.fqn = bounded(cols.ints("sd.fqn", n), len(fqns), c("sd.fqn"))
        self.chunk = bounded(cols.ints("sd.chunk", n), MAX_COUNT, c("sd.chunk"))
        odd = bounded(cols.ints("sd.chunk.null", n), 2, c("sd.chunk.null")).astype(bool)
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
        budget.objects(c("sd.chunk.null"), len(odd_rows), "storage keys of their own")
        key_null = bounded(cols.ints("sd.key.null", len(odd_rows)), 2, c("sd.key.null")).tolist()
        key_len, key_start, key_vals = cols.ragged("sd.key", len(odd_rows))
        self.odd_keys: dict[int, tuple | None] = {}
        for k, row in enumerate(odd_rows):
            self.odd_keys[row] = None if key_null[k] else tuple(key_vals[key_start[k]:key_start[k + 1]].tolist())
        index_null = bounded(cols.ints("sd.index.null", n), 2, c("sd.index.null")).astype(bool)
        self.index = cols.ints("sd.index", n)
        self.index_null = index_null if index_null.any() else None
        self.obj = bounded(cols.ints("sd.object", n), len(self.names), c("sd.object"))
        self.offset, self.length = cols.ints("sd.offset", n), cols.ints("sd.length", n)
        self.dtype = bounded(cols.ints("sd.dtype", n), len(self.dtypes), c("sd.dtype"))
        kind = bounded(cols.ints("sd.shape.kind", n), 3, c("sd.shape.kind"))
        if (odd & (kind == 0)).any():
            raise MetadataFormatError(f"{c('sd.shape.kind')}: a row without a chunk says its shape is the chunk's")
        self.shape_kind = kind
        explicit = np.flatnonzero(kind == 2)
        budget.objects(c("sd.shape.kind"), len(explicit), "shapes of their own")
        shape_len, shape_start, shape_vals = cols.ragged("sd.shape", len(explicit))
        self.shapes = {row: tuple(shape_vals[shape_start[k]:shape_start[k + 1]].tolist())
                       for k, row in enumerate(explicit.tolist())}
        self.block_size = cols.ints("sd.block_size", n)
        blocks = bounded(cols.ints("sd.blocks", n), MAX_COUNT, c("sd.blocks"))
        self.block_start = np.zeros(n + 1, np.int64)
        np.cumsum(blocks, out=self.block_start[1:])
        self.checksum = _Checksums(node, "checksum", cols, "sd.checksum", n)
        self.block_checksums = _Checksums(node, "block_checksum", cols, "sd.block_checksum", int(self.block_start[-1]))
        if self.block_checksums.has_null():
            raise MetadataFormatError(f"{c('sd.block_checksum')}: a block without a checksum")
        self._index: dict[int, dict] = {}  # per fqn: {offsets: first chunk position}, built on first use
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
                    f"metadata.storage_data: two entries for {quoted(self.fqns[f])} at offset {offset} (duplicate key)")
            seen.add(key)
        # A chunk row must name the first chunk with its offsets, or two rows could hold one key.
        if any(f is not None for f in self.first):
            n_sdm = len(self.first)
            first = np.concatenate([np.ones(0 if o is None else len(o), bool) if f is None else f
                                    for f, o in zip(self.first, self.chunk_offsets)] + [np.ones(0, bool)])
            keyed = np.flatnonzero(~self.odd)
            keyed = keyed[self.fqn[keyed] < n_sdm]
            bad = keyed[~first[self.base[self.fqn[keyed]] + self.chunk[keyed]]]
            if bad.size:
                f, j = int(self.fqn[bad[0]]), int(self.chunk[bad[0]])
                raise MetadataFormatError(
                    f"metadata.storage_data: two entries for {quoted(self.fqns[f])} at offset {tuple(self.chunk_offsets[f][j])}")

    def _first_chunk(self, f: int, offset: Any) -> int | None:
        offsets = self.chunk_offsets[f] if f < len(self.chunk_offsets) else None
        if offsets is None or offset is None:
            return None
        table = self._index.get(f)
        if table is None:  # built whole, then published: a lookup from another thread never sees half of it
            table = {}
            for j, o in enumerate(offsets):
                table.setdefault(o, j)
            self._index[f] = table
        return table.get(offset)

    # -- one row, for LazyStorageData
    def row_of(self, fqn: Any, offset: Any, hint: Any = None) -> int:
        """Row of the key ``fqn``/``offset`` (a sequence of ints, or None), or -1. Tries ``hint``
        (the key's index) as the chunk position first, as DCP's own lookups do: the load planner
        sets it to the chunk's position."""
        if self._fqn_ids is None:
            self._build_lookup()
        f = self._fqn_ids.get(fqn)
        if f is None:
            return -1
        offsets = self.chunk_offsets[f] if f < len(self.chunk_offsets) else None
        j = None
        if offsets is not None and offset is not None:
            if type(hint) is int and 0 <= hint < len(offsets) and offsets[hint] == offset and not self.has_dups[f]:
                j = hint
            else:
                j = self._first_chunk(f, tuple(offset))
        if j is not None:
            row = int(self._row_by_chunk[self.base[f] + j])
            if row >= 0:
                return row
        return self._odd_rows.get((f, None if offset is None else tuple(offset)), -1)

    _fqn_ids: dict | None = None

    def _build_lookup(self) -> None:
        by_chunk = np.full(int(self.base[-1]), -1, np.int64)
        keyed = np.flatnonzero(~self.odd)
        by_chunk[self.base[self.fqn[keyed]] + self.chunk[keyed]] = keyed
        self._row_by_chunk = by_chunk
        self._odd_rows = {(int(self.fqn[r]), None if o is None else tuple(o)): r for r, o in self.odd_keys.items()}
        self._fqn_ids = {f: i for i, f in enumerate(self.fqns)}  # last: row_of() tests it to know the rest is there

    def key(self, i: int, make: Callable = StorageKey, chunk_offsets: list | None = None,
            odd_keys: dict | None = None) -> Any:
        """Row ``i``'s key: ``make(fqn, offset, index)``, with offsets from ``chunk_offsets`` (per
        fqn, per chunk) and ``odd_keys`` (per row) when given, else the plain tuples."""
        f = int(self.fqn[i])
        if self.odd[i]:
            offset = (self.odd_keys if odd_keys is None else odd_keys)[i]
        else:
            offset = (self.chunk_offsets if chunk_offsets is None else chunk_offsets)[f][self.chunk[i]]
        index = None if self.index_null is not None and self.index_null[i] else int(self.index[i])
        return make(self.fqns[f], offset, index)

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
    def keys(self, make: Callable = StorageKey, chunk_offsets: list | None = None,
             odd_keys: dict | None = None) -> list:
        """Every row's key, in order; the arguments as for :meth:`key`."""
        fqn = self.fqn.tolist()
        names = list(map(self.fqns.__getitem__, fqn))
        offs = self.chunk_offsets if chunk_offsets is None else chunk_offsets
        offsets = [None if z else offs[f][j] for f, j, z in zip(fqn, self.chunk.tolist(), self.odd.tolist())]
        for row, o in (self.odd_keys if odd_keys is None else odd_keys).items():
            offsets[row] = o
        index = self.index.tolist()
        if self.index_null is not None:
            index = [None if z else v for v, z in zip(index, self.index_null.tolist())]
        return list(map(make, names, offsets, index))

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

    def items(self):
        """(plain key, location) of every row, in order."""
        return zip(self.keys(), self.locations())


class _Checksums:
    """A checksum column: raw integers printed as ``alg:hex``, or indexes into a string table."""

    def __init__(self, node: Any, field: str, cols: ColumnReader, name: str, n: int) -> None:
        spec = _get(node, field, "metadata.storage_data", _dict)
        where = f"metadata.storage_data.{field}"
        self.values = cols.ints(name, n)
        if "strings" in spec:
            self.table = [None] + [_str(s, At(where, ".strings[", i, "]")) for i, s in enumerate(_list(spec["strings"], where))]
            bounded(self.values, len(self.table), f"metadata.columns[{name!r}]")
            self.values = self.values.astype(np.int64, copy=False)
            self.fmt = None
            self.null = None
            return
        alg = _get(spec, "algorithm", where, _str)
        digits = _get(spec, "hex_digits", where, _int)
        if not 0 < digits <= 16:
            raise MetadataFormatError(f"{where}.hex_digits: {digits} is not in 1..16")
        if self.values.size and (self.values.dtype == object or int(self.values.max()) >= 16**digits):
            raise MetadataFormatError(f"metadata.columns[{name!r}]: a checksum wider than {digits} hex digits")
        self.fmt = f"{alg}:%0{digits}x"
        null = bounded(cols.ints(name + ".null", n), 2, f"metadata.columns[{name + '.null'!r}]")
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
