"""``state_dict_metadata`` of a version-2 metadata object, built in full from the chunk-layout columns.

:class:`Chunks` reads the ``sdm.*`` and ``layout.*`` columns (see :mod:`s3dcp.format.metadata.v2`)
and builds every TensorStorageMetadata, and keeps each fqn's chunk offsets and sizes for the
storage keys (:mod:`s3dcp.format.metadata.storage`) that refer to chunks by position.

What it builds is charged to the decode's budget (:mod:`s3dcp.format.metadata.budget`) before it
is built: a chunk box of a layout costs an object, a tensor's chunk list a slot per chunk (the
tensors of one layout share the layout's ChunkStorageMetadata objects, as they share its
torch.Size values). A layout of 0-d chunks stores no numbers, so its count is paid for by nothing
in the object but the budget; nor are there more layouts than tensors that could use them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ...errors import MetadataFormatError
from .budget import DecodeBudget
from .columns import MAX_COUNT, ColumnReader, bounded
from .common import _DTYPES, _LAYOUTS, _MEMORY_FORMATS, _from_name, _size
from .fields import _bool, _dict, _get, _list

__all__ = ["Chunks"]


class _Sizes:
    """Interns torch.Size and tuple values: ~920k chunk boxes hold a few thousand distinct ones."""

    def __init__(self) -> None:
        self._sizes: dict[tuple, torch.Size] = {}

    def rows(self, flat: np.ndarray, count: int, ndim: int) -> list[torch.Size]:
        if ndim == 0:  # nothing stored; one shared value (reshape(count, 0).tolist() builds count lists)
            return [self._sizes.setdefault((), torch.Size())] * count
        cache, out = self._sizes, []
        for t in map(tuple, flat.reshape(count, ndim).tolist()):
            s = cache.get(t)
            if s is None:
                s = cache[t] = torch.Size(t)
            out.append(s)
        return out


class _Layout:
    """One chunk layout: its boxes, built once and shared by every tensor that uses it."""

    __slots__ = ("offsets", "shapes", "chunks", "first")

    def __init__(self, offsets: list, sizes: list, zero_d: bool = False) -> None:
        self.offsets = offsets
        if zero_d and offsets:  # every box is the same empty one: share it
            self.shapes = [()] * len(offsets)
            self.chunks = [ChunkStorageMetadata(offsets[0], sizes[0])] * len(offsets)
            self.first = np.arange(len(offsets)) == 0 if len(offsets) > 1 else None
        else:
            self.shapes = [tuple(x) for x in sizes]
            self.chunks = list(map(ChunkStorageMetadata, offsets, sizes))
            self.first = _first_flags(offsets)


def _first_flags(offsets: list) -> np.ndarray | None:
    """None when all offsets differ (always, from DCP); else, per chunk, whether no earlier chunk has its offsets."""
    if len(set(offsets)) == len(offsets):
        return None
    seen: set = set()
    flags = np.zeros(len(offsets), bool)
    for j, o in enumerate(offsets):
        if o not in seen:
            seen.add(o)
            flags[j] = True
    return flags


class Chunks:
    """state_dict_metadata of a v2 object, built in full, and each fqn's chunk boxes for storage keys."""

    def __init__(self, header: dict, cols: ColumnReader, fqns: list[str], budget: DecodeBudget) -> None:
        n = len(fqns)
        table = []
        for i, p in enumerate(_get(header, "properties", "metadata", _list)):
            w = f"metadata.properties[{i}]"
            if type(p) is not list or len(p) != 5:
                raise MetadataFormatError(f"{w}: expected [dtype, layout, requires_grad, memory_format, pin_memory]")
            table.append((_from_name(_DTYPES, p[0], "dtype"), _from_name(_LAYOUTS, p[1], "layout"),
                          _bool(p[2], w), _from_name(_MEMORY_FORMATS, p[3], "memory_format"), _bool(p[4], w)))
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
        layouts: list[_Layout] = []
        start = 0
        for ndim, count in zip(lay_ndim, lay_count):
            o = sizes.rows(lay_offs[start:start + ndim * count], count, ndim)
            s = sizes.rows(lay_sizes[start:start + ndim * count], count, ndim)
            layouts.append(_Layout(o, s, ndim == 0))
            start += ndim * count

        self.offsets: list[list | None] = []  # per fqn: chunk offsets (None: bytes item)
        self.shapes: list[list | None] = []   # per fqn: chunk sizes as tuples
        self.first: list[np.ndarray | None] = []  # per fqn: see _first_flags (None: offsets all differ)
        self.state_dict_metadata: dict[str, Any] = {}
        props_l, size_l, start_l = props.tolist(), size_len.tolist(), size_start.tolist()
        for pos, fqn in enumerate(fqns):
            w = f"state_dict_metadata[{fqn!r}]"
            if props_l[pos] == 0:
                if layout[pos] or size_l[pos]:
                    raise MetadataFormatError(f"{w}: a bytes item with a size or chunks")
                self.state_dict_metadata[fqn] = BytesStorageMetadata()
                self._add(None, None, None)
                continue
            size = torch.Size(size_vals[start_l[pos]:start_l[pos] + size_l[pos]].tolist())
            lay = layouts[layout[pos] - 1] if layout[pos] else self._odd(odd, pos, w, sizes)
            dtype, kind, grad, mf, pin = table[props_l[pos] - 1]
            self.state_dict_metadata[fqn] = TensorStorageMetadata(
                TensorProperties(dtype, kind, grad, mf, pin), size, list(lay.chunks))
            self._add(lay.offsets, lay.shapes, lay.first)
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
    def _odd(odd: dict, pos: int, where: str, sizes: _Sizes) -> _Layout:
        boxes = odd.get(str(pos))
        if type(boxes) is not list:
            raise MetadataFormatError(f"metadata.odd_chunks: missing the chunks of {where}")
        o, s = [], []
        for j, box in enumerate(boxes):
            if type(box) is not list or len(box) != 2:
                raise MetadataFormatError(f"{where}.chunks[{j}]: expected [offsets, sizes]")
            o.append(_size(box[0], f"{where}.chunks[{j}].offsets"))
            s.append(_size(box[1], f"{where}.chunks[{j}].sizes"))
        return _Layout(o, s)
