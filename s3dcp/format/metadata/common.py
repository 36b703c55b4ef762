"""What both metadata format versions share: names and the version check.

- the format's name and versions (:data:`FORMAT_NAME`, :data:`FORMAT_VERSION`, the versions read);
- torch's dtypes, layouts and memory formats by canonical name (:func:`dtype_to_str`,
  :func:`str_to_dtype`), so a future torch's new dtypes need no code change;
- ``storage_meta``, which both versions store as the same JSON object;
- (checked access to decoded JSON is :mod:`s3dcp.format.metadata.fields`'s).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import StorageMeta

from ...errors import MetadataFormatError
from .fields import _get, _ints, _list, _opt, _short, _str

FORMAT_NAME = "s3dcp-metadata"
FORMAT_VERSION = 2  # what encode_metadata writes; decode_metadata reads 1 and 2
_READS = (1, 2)


def _name_table(kind: type) -> dict[str, Any]:
    # Keyed by str() without "torch.", so aliases (torch.half, torch.long, ...) collapse onto one
    # canonical name and new dtypes of future torch releases are picked up without a code change.
    return {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, kind)}


_DTYPES: dict[str, torch.dtype] = _name_table(torch.dtype)
_LAYOUTS: dict[str, torch.layout] = _name_table(torch.layout)
_MEMORY_FORMATS: dict[str, torch.memory_format] = _name_table(torch.memory_format)


def _to_name(table: dict[str, Any], value: Any, what: str) -> str:
    name = str(value).removeprefix("torch.")
    if table.get(name) is not value:
        raise TypeError(f"cannot encode {what} {value!r}: not a known torch {what}")
    return name


def _from_name(table: dict[str, Any], name: Any, what: str) -> Any:
    if type(name) is not str or name not in table:
        raise MetadataFormatError(
            f"unknown torch {what} {_short(name)} (torch {torch.__version__} has no such {what})"
        )
    return table[name]


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the canonical name, so ``torch.half`` gives ``"float16"``)."""
    return _to_name(_DTYPES, dtype, "dtype")


def str_to_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; an unknown name raises MetadataFormatError."""
    return _from_name(_DTYPES, name, "dtype")


def _check_version(version: int, container: int) -> None:
    """Refuse a version this s3dcp cannot read, or one stored in the other version's container."""
    if version > max(_READS):
        raise MetadataFormatError(
            f"written by a newer s3dcp (format version {version}); "
            f"this s3dcp reads versions {_READS[0]} to {_READS[-1]} — upgrade s3dcp"
        )
    if version not in _READS:
        raise MetadataFormatError(f"unsupported format version {version}; this s3dcp reads versions {_READS}")
    if version != container:
        kind = "binary (it starts with byte 0x89)" if version == 2 else "JSON text"
        raise MetadataFormatError(f"corrupt s3dcp metadata: format version {version} is {kind}, this object is not")


def _encode_storage_meta(sm: StorageMeta | None) -> dict | None:
    if sm is None:
        return None
    return {
        # A PathLike is stored as its str: the path is what matters, not the Python class.
        "checkpoint_id": None if sm.checkpoint_id is None else os.fsdecode(sm.checkpoint_id),
        "save_id": sm.save_id,
        "load_id": sm.load_id,
        "modules": list(sm.modules),
    }


def _decode_storage_meta(node: Any) -> StorageMeta:
    w = "storage_meta"
    modules = _get(node, "modules", w, _list)
    return StorageMeta(
        checkpoint_id=_get(node, "checkpoint_id", w, _opt(_str)),
        save_id=_get(node, "save_id", w, _opt(_str)),
        load_id=_get(node, "load_id", w, _opt(_str)),
        modules=[_str(m, f"{w}.modules[{i}]") for i, m in enumerate(modules)],
    )


def _named(table: dict[str, Any], what: str) -> Callable[[Any, str], Any]:
    return lambda value, where: _from_name(table, value, what)


def _size(value: Any, where: str) -> torch.Size:
    return torch.Size(_ints(value, where))
