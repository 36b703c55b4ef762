"""DCP's Metadata <-> s3dcp's format: the torch side, built on the plain decode.

:func:`decode_metadata` is :func:`~s3dcp.format.metadata.decoding.decode_plain` (every check and
bound) followed by :func:`to_metadata`, which only builds DCP's classes from what the plain
decode gave: TensorStorageMetadata with torch.Size boxes (interned, and shared by the tensors of
one chunk layout, as the plain layouts are), torch dtypes, MetadataIndex keys, and a version-2
``storage_data`` that stays lazy (:class:`~s3dcp.format.metadata.storage.LazyStorageData`).
:func:`encode_metadata` writes version 2 (:mod:`~s3dcp.format.metadata.v2`), 3 where it pays
(:mod:`~s3dcp.format.metadata.v3`), or 1 (:mod:`~s3dcp.format.metadata.v1`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from . import v1, v2, v3
from .common import _READS
from .decoding import decode_either, decoding
from .dtypes import _DTYPES, _LAYOUTS, _MEMORY_FORMATS, _from_name
from .fields import _type_name
from .plain import ChunkLayout, PlainMetadata, PlainTensor, StorageList, TreeDtype, TreeSize
from .rows import Rows
from .storage import LazyStorageData

__all__ = ["encode_metadata", "decode_metadata", "to_metadata"]


def encode_metadata(md: Metadata, *, version: int | None = None) -> bytes:
    """Encode ``md`` in format ``version``: 3 (columnar, compressed header), 2 (columnar), 1 (JSON text).

    ``None`` (the default) writes version 2, or version 3 where that saves at least 64 KiB and
    1/8 of the object (:func:`s3dcp.format.metadata.v3.worth_it`: many uniquely named tensors),
    so that checkpoints stay readable by the s3dcp releases that read only 1 and 2 unless
    version 3 pays. The same object always gives the same bytes. Anything that cannot be stored
    exactly raises TypeError naming it; nothing is ever pickled.
    """
    if not isinstance(md, Metadata):
        raise TypeError(f"expected torch.distributed.checkpoint.metadata.Metadata, got {_type_name(md)}")
    if md.version is not None and type(md.version) is not str:
        raise TypeError(f"Metadata.version must be a str or None, got {_type_name(md.version)}")
    if version is None:
        second = v2.encode(md)
        third = v3.encode(second)
        return third if v3.worth_it(len(second), len(third)) else second
    if version == 3:
        return v3.encode(v2.encode(md))
    if version == 2:
        return v2.encode(md)
    if version == 1:
        return v1.encode(md)
    raise ValueError(f"version={version!r}: s3dcp writes metadata format versions {_READS}")


def decode_metadata(data: bytes, *, source: str = "<metadata>", lazy: bool = True) -> Metadata:
    """Decode bytes written by :func:`encode_metadata`, format version 1, 2 or 3.

    Anything else (garbage, a pickle, another format, a newer version, a truncated or damaged
    object, a missing or ill-typed field) raises MetadataFormatError naming ``source``. Nothing
    in ``data`` can run code: only the DCP metadata classes and plain values are ever built.

    ``state_dict_metadata`` is always decoded in full. With ``lazy`` (the default) a version-2/3
    ``storage_data`` is a read-only :class:`~s3dcp.format.metadata.v2.LazyStorageData` mapping that
    builds each ItemLocation when it is looked up; ``lazy=False`` (and version 1) gives a dict.
    """
    with decoding(source):
        return to_metadata(decode_either(bytes(data)), lazy=lazy)


def to_metadata(plain: PlainMetadata, *, lazy: bool = True) -> Metadata:
    """DCP's Metadata of a plain decode (names to torch objects; a name the running torch lacks
    raises MetadataFormatError)."""
    sizes: dict[tuple, torch.Size] = {}
    layouts: dict[int, tuple[list, list]] = {}  # id(plain layout) -> (torch.Size offsets, chunks)
    props: dict[tuple, tuple] = {}
    sdm: dict[str, Any] = {}
    offsets: list[list | None] = []  # per fqn of state_dict_metadata: chunk offsets as torch.Size
    for fqn, item in plain.state_dict.items():
        if type(item) is not PlainTensor:
            sdm[fqn] = BytesStorageMetadata()
            offsets.append(None)
            continue
        lay = layouts.get(id(item.chunks))
        if lay is None:
            lay = layouts[id(item.chunks)] = _chunks(item.chunks, sizes)
        p = props.get(item.properties)
        if p is None:
            d, kind, grad, mf, pin = item.properties
            p = props[item.properties] = (_from_name(_DTYPES, d, "dtype"), _from_name(_LAYOUTS, kind, "layout"), grad,
                                          _from_name(_MEMORY_FORMATS, mf, "memory_format"), pin)
        sdm[fqn] = TensorStorageMetadata(TensorProperties(*p), _size(item.size, sizes), list(lay[1]))
        offsets.append(lay[0])
    sm = plain.storage_meta
    return Metadata(
        state_dict_metadata=sdm,
        planner_data=_tree(plain.planner_data),
        storage_data=_storage(plain.storage, offsets, sizes, lazy),
        storage_meta=None if sm is None else StorageMeta(sm.checkpoint_id, sm.save_id, sm.load_id, sm.modules),
        version=plain.dcp_version,
    )


def _size(t: tuple, sizes: dict) -> torch.Size:
    s = sizes.get(t)
    if s is None:
        s = sizes[t] = torch.Size(t)
    return s


def _chunks(layout: ChunkLayout, sizes: dict) -> tuple[list, list]:
    if layout.zero_d and layout.offsets:  # every box is the same empty one: share it
        empty = _size((), sizes)
        return [empty] * len(layout), [ChunkStorageMetadata(empty, empty)] * len(layout)
    offsets = [_size(o, sizes) for o in layout.offsets]
    return offsets, list(map(ChunkStorageMetadata, offsets, [_size(s, sizes) for s in layout.sizes]))


def _storage(storage: Any, offsets: list, sizes: dict, lazy: bool) -> Any:
    if storage is None:
        return None
    if isinstance(storage, StorageList):
        return {MetadataIndex(k.fqn, k.offset, k.index): loc for k, loc in storage.items()}
    assert isinstance(storage, Rows)
    chunk_offsets = offsets + [None] * (len(storage.fqns) - len(offsets))  # fqns only storage keys use
    odd = {row: None if o is None else _size(o, sizes) for row, o in storage.odd_keys.items()}
    data = LazyStorageData(storage, chunk_offsets, odd)
    return data if lazy else data.to_dict()


_PLAIN = frozenset({type(None), bool, int, float, str, bytes})


def _tree(node: Any) -> Any:
    """planner_data with torch objects where the tree has TreeSize and TreeDtype (a list or tuple
    of plain values as it is: no call per value, see tree.decode_tree)."""
    t = type(node)
    if t is TreeSize:
        return torch.Size(node)
    if t is TreeDtype:
        return _from_name(_DTYPES, str(node), "dtype")
    if t is list:
        return node if _PLAIN.issuperset(map(type, node)) else [_tree(v) for v in node]
    if t is tuple:
        return node if _PLAIN.issuperset(map(type, node)) else tuple(_tree(v) for v in node)
    if t is dict:
        return {_tree(k): _tree(v) for k, v in node.items()}
    return node
