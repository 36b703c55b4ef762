"""``storage_data`` of a version-2 metadata object as DCP sees it: the lazy mapping over the rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator

import numpy as np
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..layout import ItemLocation
from .rows import Rows

__all__ = ["LazyStorageData", "Rows"]


class LazyStorageData(Mapping):
    """``Metadata.storage_data`` of a v2 checkpoint: a read-only mapping MetadataIndex -> ItemLocation
    that builds each location when it is looked up.

    It behaves as the dict a full decode gives: same keys in the same order, ``len``, ``in``,
    ``get``, iteration, ``==`` with a dict. Lookups build a row index on first use (vectorised,
    ~tens of ms at a million items); a location is built once and kept. Pickling or deep-copying
    it gives a plain dict, so nothing outside s3dcp ever has to know this class.
    """

    def __init__(self, rows: Rows) -> None:
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

    def items(self):
        """All (key, location) pairs, built in one vectorised pass (a dict's items view)."""
        return self._rows.to_dict().items()

    def values(self):
        """All locations, built in one vectorised pass (a list, in key order)."""
        return self._rows.locations()

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
        return (dict, (self._rows.to_dict(),))

    def __repr__(self) -> str:
        return f"<LazyStorageData: {self._rows.n} items>"
