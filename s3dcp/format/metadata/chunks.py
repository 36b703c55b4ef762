"""``state_dict_metadata`` of a version-2 metadata object, built in full from the chunk-layout columns.

:class:`Chunks` reads the ``sdm.*`` and ``layout.*`` columns (see :mod:`s3dcp.format.metadata.v2`)
and builds every TensorStorageMetadata, and keeps each fqn's chunk offsets and sizes for the
storage keys (:mod:`s3dcp.format.metadata.storage`) that refer to chunks by position.
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
from .columns import MAX_COUNT, ColumnReader, bounded
from .common import _DTYPES, _LAYOUTS, _MEMORY_FORMATS, _bool, _dict, _from_name, _get, _list, _size

__all__ = ["Chunks"]


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


class Chunks:
    """state_dict_metadata of a v2 object, built in full, and each fqn's chunk boxes for storage keys."""

    def __init__(self, header: dict, cols: ColumnReader, fqns: list[str]) -> None:
        n = len(fqns)
        table = []
        for i, p in enumerate(_get(header, "properties", "metadata", _list)):
            w = f"metadata.properties[{i}]"
            if type(p) is not list or len(p) != 5:
                raise MetadataFormatError(f"{w}: expected [dtype, layout, requires_grad, memory_format, pin_memory]")
            table.append((_from_name(_DTYPES, p[0], "dtype"), _from_name(_LAYOUTS, p[1], "layout"),
                          _bool(p[2], w), _from_name(_MEMORY_FORMATS, p[3], "memory_format"), _bool(p[4], w)))
        props = bounded(cols.ints("sdm.properties", n), len(table) + 1, "metadata.columns['sdm.properties']")
        lay_ndim = cols.ints("layout.ndim")
        n_layouts = len(lay_ndim)
        lay_ndim = bounded(lay_ndim, MAX_COUNT, "metadata.columns['layout.ndim']")
        lay_count = bounded(cols.ints("layout.count", n_layouts), MAX_COUNT, "metadata.columns['layout.count']")
        total = sum(a * b for a, b in zip(lay_ndim.tolist(), lay_count.tolist()))
        lay_offs, lay_sizes = cols.ints("layout.offsets", total), cols.ints("layout.sizes", total)
        layout = bounded(cols.ints("sdm.layout", n), n_layouts + 1, "metadata.columns['sdm.layout']")
        size_len, size_start, size_vals = cols.ragged("sdm.size", n)
        odd = _get(header, "odd_chunks", "metadata", _dict)

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
                self._add(None, None, False)
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
            self._add(o, t, dups)
        unknown = set(odd) - {str(p) for p in range(n) if layout_l[p] == 0 and props_l[p]}
        if unknown:
            raise MetadataFormatError(f"metadata.odd_chunks: entries {sorted(unknown)[:5]} belong to no tensor")

    def _add(self, offsets: list | None, shapes: list | None, has_dups: bool) -> None:
        self.offsets.append(offsets)
        self.shapes.append(shapes)
        self.has_dups.append(has_dups)

    @staticmethod
    def _odd(odd: dict, pos: int, where: str, sizes: _Sizes) -> tuple[list, list]:
        boxes = odd.get(str(pos))
        if type(boxes) is not list:
            raise MetadataFormatError(f"metadata.odd_chunks: missing the chunks of {where}")
        o, s = [], []
        for j, box in enumerate(boxes):
            if type(box) is not list or len(box) != 2:
                raise MetadataFormatError(f"{where}.chunks[{j}]: expected [offsets, sizes]")
            o.append(_size(box[0], f"{where}.chunks[{j}].offsets"))
            s.append(_size(box[1], f"{where}.chunks[{j}].sizes"))
        return o, s
