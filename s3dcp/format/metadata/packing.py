"""A JSON value stored zlib-compressed when that pays, and read back within bounds (format version 3).

Version 3 keeps the whole header of version 2 (fqns, tables, column descriptions, planner data)
but stores it compressed: the header of a rank's 20,000 uniquely named tensors is mostly names
that share long prefixes (``model.layers.17.moe.experts.42.w1.weight``), which zlib shrinks ~8x.
Its entry in the object says how to read it::

    {"codec": "zlib", "length": 91234, "size": 803112}    # stored bytes, bytes once inflated

:func:`pack_json` keeps the plain bytes (codec ``none``) when compressing saves under 10%.
:func:`unpack_json` checks the entry before it inflates anything: ``size`` may not exceed what
``length`` compressed bytes can inflate to (deflate's best is ~1,032:1), nor
``max(4 MiB, 16 x the object's bytes)`` (a real header is at most a few times the object: the
columns hold the bulk). Inflating stops at the declared size, whatever the stream says, so a
small object cannot make a reader inflate or parse more than that; and the inflated text may
hold at most one JSON value per byte of the object (a real header: one per ~3), checked before
it is parsed. Plain data only: no torch.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from ...errors import MetadataFormatError
from .fields import _short

__all__ = ["pack_json", "unpack_json", "header_limit_bytes", "MIN_HEADER_LIMIT_BYTES", "HEADER_BYTES_PER_BYTE"]

MIN_HEADER_LIMIT_BYTES = 4 * 2**20
HEADER_BYTES_PER_BYTE = 16
CODECS = ("none", "zlib")
_ZLIB_LEVEL = 9  # written once per checkpoint, read by every rank: the extra encode time pays
_MIN_COMPRESS_BYTES = 256
_ZLIB_MAX_RATIO = 1032  # deflate's best: 258 bytes per 2-bit code (as in columns.py)
_ZLIB_SLACK_BYTES = 1024
_MIN_VALUES = 1 << 16


def header_limit_bytes(object_bytes: int) -> int:
    """The most bytes a packed header of an object of ``object_bytes`` may inflate to."""
    return max(MIN_HEADER_LIMIT_BYTES, HEADER_BYTES_PER_BYTE * object_bytes)


def pack_json(value: Any) -> tuple[dict, bytes]:
    """(entry, stored bytes) of ``value`` as compact ASCII JSON, zlib-compressed when that saves 10%."""
    raw = json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")
    if len(raw) >= _MIN_COMPRESS_BYTES:
        packed = zlib.compress(raw, _ZLIB_LEVEL)
        if len(packed) < 0.9 * len(raw):
            return {"codec": "zlib", "length": len(packed), "size": len(raw)}, packed
    return {"codec": "none", "length": len(raw), "size": len(raw)}, raw


def unpack_json(entry: Any, stored: memoryview, object_bytes: int, where: str) -> Any:
    """The JSON value ``entry`` describes; ``stored`` is exactly its ``length`` stored bytes.

    Refused with a MetadataFormatError naming ``where`` (and the field) before anything is
    inflated when the entry is ill-formed or declares more than the object can describe.
    """
    if type(entry) is not dict:
        raise MetadataFormatError(f"{where}: expected a JSON object describing the packed header")
    codec = entry.get("codec")
    if type(codec) is not str or codec not in CODECS:
        raise MetadataFormatError(f"{where}.codec: unknown codec {_short(codec, 40)}")
    length, size = entry.get("length"), entry.get("size")
    for name, value in (("length", length), ("size", size)):
        if type(value) is not int or value < 0:
            raise MetadataFormatError(f"{where}.{name}: expected a non-negative integer, got {_short(value, 40)}")
    if length != len(stored):
        raise MetadataFormatError(f"{where}.length: {length} bytes, the object holds {len(stored)} there")
    limit = header_limit_bytes(object_bytes)
    if size > limit:
        raise MetadataFormatError(
            f"{where}.size: declares a header of {size} bytes, more than a metadata object of {object_bytes} "
            f"bytes can describe (at most {limit}); the object is damaged or crafted")
    if codec == "none":
        if size != length:
            raise MetadataFormatError(f"{where}.size: {size} bytes, but {length} plain bytes are stored")
        raw = bytes(stored)
    else:
        if size > _ZLIB_MAX_RATIO * length + _ZLIB_SLACK_BYTES:
            raise MetadataFormatError(
                f"{where}.size: declares {size} bytes compressed into {length}: more than zlib can inflate to")
        try:
            d = zlib.decompressobj()
            raw = d.decompress(stored, size + 1)  # never more than declared, whatever the stream says
            if not d.eof or d.unused_data or d.unconsumed_tail:
                raise MetadataFormatError(
                    f"{where}: the compressed header is incomplete, longer than its declared size or has trailing bytes")
        except zlib.error as e:
            raise MetadataFormatError(f"{where}: corrupt compressed header ({e})") from None
        if len(raw) != size:
            raise MetadataFormatError(f"{where}.size: inflates to {len(raw)} bytes, declared {size}")
    # Parsing is bounded by the header's bytes, except that each value (a short string, a number,
    # an empty container) becomes a Python object of ~50 bytes for its 2 or 3 bytes of text. A real
    # header has about one per 3 object bytes (fqns and planner ids: ~30 inflated bytes each, packed
    # ~8x); refuse more than one per object byte before parsing.
    values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if values > max(_MIN_VALUES, object_bytes):
        raise MetadataFormatError(
            f"{where}: {values} JSON values in a header of a {object_bytes}-byte object, more than s3dcp writes "
            "(about one per 3 bytes of the object); the object is damaged or crafted")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MetadataFormatError(f"{where}: not valid JSON ({str(e)[:200]})") from None


def _reject_constant(name: str) -> Any:
    raise MetadataFormatError(f"non-standard JSON constant {name}")
