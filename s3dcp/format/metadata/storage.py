"""``storage_data`` of a version-2 metadata object as DCP sees it: MetadataIndex -> ItemLocation.

The rows themselves are read and checked without torch (:class:`~s3dcp.format.metadata.rows.Rows`);
this module builds DCP's keys from them: all at once for a full decode's dict, or one at a time
through :class:`LazyStorageData`, a mapping that builds each location when it is looked up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Iterator

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..layout import ItemLocation
from .rows import Rows

__all__ = ["LazyStorageData"]


def _index_fast(fqn: str, offset: torch.Size | None, index: int | None) -> MetadataIndex:
    """``MetadataIndex(fqn, offset, index)`` for an ``offset`` that is already a torch.Size (or None).

    The constructor copies the Size, which costs several microseconds: over half of a million-item
    full decode. This sets the same attributes the constructor sets, the way pickle rebuilds one.
    """
    key = object.__new__(MetadataIndex)
    object.__setattr__(key, "fqn", fqn)
    object.__setattr__(key, "index", index)
    if offset is not None:
        object.__setattr__(key, "offset", offset)
    return key


# Only while MetadataIndex is the dataclass we know; a torch that changes it gets the constructor.
_new_index = _index_fast if [f.name for f in dataclasses.fields(MetadataIndex)] == ["fqn", "offset", "index"] \
    else MetadataIndex


class LazyStorageData(Mapping):
    """``Metadata.storage_data`` of a v2 checkpoint: a read-only mapping MetadataIndex -> ItemLocation
    that builds each location when it is looked up.

    It behaves as the dict a full decode gives: same keys in the same order, ``len``, ``in``,
    ``get``, iteration, ``==`` with a dict. Lookups build a row index on first use (vectorised,
    ~tens of ms at a million items); a location is built once and kept. Pickling or deep-copying
    it gives a plain dict, so nothing outside s3dcp ever has to know this class.
    """

    def __init__(self, rows: Rows, chunk_offsets: list, odd_keys: dict) -> None:
        self._rows = rows
        self._offsets = chunk_offsets, odd_keys  # torch.Size offsets for the keys (see dcp_keys)
        self._cache: dict[int, ItemLocation] = {}

    def __len__(self) -> int:
        return self._rows.n

    def __iter__(self) -> Iterator[MetadataIndex]:
        key, (offsets, odd) = self._rows.key, self._offsets
        return (key(i, _new_index, offsets, odd) for i in range(self._rows.n))

    def _row_of(self, key: object) -> int:
        return self._rows.row_of(key.fqn, key.offset, key.index) if type(key) is MetadataIndex else -1

    def __contains__(self, key: object) -> bool:
        return self._row_of(key) >= 0

    def __getitem__(self, key: MetadataIndex) -> ItemLocation:
        row = self._row_of(key)
        if row < 0:
            raise KeyError(key)
        loc = self._cache.get(row)
        if loc is None:
            loc = self._cache[row] = self._rows.location(row)
        return loc

    def items(self):
        """All (key, location) pairs, built in one vectorised pass (a dict's items view)."""
        return self.to_dict().items()

    def values(self):
        """All locations, built in one vectorised pass (a list, in key order)."""
        return self._rows.locations()

    def to_dict(self) -> dict[MetadataIndex, ItemLocation]:
        """Every (key, location) in a plain dict, built in one vectorised pass (what ``lazy=False`` gives)."""
        return dict(zip(self._rows.keys(_new_index, *self._offsets), self._rows.locations()))

    def object_names(self) -> set[str]:
        """The names of the objects the items live in, without building any location (for gc and rm)."""
        return {self._rows.names[i] for i in np.unique(self._rows.obj).tolist()}

    def object_extents(self) -> dict[str, int]:
        """Per object name, where its last item ends (what :func:`s3dcp.format.layout.object_sizes`
        gives for the values), without building any location."""
        rows = self._rows
        ends = np.zeros(len(rows.names), np.int64)
        # int64 before adding: the columns are as narrow as their values (u2 offsets + u2 lengths wrap)
        np.maximum.at(ends, rows.obj, rows.offset.astype(np.int64) + rows.length.astype(np.int64))
        return {rows.names[i]: int(ends[i]) for i in np.unique(rows.obj).tolist()}

    def __reduce__(self):
        return (dict, (self.to_dict(),))

    def __repr__(self) -> str:
        return f"<LazyStorageData: {self._rows.n} items>"
