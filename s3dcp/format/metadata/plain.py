"""What a metadata object says, as plain values: the torch-free result of every decode.

:func:`s3dcp.format.metadata.decode_plain` gives a :class:`PlainMetadata` for either format
version; every structural check and every bound (:mod:`s3dcp.format.metadata.budget`) is done
while it is built, so what it holds is well formed. ``s3dcp inspect`` and ``verify`` read it
directly, without torch; :func:`s3dcp.format.metadata.decode_metadata` builds DCP's
:class:`~torch.distributed.checkpoint.metadata.Metadata` from it (:mod:`s3dcp.format.metadata.dcp`).

Names stand where DCP has torch objects: dtypes, layouts and memory formats by canonical name
(checked by :mod:`s3dcp.format.metadata.names`), sizes and offsets as tuples of ints, storage
keys as :class:`StorageKey` tuples. ``planner_data`` is the decoded tagged tree with
:class:`TreeSize` and :class:`TreeDtype` where the tree holds a torch.Size or a torch.dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import numpy as np

from ..layout import ItemLocation

__all__ = ["PlainMetadata", "PlainTensor", "PlainBytes", "Properties", "ChunkLayout", "StorageKey", "StorageList",
           "StoredMeta", "TreeSize", "TreeDtype"]


class Properties(NamedTuple):
    """A tensor's properties by name: DCP's TensorProperties without torch."""

    dtype: str
    layout: str
    requires_grad: bool
    memory_format: str
    pin_memory: bool


class ChunkLayout:
    """A tensor's chunk boxes: ``offsets`` and ``sizes``, one tuple per chunk. In version 2 every
    tensor of one shape shares one layout object (and its tuples); ``first`` is None when all
    offsets differ (always, from DCP), else per chunk whether no earlier chunk has its offsets."""

    __slots__ = ("offsets", "sizes", "first", "zero_d")

    def __init__(self, offsets: list, sizes: list, zero_d: bool = False) -> None:
        self.offsets, self.sizes, self.zero_d = offsets, sizes, zero_d
        if zero_d and len(offsets) > 1:  # every box is the same empty one
            self.first = np.arange(len(offsets)) == 0
        else:
            self.first = _first_flags(offsets)

    def __len__(self) -> int:
        return len(self.offsets)


def _first_flags(offsets: list) -> np.ndarray | None:
    if len(offsets) < 2 or len(set(offsets)) == len(offsets):
        return None
    seen: set = set()
    flags = np.zeros(len(offsets), bool)
    for j, o in enumerate(offsets):
        if o not in seen:
            seen.add(o)
            flags[j] = True
    return flags


@dataclass(frozen=True)
class PlainTensor:
    """A tensor entry of ``state_dict_metadata``: properties, global size and chunk boxes."""

    properties: Properties
    size: tuple[int, ...]
    chunks: ChunkLayout


@dataclass(frozen=True)
class PlainBytes:
    """A non-tensor (bytes) entry of ``state_dict_metadata``."""


class StorageKey(NamedTuple):
    """DCP's MetadataIndex without torch: two keys with one ``fqn`` and ``offset`` are the same item."""

    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = None


class StorageList:
    """A version-1 ``storage_data``: keys and locations built in full, in order (version 2 keeps
    its columns: :class:`s3dcp.format.metadata.rows.Rows`, with the same ``n``, ``keys()``,
    ``locations()`` and ``items()``)."""

    def __init__(self, keys: list[StorageKey], locations: list[ItemLocation]) -> None:
        self._keys, self._locations = keys, locations
        self.n = len(keys)

    def keys(self) -> list[StorageKey]:
        return list(self._keys)

    def locations(self) -> list[ItemLocation]:
        return list(self._locations)

    def items(self) -> Iterator[tuple[StorageKey, ItemLocation]]:
        return zip(self._keys, self._locations)


class StoredMeta(NamedTuple):
    """DCP's StorageMeta as stored."""

    checkpoint_id: str | None
    save_id: str | None
    load_id: str | None
    modules: list[str]


class TreeSize(tuple):
    """A torch.Size in ``planner_data``, as a tuple."""

    __slots__ = ()


class TreeDtype(str):
    """A torch.dtype in ``planner_data``, by its (checked) name."""

    __slots__ = ()


@dataclass
class PlainMetadata:
    """A decoded metadata object of either format version (see the module docstring)."""

    version: int  # the format version: 1 or 2
    dcp_version: str | None
    state_dict: dict[str, PlainTensor | PlainBytes]
    storage: Any  # None, a StorageList (v1) or rows.Rows (v2): n, keys(), locations(), items()
    planner_data: Any
    storage_meta: StoredMeta | None
