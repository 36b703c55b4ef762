"""What both metadata format versions share: names, the version check and checked access.

- the format's name and versions (:data:`FORMAT_NAME`, :data:`FORMAT_VERSION`, the versions read);
- torch's dtypes, layouts and memory formats by canonical name (:func:`dtype_to_str`,
  :func:`str_to_dtype`), so a future torch's new dtypes need no code change;
- ``storage_meta``, which both versions store as the same JSON object;
- checked access to decoded JSON (``_get``, ``_str``, ``_int``, ``_ints``, ...): exact type checks
  whose errors name the field, so untrusted metadata is refused with a
  :class:`~s3dcp.errors.MetadataFormatError` that says where.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import StorageMeta

from ...errors import MetadataFormatError

FORMAT_NAME = "s3dcp-metadata"
FORMAT_VERSION = 2  # the version every s3dcp since 2 reads; encode_metadata writes 3 only where it pays
_READS = (1, 2, 3)


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
        kind = "JSON text" if version == 1 else "binary (it starts with byte 0x89)"
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


# ---------------------------------------------------------------------------------------------
# Checked access. Type checks are exact, so a JSON true is never taken for the integer 1.


def _get(obj: Any, key: str, where: str, check: Callable[[Any, str], Any] | None = None) -> Any:
    """``obj[key]`` of a JSON object, passed through ``check(value, path)`` when given."""
    if type(obj) is not dict:
        raise MetadataFormatError(f"{where}: expected a JSON object, got a JSON {_json_type(obj)}")
    if key not in obj:
        raise MetadataFormatError(f"{where}: missing field {key!r}")
    return obj[key] if check is None else check(obj[key], f"{where}.{key}")


def _exact(t: type, name: str) -> Callable[[Any, str], Any]:
    def check(value: Any, where: str) -> Any:
        if type(value) is not t:
            raise MetadataFormatError(f"{where}: expected a JSON {name}, got a JSON {_json_type(value)}")
        return value

    return check


_str, _int, _bool = _exact(str, "string"), _exact(int, "integer"), _exact(bool, "boolean")
_list, _dict = _exact(list, "array"), _exact(dict, "object")


def _opt(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda value, where: None if value is None else check(value, where)


def _named(table: dict[str, Any], what: str) -> Callable[[Any, str], Any]:
    return lambda value, where: _from_name(table, value, what)


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if type(value) is not list or any(type(v) is not int for v in value):
        raise MetadataFormatError(f"{where}: expected an array of integers, got {_short(value)}")
    return tuple(value)


def _size(value: Any, where: str) -> torch.Size:
    return torch.Size(_ints(value, where))


def _reject_constant(name: str) -> Any:
    raise MetadataFormatError(f"non-standard JSON constant {name}")


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _type_name(value: Any) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
