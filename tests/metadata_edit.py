"""Hand edits of a real version-2 ``.metadata`` object, as a hostile user with write access to
the bucket would make them: one column's values changed, the trailer CRC recomputed so the
object still passes its integrity check. Byte-level (header JSON, column bytes, trailer), not
through the encoder, so the edits do not depend on what the encoder accepts."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np

from s3dcp.format.metadata.budget import DecodeBudget
from s3dcp.format.metadata.columns import ColumnReader

__all__ = ["column", "edit_column", "header", "with_crc"]

_HEAD = struct.Struct("<8sQ")
_TRAILER = struct.Struct("<I")


def _split(raw: bytes) -> tuple[bytes, dict, bytes]:
    magic, head_len = _HEAD.unpack_from(raw)
    assert magic == b"\x89S3DCPMD", "not a version-2 metadata object"
    head = json.loads(raw[_HEAD.size:_HEAD.size + head_len])
    return magic, head, raw[_HEAD.size + head_len:-_TRAILER.size]


def header(raw: bytes) -> dict:
    """The JSON header of a v2 object."""
    return _split(raw)[1]


def column(raw: bytes, name: str) -> list[int]:
    """The values of column ``name``."""
    _, head, body = _split(raw)
    return ColumnReader(head["columns"], memoryview(body), DecodeBudget(len(raw))).ints(name).tolist()


def with_crc(without_trailer: bytes) -> bytes:
    """``without_trailer`` followed by the trailer CRC the decoder checks (zlib.crc32 of all before it)."""
    return without_trailer + _TRAILER.pack(zlib.crc32(without_trailer))


def edit_column(raw: bytes, name: str, edit) -> bytes:
    """``raw`` with column ``name`` replaced by ``edit(values)`` (a list of ints), stored as a
    plain ``i8`` column (or ``json`` for values outside 64 bits) appended to the body; every other
    byte of the body stays where it was, and the trailer CRC is valid again."""
    magic, head, body = _split(raw)
    values = edit(column(raw, name))
    if all(-(2**63) <= v < 2**63 for v in values):
        data, kind = np.array(values, dtype="<i8").tobytes(), "i8"
    else:
        data, kind = json.dumps(values).encode("ascii"), "json"
    head["columns"][name] = {"type": kind, "count": len(values), "offset": len(body), "length": len(data),
                             "codec": "none"}
    text = json.dumps(head).encode("utf-8")
    return with_crc(_HEAD.pack(magic, len(text)) + text + body + data)
