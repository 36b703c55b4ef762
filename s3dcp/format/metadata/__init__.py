"""DCP checkpoint metadata in a versioned, self-describing format (never pickle).

torch's own storage plugins pickle :class:`~torch.distributed.checkpoint.metadata.Metadata`, so
loading a checkpoint can run arbitrary code and ties the file to the Python classes of the
writer. s3dcp writes its own format instead, and decoding builds only the known DCP classes and
plain values. Two versions exist; :func:`decode_metadata` reads both, telling them apart by the
first byte, and :func:`encode_metadata` writes version 2 unless asked for 1:

- version 2 (:mod:`s3dcp.format.metadata.v2`): a JSON header plus typed, compressed binary columns for the
  per-chunk numbers; ~1/40 of DCP's pickle at a million chunks, and decoded lazily: storage
  locations are built only for the items a rank reads. It starts with the byte 0x89.
- version 1 (this module): one JSON document, starting with ``{``. Simple to read with any
  tool, but at 1,000+ ranks it is hundreds of MB that every rank parses in full.

Version 1 looks like this (version 2 reuses its vocabulary for the header)::

    {"format": "s3dcp-metadata", "version": 1, "dcp_version": "1.0.0",
     "state_dict_metadata": {"model.w": {"type": "tensor",
                                         "properties": {"dtype": "bfloat16", "layout": "strided",
                                                        "requires_grad": false,
                                                        "memory_format": "contiguous_format",
                                                        "pin_memory": false},
                                         "size": [4, 8],
                                         "chunks": [{"offsets": [0, 0], "sizes": [4, 8]}]},
                             "step": {"type": "bytes"}},
     "storage_data": [{"index": {"fqn": "model.w", "offset": [0, 0], "index": 0},
                       "location": {"object_name": "__0_0.data", "offset": 0, "length": 64,
                                    "checksum": "crc32c:1a2b3c4d", "dtype": "bfloat16",
                                    "shape": [4, 8], "block_size": 0, "block_checksums": []}}],
     "planner_data": <tagged tree>, "storage_meta": {"checkpoint_id": ..., "save_id": ...,
                                                     "load_id": ..., "modules": [...]}}

``planner_data`` belongs to whichever planner wrote the checkpoint, so it is stored as a
*tagged tree*: ``None``, bools, ints, strings, finite floats and lists are plain JSON; every
other value is a one-key object whose key names its type::

    {"__tuple__": [...]}            tuple
    {"__dict__": [[k, v], ...]}     dict, always tagged, so any key type (and a user key that
                                    happens to be "__tuple__") survives, in insertion order
    {"__bytes__": "<base64>"}       bytes
    {"__float__": "nan"}            nan, "inf" or "-inf" (JSON has no literal for them)
    {"__size__": [...]}             torch.Size
    {"__dtype__": "float32"}        torch.dtype

Anything else is refused with a TypeError naming it and where it was; there is no pickle
fallback. Exact types are required (an IntEnum or a namedtuple is refused) because decoding
could not give them back.

Readers refuse another ``format``, a newer ``version`` and any missing or ill-typed field with
:class:`~s3dcp.errors.MetadataFormatError`. Unknown extra fields (and, in version 2, unknown
columns) are ignored, so a later writer may add optional ones without bumping the version.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any, Callable

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

from ...errors import MetadataFormatError
from ..layout import ItemLocation

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "encode_metadata", "decode_metadata", "format_version_of", "dtype_to_str",
    "str_to_dtype",
]

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


# ---------------------------------------------------------------------------------------------
# Encoding


def encode_metadata(md: Metadata, *, version: int = FORMAT_VERSION) -> bytes:
    """Encode ``md`` in format ``version`` (2: columnar, the default; 1: JSON text, pure ASCII).

    The same object always gives the same bytes. Anything that cannot be stored exactly raises
    TypeError naming it; nothing is ever pickled.
    """
    if not isinstance(md, Metadata):
        raise TypeError(f"expected torch.distributed.checkpoint.metadata.Metadata, got {_type_name(md)}")
    if md.version is not None and type(md.version) is not str:
        raise TypeError(f"Metadata.version must be a str or None, got {_type_name(md.version)}")
    if version == 2:
        from . import v2 as metadata_v2  # imported here: it builds on the helpers of this module

        return metadata_v2.encode(md)
    if version != 1:
        raise ValueError(f"version={version!r}: s3dcp writes metadata format versions {_READS}")
    sdm = {}
    for fqn, item in md.state_dict_metadata.items():
        if type(fqn) is not str:  # json.dumps would silently turn an int key into a string
            raise TypeError(f"state_dict_metadata key {fqn!r} is a {_type_name(fqn)}, not a str")
        sdm[fqn] = _encode_storage(item, f"state_dict_metadata[{fqn!r}]")
    doc = {
        "format": FORMAT_NAME,
        "version": 1,
        "dcp_version": md.version,
        "state_dict_metadata": sdm,
        "storage_data": _encode_storage_data(md.storage_data),
        "planner_data": _encode_tree(md.planner_data, "planner_data"),
        "storage_meta": _encode_storage_meta(md.storage_meta),
    }
    # ensure_ascii keeps any str (even a lone surrogate) lossless; allow_nan=False proves the
    # tagged tree left no bare nan/inf behind.
    return json.dumps(doc, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _encode_storage(item: Any, where: str) -> dict:
    if isinstance(item, BytesStorageMetadata):
        return {"type": "bytes"}
    if not isinstance(item, TensorStorageMetadata):
        raise TypeError(f"{where}: cannot encode storage metadata of type {_type_name(item)}")
    p = item.properties
    return {
        "type": "tensor",
        "properties": {
            "dtype": dtype_to_str(p.dtype),
            "layout": _to_name(_LAYOUTS, p.layout, "layout"),
            "requires_grad": bool(p.requires_grad),
            "memory_format": _to_name(_MEMORY_FORMATS, p.memory_format, "memory_format"),
            "pin_memory": bool(p.pin_memory),
        },
        "size": list(item.size),
        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in item.chunks],
    }


def _encode_storage_data(sd: Any) -> list | None:
    if sd is None:
        return None
    if not isinstance(sd, Mapping):  # a dict, or the lazy mapping a v2 decode gives
        raise TypeError(
            f"storage_data must be dict[MetadataIndex, ItemLocation] or None, got {_type_name(sd)}"
        )
    out = []
    for key, loc in sd.items():
        if not isinstance(key, MetadataIndex) or not isinstance(loc, ItemLocation):
            raise TypeError(
                f"storage_data[{key!r}]: expected MetadataIndex -> ItemLocation, "
                f"got {_type_name(key)} -> {_type_name(loc)}"
            )
        out.append({
            "index": {
                "fqn": key.fqn,
                "offset": None if key.offset is None else list(key.offset),
                "index": key.index,
            },
            "location": {
                "object_name": loc.object_name,
                "offset": loc.offset,
                "length": loc.length,
                "checksum": loc.checksum,
                "dtype": loc.dtype,
                "shape": None if loc.shape is None else list(loc.shape),
                "block_size": loc.block_size,
                "block_checksums": list(loc.block_checksums),
            },
        })
    return out


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


def _encode_tree(obj: Any, path: str) -> Any:
    """Encode a planner_data-like tree with the tags described in the module docstring."""
    t = type(obj)
    if obj is None or t is bool or t is int or t is str:
        return obj
    if t is float:
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}  # 'nan', 'inf', '-inf'
    if t is list:
        return [_encode_tree(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if t is tuple:
        return {"__tuple__": [_encode_tree(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if t is dict:
        return {"__dict__": [[_encode_tree(k, f"{path} key {k!r}"), _encode_tree(v, f"{path}[{k!r}]")]
                             for k, v in obj.items()]}
    if t is bytes:
        return {"__bytes__": base64.b64encode(obj).decode("ascii")}
    if t is torch.Size:
        return {"__size__": list(obj)}
    if t is torch.dtype:
        return {"__dtype__": dtype_to_str(obj)}
    raise TypeError(
        f"{path}: cannot encode a {_type_name(obj)} in s3dcp metadata; allowed are None, bool, int, "
        "float, str, bytes, list, tuple, dict, torch.Size and torch.dtype (s3dcp never pickles)"
    )


# ---------------------------------------------------------------------------------------------
# Decoding


def decode_metadata(data: bytes, *, source: str = "<metadata>", lazy: bool = True) -> Metadata:
    """Decode bytes written by :func:`encode_metadata`, format version 1 or 2.

    Anything else (garbage, a pickle, another format, a newer version, a truncated or damaged
    object, a missing or ill-typed field) raises MetadataFormatError naming ``source``. Nothing
    in ``data`` can run code: only the DCP metadata classes and plain values are ever built.

    ``state_dict_metadata`` is always decoded in full. With ``lazy`` (the default) a version-2
    ``storage_data`` is a read-only :class:`~s3dcp.format.metadata.v2.LazyStorageData` mapping that
    builds each ItemLocation when it is looked up; ``lazy=False`` (and version 1) gives a dict.
    """
    try:
        data = bytes(data)
        with _gc_paused():
            if data[:1] == b"\x89":
                from . import v2 as metadata_v2

                if data.startswith(metadata_v2.MAGIC):
                    return metadata_v2.decode(data, lazy=lazy)
                raise MetadataFormatError("not s3dcp metadata: starts with byte 0x89 but not with the s3dcp magic")
            return _decode(data)
    except MetadataFormatError as e:
        raise MetadataFormatError(f"{source}: {e}") from None
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, RecursionError) as e:
        # Safety net: a malformed document must surface as a format error, whatever tripped on it.
        raise MetadataFormatError(f"{source}: corrupt s3dcp metadata ({type(e).__name__}: {e})") from e


def _decode(data: bytes) -> Metadata:
    if not data.strip():
        raise MetadataFormatError("not s3dcp metadata: the object is empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:  # a pickle, for one, starts with byte 0x80
        msg = f"not s3dcp metadata: not UTF-8 JSON text (bad byte at offset {e.start})"
        raise MetadataFormatError(msg) from None
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise MetadataFormatError(f"not s3dcp metadata: not valid JSON ({e})") from None
    if type(doc) is not dict or "format" not in doc:
        raise MetadataFormatError(f"not s3dcp metadata: a JSON {_json_type(doc)} without a 'format' field")
    if doc["format"] != FORMAT_NAME:
        msg = f"not s3dcp metadata: format is {_short(doc['format'])}, expected {FORMAT_NAME!r}"
        raise MetadataFormatError(msg)
    # The version is checked before anything else is read: a newer layout may differ anywhere.
    _check_version(_get(doc, "version", "metadata", _int), 1)

    sdm = _get(doc, "state_dict_metadata", "metadata", _dict)
    storage_meta = _get(doc, "storage_meta", "metadata")
    return Metadata(
        state_dict_metadata={k: _decode_storage(v, f"state_dict_metadata[{k!r}]") for k, v in sdm.items()},
        planner_data=_decode_tree(_get(doc, "planner_data", "metadata"), "planner_data"),
        storage_data=_decode_storage_data(_get(doc, "storage_data", "metadata")),
        storage_meta=None if storage_meta is None else _decode_storage_meta(storage_meta),
        version=_get(doc, "dcp_version", "metadata", _opt(_str)),
    )


@contextlib.contextmanager
def _gc_paused():
    """Pause Python's cyclic garbage collector while a decode runs.

    A decode allocates up to millions of objects (chunk boxes, keys, locations), and the collector
    runs every few hundred allocations, walking ever more of them: at 115k chunks that is over 80%
    of a full decode (and of unpickling DCP's metadata too). What a decode builds holds no reference
    cycles, so there is nothing for the collector to find; it is switched back on afterwards, on
    every path, unless it was off before.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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


_V1_PREFIX = re.compile(rb'\s*\{\s*"format"\s*:\s*"s3dcp-metadata"\s*,\s*"version"\s*:\s*(\d{1,9})\s*[,}]')


def format_version_of(data: bytes) -> int | None:
    """The format version ``data`` claims (1 or 2, say), or None if it is not s3dcp metadata.

    Reads only the header (v2) or the first fields (v1 as s3dcp writes it), not the whole object.
    """
    from . import v2 as metadata_v2

    if bytes(data[: len(metadata_v2.MAGIC)]) == metadata_v2.MAGIC:
        try:
            version = metadata_v2.header_of(data).get("version")
        except MetadataFormatError:
            return None
        return version if type(version) is int else None
    match = _V1_PREFIX.match(bytes(data[:200]))
    if match:
        return int(match.group(1))
    try:  # JSON in another field order: parse it all
        doc = json.loads(bytes(data))
    except (ValueError, RecursionError):
        return None
    version = doc.get("version") if type(doc) is dict and doc.get("format") == FORMAT_NAME else None
    return version if type(version) is int else None


def _decode_storage(node: Any, where: str) -> TensorStorageMetadata | BytesStorageMetadata:
    kind = _get(node, "type", where)
    if kind == "bytes":
        return BytesStorageMetadata()
    if kind != "tensor":
        raise MetadataFormatError(f"{where}.type: unknown storage type {_short(kind)}")
    p, pw = _get(node, "properties", where), f"{where}.properties"
    properties = TensorProperties(
        dtype=_get(p, "dtype", pw, _named(_DTYPES, "dtype")),
        layout=_get(p, "layout", pw, _named(_LAYOUTS, "layout")),
        requires_grad=_get(p, "requires_grad", pw, _bool),
        memory_format=_get(p, "memory_format", pw, _named(_MEMORY_FORMATS, "memory_format")),
        pin_memory=_get(p, "pin_memory", pw, _bool),
    )
    chunks = _get(node, "chunks", where, _list)
    return TensorStorageMetadata(
        properties=properties,
        size=_get(node, "size", where, _size),
        chunks=[
            ChunkStorageMetadata(
                offsets=_get(c, "offsets", f"{where}.chunks[{i}]", _size),
                sizes=_get(c, "sizes", f"{where}.chunks[{i}]", _size),
            )
            for i, c in enumerate(chunks)
        ],
    )


def _decode_storage_data(node: Any) -> dict[MetadataIndex, ItemLocation] | None:
    if node is None:
        return None
    out: dict[MetadataIndex, ItemLocation] = {}
    for i, entry in enumerate(_list(node, "storage_data")):
        w = f"storage_data[{i}]"
        idx, iw = _get(entry, "index", w), f"{w}.index"
        loc, lw = _get(entry, "location", w), f"{w}.location"
        key = MetadataIndex(
            fqn=_get(idx, "fqn", iw, _str),
            offset=_get(idx, "offset", iw, _opt(_ints)),
            index=_get(idx, "index", iw, _opt(_int)),
        )
        if key in out:  # a dict would silently keep only the last one
            raise MetadataFormatError(f"{w}: duplicate entry for {key.fqn!r} at offset {key.offset}")
        out[key] = ItemLocation(
            object_name=_get(loc, "object_name", lw, _str),
            offset=_get(loc, "offset", lw, _int),
            length=_get(loc, "length", lw, _int),
            checksum=_get(loc, "checksum", lw, _opt(_str)),
            dtype=_get(loc, "dtype", lw, _opt(_str)),
            shape=_get(loc, "shape", lw, _opt(_ints)),
            block_size=_get(loc, "block_size", lw, _int),
            block_checksums=tuple(_str(c, f"{lw}.block_checksums[{j}]")
                                  for j, c in enumerate(_get(loc, "block_checksums", lw, _list))),
        )
    return out


def _decode_storage_meta(node: Any) -> StorageMeta:
    w = "storage_meta"
    modules = _get(node, "modules", w, _list)
    return StorageMeta(
        checkpoint_id=_get(node, "checkpoint_id", w, _opt(_str)),
        save_id=_get(node, "save_id", w, _opt(_str)),
        load_id=_get(node, "load_id", w, _opt(_str)),
        modules=[_str(m, f"{w}.modules[{i}]") for i, m in enumerate(modules)],
    )


def _decode_tree(node: Any, where: str) -> Any:
    """Inverse of :func:`_encode_tree`."""
    t = type(node)
    if node is None or t is bool or t is int or t is float or t is str:
        return node
    if t is list:
        return [_decode_tree(v, f"{where}[{i}]") for i, v in enumerate(node)]
    if len(node) != 1:
        msg = f"{where}: expected a one-key tagged object, got keys {_short(sorted(node))}"
        raise MetadataFormatError(msg)
    ((tag, body),) = node.items()
    if tag == "__tuple__":
        return tuple(_decode_tree(v, f"{where}[{i}]") for i, v in enumerate(_list(body, where)))
    if tag == "__dict__":
        out = {}
        for i, pair in enumerate(_list(body, where)):
            if type(pair) is not list or len(pair) != 2:
                raise MetadataFormatError(f"{where}: entry {i} of a __dict__ is not a [key, value] pair")
            out[_decode_tree(pair[0], f"{where} key {i}")] = _decode_tree(pair[1], f"{where}[{i}]")
        return out
    if tag == "__bytes__":
        return base64.b64decode(_str(body, where), validate=True)
    if tag == "__float__":
        if body not in ("nan", "inf", "-inf"):
            raise MetadataFormatError(f"{where}: bad __float__ value {_short(body)}")
        return float(body)
    if tag == "__size__":
        return _size(body, where)
    if tag == "__dtype__":
        return _from_name(_DTYPES, body, "dtype")
    raise MetadataFormatError(f"{where}: unknown tag {_short(tag)}")


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
