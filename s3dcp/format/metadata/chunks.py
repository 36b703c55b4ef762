"""``state_dict_metadata`` of a version-2 metadata object, built in full from the chunk-layout columns.

:class:`Chunks` reads the ``sdm.*`` and ``layout.*`` columns (see :mod:`s3dcp.format.metadata.v2`)
and builds every entry as plain values (:class:`~s3dcp.format.metadata.plain.PlainTensor`: property
names, a size tuple, a shared :class:`~s3dcp.format.metadata.plain.ChunkLayout`), and keeps each
fqn's chunk offsets and sizes for the storage keys (:mod:`s3dcp.format.metadata.rows`) that refer
to chunks by position.

What it builds, and what the DCP side (:mod:`s3dcp.format.metadata.dcp`) builds from it, is
charged to the decode's budget (:mod:`s3dcp.format.metadata.budget`) before it is built: a chunk
box of a layout costs an object, a tensor's chunk list a slot per chunk (the tensors of one
layout share the layout's ChunkStorageMetadata objects, as they share its size values). A layout of 0-d chunks stores no numbers, so its count is paid for by nothing
in the object but the budget; nor are there more layouts than tensors that could use them.
"""

from __future__ import annotations

import numpy as np

from ...errors import MetadataFormatError
from ..context import At, quoted
from .budget import DecodeBudget
from .columns import MAX_COUNT, ColumnReader, bounded
from .fields import _bool, _dict, _get, _ints, _list
from .names import check_name
from .plain import ChunkLayout, PlainBytes, PlainTensor, Properties

__all__ = ["Chunks"]


class _Sizes:
    """Interns tuples: ~920k chunk boxes hold a few thousand distinct ones."""

    def __init__(self) -> None:
        self._sizes: dict[tuple, tuple] = {}

    def rows(self, flat: np.ndarray, count: int, ndim: int) -> list[tuple]:
        if ndim == 0:  # nothing stored; one shared value (reshape(count, 0).tolist() builds count lists)
            return [()] * count
        cache = self._sizes
        return [cache.setdefault(t, t) for t in map(tuple, flat.reshape(count, ndim).tolist())]


class Chunks:
    """state_dict_metadata of a v2 object as plain entries, and each fqn's chunk boxes for storage keys."""

    def __init__(self, header: dict, cols: ColumnReader, fqns: list[str], budget: DecodeBudget) -> None:
        n = len(fqns)
        table = []
        for i, p in enumerate(_get(header, "properties", "metadata", _list)):
            w = f"metadata.properties[{i}]"
            if type(p) is not list or len(p) != 5:
                raise MetadataFormatError(f"{w}: expected [dtype, layout, requires_grad, memory_format, pin_memory]")
            table.append(Properties(check_name("dtype", p[0]), check_name("layout", p[1]), _bool(p[2], w),
                                    check_name("memory_format", p[3]), _bool(p[4], w)))
        c = lambda name: f"metadata.columns[{name!r}]"  # noqa: E731
        props = bounded(cols.ints("sdm.properties", n), len(table) + 1, c("sdm.properties"))
        n_layouts = cols.count("layout.ndim")
        if n_layouts > n:  # every layout is some tensor's
            raise MetadataFormatError(f"{c('layout.ndim')}: {n_layouts} chunk layouts for {n} state_dict entries")
        lay_ndim = bounded(cols.ints("layout.ndim", n_layouts), MAX_COUNT, c("layout.ndim")).tolist()
        lay_count = bounded(cols.ints("layout.count", n_layouts), MAX_COUNT, c("layout.count")).tolist()
        layout = bounded(cols.ints("sdm.layout", n), n_layouts + 1, c("sdm.layout")).tolist()
        # What the chunk lists will hold, charged before any is built: the layouts' boxes (0-d
        # ones are one shared box), then a list slot per chunk of every tensor.
        budget.objects(c("layout.count"), sum(k if d else 1 for d, k in zip(lay_ndim, lay_count)), "chunk boxes")
        budget.objects(c("layout.count"), sum(lay_count), "chunks", 4)  # offsets, sizes, shapes, chunks lists
        budget.objects(c("sdm.layout"), sum(lay_count[k - 1] for k in layout if k), "chunks of tensors", 1)
        total = sum(a * b for a, b in zip(lay_ndim, lay_count))
        lay_offs, lay_sizes = cols.ints("layout.offsets", total), cols.ints("layout.sizes", total)
        size_len, size_start, size_vals = cols.ragged("sdm.size", n)
        odd = _get(header, "odd_chunks", "metadata", _dict)

        sizes = _Sizes()
        layouts: list[ChunkLayout] = []
        start = 0
        for ndim, count in zip(lay_ndim, lay_count):
            o = sizes.rows(lay_offs[start:start + ndim * count], count, ndim)
            s = sizes.rows(lay_sizes[start:start + ndim * count], count, ndim)
            layouts.append(ChunkLayout(o, s, ndim == 0))
            start += ndim * count

        self.offsets: list[list | None] = []  # per fqn: chunk offsets (None: bytes item)
        self.shapes: list[list | None] = []   # per fqn: chunk sizes as tuples
        self.first: list[np.ndarray | None] = []  # per fqn: see _first_flags (None: offsets all differ)
        self.state_dict: dict[str, PlainTensor | PlainBytes] = {}
        bytes_item = PlainBytes()
        props_l, size_l, start_l = props.tolist(), size_len.tolist(), size_start.tolist()
        for pos, fqn in enumerate(fqns):
            w = At("state_dict_metadata[", quoted(fqn), "]")
            if props_l[pos] == 0:
                if layout[pos] or size_l[pos]:
                    raise MetadataFormatError(f"{w}: a bytes item with a size or chunks")
                self.state_dict[fqn] = bytes_item
                self._add(None, None, None)
                continue
            size = tuple(size_vals[start_l[pos]:start_l[pos] + size_l[pos]].tolist())
            lay = layouts[layout[pos] - 1] if layout[pos] else self._odd(odd, pos, w)
            self.state_dict[fqn] = PlainTensor(table[props_l[pos] - 1], size, lay)
            self._add(lay.offsets, lay.sizes, lay.first)
        unknown = set(odd) - {str(p) for p in range(n) if layout[p] == 0 and props_l[p]}
        if unknown:
            raise MetadataFormatError(f"metadata.odd_chunks: entries {sorted(unknown)[:5]} belong to no tensor")

    @property
    def has_dups(self) -> list[bool]:
        """Per fqn: two chunks with equal offsets (never from DCP)."""
        return [f is not None for f in self.first]

    def _add(self, offsets: list | None, shapes: list | None, first: np.ndarray | None) -> None:
        self.offsets.append(offsets)
        self.shapes.append(shapes)
        self.first.append(first)

    @staticmethod
    def _odd(odd: dict, pos: int, where: str) -> ChunkLayout:
        boxes = odd.get(str(pos))
        if type(boxes) is not list:
            raise MetadataFormatError(f"metadata.odd_chunks: missing the chunks of {where}")
        o, s = [], []
        for j, box in enumerate(boxes):
            if type(box) is not list or len(box) != 2:
                raise MetadataFormatError(f"{where}.chunks[{j}]: expected [offsets, sizes]")
            o.append(_ints(box[0], At(where, ".chunks[", j, "].offsets")))
            s.append(_ints(box[1], At(where, ".chunks[", j, "].sizes")))
        return ChunkLayout(o, s)
