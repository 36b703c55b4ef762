"""Taking version-2 metadata objects apart and putting them back together, as a hostile user would:
edit the header or a column, then recompute the trailer CRC so only s3dcp's own validation stands
between the edit and the reader. Shared by the hostile-input tests and the fuzzer."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np

from s3dcp.format.metadata import columns, v2

__all__ = ["parts", "pack", "put_column", "put_raw_column"]


def parts(data: bytes) -> tuple[dict, bytes]:
    """(header, body) of a version-2 object."""
    (head_len,) = struct.unpack_from("<Q", data, 8)
    return json.loads(data[16:16 + head_len]), data[16 + head_len:-4]


def pack(header: dict, body: bytes) -> bytes:
    """A version-2 object of ``header`` and ``body`` with a valid trailer CRC."""
    head = json.dumps(header).encode()
    out = v2.MAGIC + struct.pack("<Q", len(head)) + head + body
    return out + struct.pack("<I", zlib.crc32(out))


def put_raw_column(header: dict, body: bytes, name: str, raw: bytes, *, kind: str, count: int,
                   codec: str = "none") -> bytes:
    """Point column ``name`` at ``raw`` (appended to ``body``), declaring ``count`` values; returns the new body."""
    header["columns"][name] = {"type": kind, "count": count, "offset": len(body), "length": len(raw), "codec": codec}
    return body + raw


def put_column(header: dict, body: bytes, name: str, values, kind: str = "u4", codec: str = "none") -> bytes:
    """Replace column ``name`` with ``values`` stored as ``kind`` (``codec`` "none" or "zlib"); returns the new body."""
    raw = np.asarray(values, dtype=columns.TYPES[kind]).tobytes()
    if codec == "zlib":
        raw = zlib.compress(raw, 6)
    return put_raw_column(header, body, name, raw, kind=kind, count=len(values), codec=codec)
